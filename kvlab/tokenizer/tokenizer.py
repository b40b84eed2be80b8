"""`Tokenizer`: a fast tokenizer plus what generation needs from it (special ids, stop ids, chat template)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import jinja2
from tokenizers import Tokenizer as FastTokenizer

from kvlab.errors import KvlabError
from kvlab.gguf_file import GGUFFile
from kvlab.tokenizer.chat_template import compile_chat_template, render_chat_template
from kvlab.tokenizer.gguf_bpe import build_byte_level_bpe, gguf_add_bos_eos, gguf_special_ids
from kvlab.tokenizer.gguf_spm import GEMMA_ARCHS, build_gemma_bpe
from kvlab.tokenizer.shield import ContentShield, control_tokens, encode_rendered

# Special tokens that end a turn or a document: generation stops on them as well as on the eos token.
_END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<end_of_turn>",
    "<|end|>",
    "</s>",
)


# Refusing a prompt too long for the context without tokenizing all of it (Tokenizer.prefix_beyond):
PREFIX_CHARS_PER_TOKEN = (2, 8)  # prefixes tried, in characters per token of the limit: CJK text, then English
PREFIX_MARGIN = 64  # tokens: the cut may change the tokens around it, never more


class Tokenizer:
    """A fast tokenizer plus what generation needs from it: special ids, stop ids and the chat template.

    Build it with `Tokenizer.load(path)` (a `.gguf` file or a directory with `tokenizer.json`), or with
    `Tokenizer.from_gguf_file(gguf)` from a GGUF file that is already open.
    """

    def __init__(
        self,
        backend: FastTokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Iterable[int] = (),
        pad_token_id: int | None = None,
        unk_token_id: int | None = None,
        chat_template: str | None = None,
        prepend_bos: bool = False,
        append_eos: bool = False,
    ) -> None:
        self._tok = backend
        self.bos_token_id = bos_token_id
        self.pad_token_id = pad_token_id
        self.unk_token_id = unk_token_id
        self.chat_template = chat_template
        specials = {i: t.content for i, t in backend.get_added_tokens_decoder().items() if getattr(t, "special", False)}
        self._special_ids = frozenset(specials)
        self._plain: FastTokenizer | None = None  # a copy that reads control tokens as text (chat content)
        self._control: tuple[str | None, dict[int, str]] | None = None  # (template, control_tokens) of the last chat
        self.eos_token_ids = self._stop_ids(eos_token_ids)
        # BOS/EOS that `encode(add_special_tokens=True)` adds itself (tokenizer.json post-processors add their own).
        self._prepend_bos = prepend_bos and bos_token_id is not None
        self._append_eos = append_eos and bool(self.eos_token_ids)
        self._template: jinja2.Template | None = None

    # -- loading ------------------------------------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        """From a `.gguf` file or a directory holding `tokenizer.json`."""
        path = Path(path)
        if path.is_dir():
            return cls.from_pretrained_dir(path)
        if path.is_file() and path.suffix.lower() == ".gguf":
            return cls.from_gguf(path)
        if not path.exists():
            raise KvlabError(f"no tokenizer at {path}: the path does not exist")
        raise KvlabError(f"cannot load a tokenizer from {path}: expected a .gguf file or a directory")

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """Rebuild the tokenizer a GGUF file describes in its `tokenizer.*` metadata."""
        path = Path(path)
        try:
            gguf = GGUFFile(path)
        except (OSError, ValueError) as e:  # e.g. an empty file cannot be memory-mapped
            raise KvlabError(f"cannot read GGUF file {path}: {e}") from e
        return cls.from_gguf_file(gguf)

    @classmethod
    def from_gguf_file(cls, gguf: GGUFFile) -> Tokenizer:
        """The tokenizer of an already opened GGUF file (so a model loader does not parse the file twice)."""
        meta = gguf.metadata
        kind = meta.get("tokenizer.ggml.model")
        if kind is None or "tokenizer.ggml.tokens" not in meta:
            raise KvlabError(
                f"{gguf.path} has no tokenizer in its metadata (no tokenizer.ggml.model/tokens keys); "
                "load the tokenizer from the model's tokenizer.json directory instead"
            )
        if kind == "llama" and meta.get("general.architecture") in GEMMA_ARCHS:
            backend = build_gemma_bpe(meta, gguf.path)  # SentencePiece BPE with byte fallback
        elif kind != "gpt2":
            raise KvlabError(
                f"{gguf.path}: tokenizer type {kind!r} is not supported yet (byte-level BPE, 'gpt2', and Gemma's "
                "SentencePiece are); use the model's tokenizer.json directory instead"
            )
        else:
            backend = build_byte_level_bpe(meta, gguf.path)
        ids = gguf_special_ids(meta, backend.get_vocab_size())
        add_bos, add_eos = gguf_add_bos_eos(meta)
        return cls(
            backend,
            bos_token_id=ids["bos"],
            eos_token_ids=[i for i in (ids["eos"], ids["eot"], ids["eom"]) if i is not None],
            pad_token_id=ids["padding"],
            unk_token_id=ids["unknown"],
            chat_template=meta.get("tokenizer.chat_template"),
            prepend_bos=add_bos,
            append_eos=add_eos,
        )

    @classmethod
    def from_pretrained_dir(cls, path: str | Path) -> Tokenizer:
        """From a Hugging Face style directory: `tokenizer.json`, `tokenizer_config.json`, `generation_config.json`."""
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise KvlabError(f"{path} has no tokenizer.json (only fast tokenizers are supported)")
        try:
            backend = FastTokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise KvlabError(f"cannot read {tokenizer_file}: {e}") from e
        config = _read_json(path / "tokenizer_config.json")
        generation = _read_json(path / "generation_config.json")

        def token_id(value: Any) -> int | None:
            content = value.get("content") if isinstance(value, Mapping) else value
            return backend.token_to_id(content) if isinstance(content, str) else None

        bos_id = token_id(config.get("bos_token"))
        if bos_id is None and isinstance(generation.get("bos_token_id"), int):
            bos_id = generation["bos_token_id"]
        eos_ids = [token_id(config.get("eos_token"))] + _as_id_list(generation.get("eos_token_id"))
        prepend_bos = bool(config.get("add_bos_token")) and bos_id is not None
        if prepend_bos and backend.encode("", add_special_tokens=True).ids[:1] == [bos_id]:
            prepend_bos = False  # tokenizer.json's post-processor already adds it
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_ids=[i for i in eos_ids if i is not None],
            pad_token_id=token_id(config.get("pad_token")),
            unk_token_id=token_id(config.get("unk_token")),
            chat_template=_dir_chat_template(path, config),
            prepend_bos=prepend_bos,
        )

    # -- encoding and decoding ----------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`; special tokens written in the text stay whole. Adds BOS/EOS as the model asks.

        Safe to call from a worker thread: the Rust tokenizer runs without the GIL (`encode_batch`
        releases it, `encode` does not), so a long prompt does not stall the server's event loop.
        """
        ids = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if add_special_tokens and self._prepend_bos:
            ids.insert(0, self.bos_token_id)
        if add_special_tokens and self._append_eos:
            ids.append(self.eos_token_ids[0])
        return ids

    def prefix_beyond(self, text: str, num_tokens: int) -> tuple[int, int] | None:
        """(tokens, characters) of a prefix of `text` that already holds more than `num_tokens` tokens (plus
        PREFIX_MARGIN), found without tokenizing all of a long text; None when no prefix proves it (the
        text is short enough to tokenize whole, or has more characters per token than PREFIX_CHARS_PER_TOKEN).

        The cut changes only the tokens around it (BPE merges within a word settle left to right), so the
        whole text has at least the prefix's count less the margin. Cheap where it matters: 660K CJK
        characters against a 32K context are refused after tokenizing 66K of them."""
        for chars_per_token in PREFIX_CHARS_PER_TOKEN:
            num_chars = chars_per_token * (num_tokens + PREFIX_MARGIN)
            if len(text) <= num_chars:
                return None
            count = len(self._tok.encode_batch([text[:num_chars]], add_special_tokens=False)[0].ids)
            if count > num_tokens + PREFIX_MARGIN:
                return count, num_chars
        return None

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text for `ids`; bytes that do not form a complete character come out as U+FFFD."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry for `token_id` (byte-level spelling), or None if out of range."""
        return self._tok.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary entry, or None."""
        return self._tok.token_to_id(token)

    def is_special(self, token_id: int) -> bool:
        """Whether `token_id` is a special (control) token such as `<|im_end|>`."""
        return token_id in self._special_ids

    @property
    def backend(self) -> FastTokenizer:
        """The underlying `tokenizers.Tokenizer`."""
        return self._tok

    def _stop_ids(self, eos_ids: Iterable[int]) -> tuple[int, ...]:
        ids = [int(i) for i in eos_ids]
        for name in _END_OF_TURN_TOKENS:
            token_id = self._tok.token_to_id(name)
            if token_id is not None and token_id in self._special_ids:
                ids.append(token_id)
        return tuple(dict.fromkeys(ids))

    def _token_text(self, token_id: int | None) -> str | None:
        return None if token_id is None else self._tok.id_to_token(token_id)

    # -- chat ---------------------------------------------------------------------------------------------------------

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Render a conversation to a prompt string with the model's chat template, in a sandbox.

        `extra` is passed to the template (e.g. `tools=[...]`, `enable_thinking=False`).
        """
        if not self.chat_template:
            raise KvlabError("model has no chat template; use a raw prompt")
        special_tokens = {
            "bos_token": self._token_text(self.bos_token_id),
            "eos_token": self._token_text(self.eos_token_ids[0] if self.eos_token_ids else None),
            "pad_token": self._token_text(self.pad_token_id),
            "unk_token": self._token_text(self.unk_token_id),
        }
        return render_chat_template(
            self._compiled_template(),
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens=special_tokens,
            extra=extra,
        )

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> list[int]:
        """Token ids of a conversation: the template's markup may hold control tokens, the messages (and
        the tools) never do — `<|im_end|>` or `<tool_call>` written by a user is tokenized as characters
        (shield.py: which added tokens are control)."""
        control = self.control_tokens()
        shield = ContentShield(control.values())
        if extra.get("tools") is not None:
            extra = {**extra, "tools": shield.protect_value(extra["tools"])}
        text = self.apply_chat_template(shield.protect(messages), add_generation_prompt, **extra)

        def encode(t: str):
            e = self._tok.encode_batch([t], add_special_tokens=False)[0]
            return e.ids, e.offsets

        return encode_rendered(text, shield, encode, self._encode_plain, frozenset(control))

    def control_tokens(self) -> dict[int, str]:
        """id → text of every added token a chat treats as control (shield.control_tokens, for this template)."""
        if self._control is None or self._control[0] != self.chat_template:
            added = self._tok.get_added_tokens_decoder()
            self._control = (self.chat_template, control_tokens(added, self.chat_template))
            self._plain = None
        return self._control[1]

    def _encode_plain(self, text: str) -> list[int]:
        if self._plain is None:  # a copy that reads every control token as text: marked special, then encoded as text
            data = json.loads(self._tok.to_str())
            control = set(self.control_tokens().values())
            for token in data.get("added_tokens", []):
                token["special"] = token["special"] or token["content"] in control
            plain = FastTokenizer.from_str(json.dumps(data))
            plain.encode_special_tokens = True
            self._plain = plain
        return self._plain.encode_batch([text], add_special_tokens=False)[0].ids

    def _compiled_template(self) -> jinja2.Template:
        if self._template is None:
            self._template = compile_chat_template(self.chat_template)
        return self._template


# ---------------------------------------------------------------------------------------------------------------------
# Reading a Hugging Face tokenizer directory.
# ---------------------------------------------------------------------------------------------------------------------


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise KvlabError(f"cannot read {path}: {e}") from e
    return data if isinstance(data, dict) else {}


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def _dir_chat_template(path: Path, config: Mapping[str, Any]) -> str | None:
    """`chat_template.jinja` if present, else the `chat_template` in tokenizer_config.json / chat_template.json."""
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template") or _read_json(path / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None
