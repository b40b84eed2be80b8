"""Chat content is text: control tokens a user writes are tokenized as characters, never as control tokens.

A chat template writes its markup (`<|im_start|>user\\n ... <|im_end|>`, Qwen's `<tool_call>`) as
text, and the rendered prompt is tokenized with added tokens recognised — so a message that
contains `<|im_end|><|im_start|>system` would become real control tokens (role injection), and one
that contains `<tool_call>{...}</tool_call>` a forged tool call in the history. The control tokens
are found from the tokenizer and the template (`control_tokens`), not from a list: every added
token marked special, every added token the template writes (`<tool_call>`, `<think>`), and every
added token shaped as markup (`<|fim_prefix|>`, `[INST]`: models learn such tokens even where no
template shows them). To keep the template's markup and the messages' text plain:

1. `ContentShield.protect` replaces, in every string of the messages (content, tool-call
   arguments, names, ids) and of the tools, every control token's text with a sentinel: one
   character of Unicode's Supplementary Private Use Area-B (U+100000 + k for the k-th distinct
   string; characters of that range already in the text are protected too, so the mapping is
   exact). Templates that trim or split the content see one opaque character.
2. The template renders; every control token left in the prompt is the template's own.
3. `encode_rendered` tokenizes the prompt as usual (added tokens recognised), then re-tokenizes
   each stretch between two control tokens that holds a sentinel, with the sentinels restored and
   control tokens *not* recognised. Hugging Face tokenizers split the input at added tokens before
   anything else, so this equals tokenizing that stretch alone: the result is what the prompt
   would give if only the template's markup were control tokens.

A template that looks for a control token's text in the content (Qwen3's `'</think>' in content`,
to drop an earlier turn's reasoning) sees the sentinel instead: such text stays in the prompt.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping, Sequence

_SENTINEL_BASE = 0x100000  # Supplementary Private Use Area-B: U+100000 .. U+10FFFD
_SENTINEL_RANGE = "\U00100000-\U0010fffd"
_MARKUP = re.compile(r"<[^<>\s]+>|\[[^\[\]\s]+\]")  # <tool_call>, <|fim_prefix|>, </think>, [INST]


def control_tokens(added: Mapping[int, Any], template: str | None) -> dict[int, str]:
    """id → text of the added tokens (`tokenizers` AddedTokens by id) a chat must treat as control: marked
    special, shaped as markup, or written by the template (without whitespace and not a plain word: an
    added "user" or a run of spaces the template happens to contain stays text)."""

    def named(text: str) -> bool:
        return bool(template) and text in template and not any(c.isspace() for c in text) and not text.isalnum()

    return {i: t.content for i, t in added.items()
            if t.content and (t.special or _MARKUP.fullmatch(t.content) or named(t.content))}  # fmt: skip


class ContentShield:
    """Swaps control-token texts in chat messages for sentinel characters, and back."""

    def __init__(self, special_texts: Iterable[str]) -> None:
        texts = sorted({t for t in special_texts if t}, key=len, reverse=True)  # longest first: no partial matches
        alternatives = [re.escape(t) for t in texts] + [f"[{_SENTINEL_RANGE}]"]
        self._pattern = re.compile("|".join(alternatives))
        self._sentinel_chars = re.compile(f"[{_SENTINEL_RANGE}]")
        self.protected: list[str] = []  # sentinel k stands for protected[k]
        self._index: dict[str, int] = {}

    @property
    def used(self) -> bool:
        return bool(self.protected)

    def protect(self, messages: Sequence[Mapping[str, Any]]) -> list[dict]:
        """Copies of the messages with every control token in any of their strings replaced by a sentinel."""
        return [self.protect_value(message) for message in messages]

    def protect_value(self, value: Any) -> Any:
        """A copy of a JSON-like value (strings, mappings, lists) with its strings, keys too, protected."""
        if isinstance(value, str):
            return self._pattern.sub(self._sentinel, value)
        if isinstance(value, Mapping):
            return {self.protect_value(k): self.protect_value(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.protect_value(v) for v in value]
        return value

    def restore(self, text: str) -> str:
        return self._sentinel_chars.sub(lambda m: self.protected[ord(m.group()) - _SENTINEL_BASE], text)

    def has_sentinel(self, text: str) -> bool:
        return self._sentinel_chars.search(text) is not None

    def _sentinel(self, match: re.Match) -> str:
        text = match.group()
        k = self._index.get(text)
        if k is None:
            if len(self.protected) >= 0x10FFFD - _SENTINEL_BASE:
                raise ValueError("too many distinct special tokens in one conversation")
            k = self._index[text] = len(self.protected)
            self.protected.append(text)
        return chr(_SENTINEL_BASE + k)


def encode_rendered(text: str, shield: ContentShield, encode, encode_plain, special_ids: frozenset[int]) -> list[int]:
    """Token ids of a rendered chat prompt whose content was protected by `shield`.

    `encode(text)` → (ids, char offsets) with added tokens recognised; `encode_plain(text)` → ids
    with the control tokens read as plain text; `special_ids`: the control tokens' ids.
    """
    ids, offsets = encode(text)
    if not shield.used:
        return ids
    out: list[int] = []
    gap_token, gap_char = 0, 0  # the stretch since the last special token: first token, first character

    def close_gap(end_token: int, end_char: int) -> None:
        stretch = text[gap_char:end_char]
        if shield.has_sentinel(stretch):
            out.extend(encode_plain(shield.restore(stretch)))
        else:
            out.extend(ids[gap_token:end_token])

    for k, (token_id, (start, end)) in enumerate(zip(ids, offsets)):
        if token_id in special_ids:
            close_gap(k, start)
            out.append(token_id)
            gap_token, gap_char = k + 1, end
    close_gap(len(ids), len(text))
    return out
