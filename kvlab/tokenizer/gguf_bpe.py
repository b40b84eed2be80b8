"""Rebuilding a byte-level BPE (`tokenizer.ggml.model == "gpt2"`) from a GGUF file's tokenizer metadata.

A GGUF file carries no `tokenizer.json`: it stores the vocabulary, the merges, the token types and the
special token ids as metadata under llama.cpp's key names. `build_byte_level_bpe` turns those back into a
fast `tokenizers.Tokenizer`, choosing the pre-tokenizer split regex the way llama.cpp does from
`tokenizer.ggml.pre`.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Mapping

import gguf
import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as FastTokenizer

from kvlab.errors import KvlabError

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------------------------------
# Pre-tokenizer split regexes, keyed by `tokenizer.ggml.pre` (the names llama.cpp's converter writes).
# ---------------------------------------------------------------------------------------------------------------------

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# "gpt2": GPT-2's own regex (the ByteLevel pre-tokenizer's built-in one).
# "digits": every digit on its own, then GPT-2's regex (StarCoder-family vocabularies, SmolLM).
_PRE_TOKENIZERS: dict[str, str] = {
    "default": "gpt2",
    "gpt-2": "gpt2",
    "gpt2": "gpt2",
    "mpt": "gpt2",
    "olmo": "gpt2",
    "jais": "gpt2",
    "smollm": "digits",
    "starcoder": "digits",
    "refact": "digits",
    "command-r": "digits",
    "codeshell": "digits",
    "exaone": "digits",
    "minerva-7b": "digits",
    "qwen2": _QWEN2_SPLIT,
    "stablelm2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "hunyuan": _QWEN2_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "pixtral": _LLAMA3_SPLIT,
    "gpt-4o": _GPT4O_SPLIT,
    "llama4": _GPT4O_SPLIT,
}
# llama.cpp matches a whole pre-token against the vocabulary before merging, and adds BOS by default, for these.
LLAMA3_FAMILY = frozenset({"llama-bpe", "llama3", "llama-v3", "falcon3", "dbrx", "smaug-bpe", "pixtral"})

_CONTROL = int(gguf.TokenType.CONTROL)
_USER_DEFINED = int(gguf.TokenType.USER_DEFINED)


def pre_tokenizer_name(meta: Mapping[str, Any]) -> str:
    """`tokenizer.ggml.pre`, or "default" when the file does not say."""
    return str(meta.get("tokenizer.ggml.pre", "default"))


# ---------------------------------------------------------------------------------------------------------------------
# Byte-level spelling.
# ---------------------------------------------------------------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character, which byte-level vocabularies are spelled in."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


_BYTE_CHARS = _bytes_to_unicode()
_NOT_BYTE_SPELLED = re.compile("[^" + re.escape("".join(_BYTE_CHARS.values())) + "]")


def _byte_spelled(token: str) -> str:
    """The token as a byte-level vocabulary spells it (most GGUF tokens already are)."""
    if _NOT_BYTE_SPELLED.search(token) is None:
        return token
    return "".join(_BYTE_CHARS[b] for b in token.encode("utf-8"))


# ---------------------------------------------------------------------------------------------------------------------
# Building the fast tokenizer.
# ---------------------------------------------------------------------------------------------------------------------


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    split = _PRE_TOKENIZERS.get(pre)
    if split is None:
        logger.warning("unknown tokenizer.ggml.pre %r; splitting text with GPT-2's regex", pre)
        split = "gpt2"
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if split == "gpt2":
        return byte_level
    if split == "digits":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def build_byte_level_bpe(meta: Mapping[str, Any], source: object) -> FastTokenizer:
    """The fast tokenizer for a `gpt2`-type GGUF vocabulary; `source` names the file in error messages."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges: list[str] | None = meta.get("tokenizer.ggml.merges")
    if merges is None:
        raise KvlabError(f"{source}: byte-level BPE vocabulary without tokenizer.ggml.merges")
    pre = pre_tokenizer_name(meta)
    if _NOT_BYTE_SPELLED.search("".join(tokens)) is None:  # the usual case: one regex pass instead of 150k
        spelled = tokens
    else:
        spelled = [_byte_spelled(t) for t in tokens]
    # token -> its first index (a respelled token can collide with an existing one): assign in reverse
    vocab: dict[str, int] = dict(zip(reversed(spelled), range(len(spelled) - 1, -1, -1)))
    merge_pairs = [tuple(m.split(" ", 1)) for m in merges]
    model = models.BPE(vocab=vocab, merges=merge_pairs, ignore_merges=pre in LLAMA3_FAMILY)
    tok = FastTokenizer(model)
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    add_special_tokens(tok, tokens, meta.get("tokenizer.ggml.token_type"), vocab)
    return tok


def add_special_tokens(tok: FastTokenizer, tokens: list[str], token_types: Any, vocab: Mapping[str, int]) -> None:
    """Register control tokens as special and user-defined ones as plain added tokens, so text never splits them.

    A control token spelled outside the byte alphabet is a llama.cpp mislabel and is left alone.
    """
    if token_types is None:
        return
    types = np.asarray(token_types)
    control = [tokens[i] for i in np.flatnonzero(types == _CONTROL) if tokens[i] in vocab]
    user = [tokens[i] for i in np.flatnonzero(types == _USER_DEFINED) if tokens[i] in vocab]
    if control:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    if user:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])


# ---------------------------------------------------------------------------------------------------------------------
# Special ids and BOS/EOS flags.
# ---------------------------------------------------------------------------------------------------------------------


def gguf_special_ids(meta: Mapping[str, Any], vocab_size: int) -> dict[str, int | None]:
    """`{bos, eos, eot, eom, padding, unknown}` ids from `tokenizer.ggml.*_token_id`; out-of-range ids become None."""
    ids: dict[str, int | None] = {}
    for name in ("bos", "eos", "eot", "eom", "padding", "unknown"):
        value = meta.get(f"tokenizer.ggml.{name}_token_id")
        ids[name] = int(value) if value is not None and 0 <= int(value) < vocab_size else None
    return ids


def gguf_add_bos_eos(meta: Mapping[str, Any]) -> tuple[bool, bool]:
    """Whether encoding adds BOS and EOS: the file's flags, else llama.cpp's defaults (BOS for Llama-3 vocabularies)."""
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", pre_tokenizer_name(meta) in LLAMA3_FAMILY))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    return add_bos, add_eos
