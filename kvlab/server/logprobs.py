"""Log-probabilities on the wire: the engine's Logprob entries as OpenAI's chat and completions shapes.

    chat:         {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}],
                   "refusal": null}
    completions:  {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}

A token's text is its own decoding (a piece of a character decodes to U+FFFD; `bytes` then has the
real UTF-8 bytes, read from the byte-level vocabulary). JSON has no -inf: a log-probability of a token
the structured-output mask banned is sent as -9999.0, as vLLM does. Completions' `top_logprobs`
always hold the chosen token too (vLLM's choice: up to k + 1 entries); `text_offset` counts characters
of the choice's text (which starts with the prompt under `echo`), token by token.
"""

from __future__ import annotations

import math
from functools import lru_cache

from kvlab.sampling.logprobs import Logprob
from kvlab.tokenizer.gguf_bpe import _BYTE_CHARS

_BYTE_OF = {c: b for b, c in _BYTE_CHARS.items()}
FLOOR = -9999.0


def finite(value: float) -> float:
    return value if math.isfinite(value) else FLOOR


class TokenText:
    """Each token's text and bytes, cached (one per server)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.text = lru_cache(maxsize=65536)(self._text)
        self.bytes = lru_cache(maxsize=65536)(self._bytes)

    def _text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    def _bytes(self, token_id: int) -> list[int]:
        spelled = self.tokenizer.id_to_token(token_id) if self.tokenizer is not None else None
        if spelled and not self.tokenizer.is_special(token_id) and all(c in _BYTE_OF for c in spelled):
            return [_BYTE_OF[c] for c in spelled]
        return list(self._text(token_id).encode("utf-8"))


def chat_content(entries: list[Logprob], text: TokenText) -> list[dict]:
    def one(token_id: int, logprob: float) -> dict:
        return {"token": text.text(token_id), "logprob": finite(logprob), "bytes": text.bytes(token_id)}

    return [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, v) for t, v in e.top]} for e in entries]


def chat_logprobs(entries: list[Logprob] | None, text: TokenText) -> dict | None:
    return None if entries is None else {"content": chat_content(entries, text), "refusal": None}


class CompletionLogprobs:
    """Builds completions' logprobs object for one choice, piece by piece (streaming) or at once."""

    def __init__(self, text: TokenText, offset: int = 0):
        self.text, self.offset = text, offset

    def block(self, entries: list[Logprob | None], ids: list[int] | None = None) -> dict:
        """entries[i] for token ids[i] (a prompt's first token has None); ids default to the entries' own."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for i, e in enumerate(entries):
            token_id = ids[i] if ids is not None else e.token_id
            piece = self.text.text(token_id)
            out["tokens"].append(piece)
            out["text_offset"].append(self.offset)
            self.offset += len(piece)
            if e is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(finite(e.logprob))
            top = {self.text.text(t): finite(v) for t, v in e.top}
            top.setdefault(piece, finite(e.logprob))
            out["top_logprobs"].append(top)
        return out


def merge(a: dict, b: dict) -> dict:
    return {k: a[k] + b[k] for k in a}
