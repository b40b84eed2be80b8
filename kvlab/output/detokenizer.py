"""Incremental detokenization: text for each new token id, without broken characters.

Byte-level vocabularies split one character (an emoji, a CJK ideograph) over several tokens, so
decoding a single token can give half a character. `IncrementalDetokenizer` decodes a small window
of recent ids and emits only the text that became final, holding back while the decoded tail ends
in U+FFFD (an incomplete UTF-8 sequence), the way vLLM and TGI stream text. At the end (max_tokens
cut a character in half) the incomplete bytes are dropped: text never ends in a broken character.
"""

from __future__ import annotations

from typing import Protocol, Sequence

_REPLACEMENT = "\ufffd"


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


class IncrementalDetokenizer:
    """Streams the text of a growing token sequence, one piece per pushed id.

    The pieces joined equal `tokenizer.decode(all_ids, skip_special_tokens=...)`. Each step decodes only
    the ids since the last emitted boundary (plus those still held back), so a step costs O(window),
    not O(sequence).
    """

    def __init__(self, tokenizer: _Decoder, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []
        # ids[_prefix:_read] were already emitted; they are decoded again as context so that
        # decoders which treat the start of a sequence specially give the same text as a full decode.
        self._prefix = 0
        self._read = 0

    def push(self, token_id: int) -> str:
        """Add one token id; return the text it completes ("" while a character is still incomplete)."""
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Return whatever is still held back, less an incomplete character at the very end (dropped)."""
        return self._advance(final=True).rstrip(_REPLACEMENT)

    def _advance(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full_text = self._decode(self._ids[self._prefix :])
        if not final and (len(full_text) < len(prefix_text) or full_text.endswith(_REPLACEMENT)):
            return ""  # the last character is not complete yet
        self._prefix, self._read = self._read, len(self._ids)
        return full_text[len(prefix_text) :]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special) if ids else ""
