"""Rebuilding Gemma's SentencePiece BPE (`tokenizer.ggml.model == "llama"`, architecture gemma*) from GGUF metadata.

A Gemma GGUF stores its vocabulary (pieces spelled with ▁ for a space), scores and token types, but no
merges. The fast tokenizer is a BPE over those pieces with byte fallback (`<0x0A>` …), no prefix space,
spaces normalised to ▁, and merges recovered from the vocabulary the way transformers recovers them:
every way of cutting a piece into two pieces of the vocabulary is a merge, ranked by the piece's place
in the file (Gemma's scores do not follow its merge order; its piece order does), a longer left half
first among the cuts of one piece. Two quirks of the files are undone first: a piece made only of
spaces is stored with real spaces, and is looked up as ▁s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenizers import Tokenizer as FastTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers

from kvlab.errors import KvlabError
from kvlab.tokenizer.gguf_bpe import add_special_tokens

SPACE = "\u2581"  # SentencePiece's ▁
GEMMA_ARCHS = frozenset({"gemma", "gemma2", "gemma3"})


def respell(token: str) -> str:
    """Whitespace-only pieces holding a space are stored as spaces in Gemma GGUFs; SentencePiece spells them ▁."""
    return SPACE * len(token) if " " in token and not token.strip() else token


def recover_merges(vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    """Every (left, right) cut of every piece into two pieces of the vocabulary, in the order of the
    pieces' ids, the cuts of one piece longest left half first."""
    merges = []
    for token in sorted(vocab, key=vocab.__getitem__):
        for cut in range(len(token) - 1, 0, -1):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                merges.append((left, right))
    return merges


def build_gemma_bpe(meta: Mapping[str, Any], source: object) -> FastTokenizer:
    """The fast tokenizer for a Gemma GGUF's SentencePiece vocabulary; `source` names the file in errors."""
    arch = meta.get("general.architecture")
    if arch not in GEMMA_ARCHS:
        raise KvlabError(f"{source}: SentencePiece ('llama') tokenizers are supported for Gemma files only, "
                         f"not {arch!r}; use the model's tokenizer.json directory instead")  # fmt: skip
    stored: list[str] = meta["tokenizer.ggml.tokens"]
    tokens = [respell(t) for t in stored]
    vocab = {t: i for i, t in enumerate(tokens)}  # a piece listed twice keeps its last id (as transformers does)
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    model = models.BPE(vocab=vocab, merges=recover_merges(vocab), byte_fallback=True, fuse_unk=True,
                       unk_token=tokens[unk] if isinstance(unk, int) and 0 <= unk < len(tokens) else None)  # fmt: skip
    tok = FastTokenizer(model)
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")  # a no-op after the normalizer
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    add_special_tokens(tok, stored, meta.get("tokenizer.ggml.token_type"), vocab)
    return tok
