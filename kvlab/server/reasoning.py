"""Thinking split from the answer: `kvlab serve --reasoning-parser` (vLLM's flag).

Reasoning models write their thinking in the text, between `<think>` and `</think>` (Qwen3,
DeepSeek-R1 and its distills, QwQ). The parser cuts the generated text into the thinking and the
answer, streamed or whole, and every wire format shows them apart: `reasoning_content` (chat
completions), a reasoning item (Responses), `thinking` (Ollama), a `thinking` block (Anthropic).

    ThinkSplitter(inside=...)        inside: the prompt already opened <think> (DeepSeek-R1's template does)
    .push(text) -> (thinking, answer)    text as it streams; a piece that may begin a tag is held back
    .flush()    -> (thinking, answer)    at the end; `.unfinished`: the text ended inside the thinking

The split is exact: the thinking is the text between the tags, the answer what follows `</think>`
(or the whole text when it never opens `<think>`); the tags themselves belong to neither. A tag may
arrive whole (one token) or in pieces across tokens. Text that ends before `</think>` — `max_tokens`
reached while thinking — is all thinking, and `unfinished` says so.
"""

from __future__ import annotations

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")  # vLLM's names; both write <think>…</think>
PROMPT_TAIL_TOKENS = 16  # the prompt's last tokens, decoded, tell whether the template opened <think>


def check_parser(name: str | None) -> str | None:
    """The parser's name, or a ValueError naming the known ones."""
    if name is not None and name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}: use one of {', '.join(PARSERS)}")
    return name


def opens_thinking(prompt_tail: str) -> bool:
    """Whether a prompt whose last characters are `prompt_tail` leaves a <think> open (the template wrote it)."""
    return prompt_tail.rfind(OPEN) > prompt_tail.rfind(CLOSE)


@dataclass
class ThinkSplitter:
    inside: bool = False  # within <think> … </think>
    started: bool = False  # past the opening: a <think> is looked for only at the start of the text
    done: bool = False  # past </think>: everything else is answer
    held: str = ""

    def __post_init__(self) -> None:
        self.started = self.started or self.inside

    @property
    def unfinished(self) -> bool:
        """The text so far ends inside the thinking."""
        return self.inside

    def push(self, text: str) -> tuple[str, str]:
        self.held += text
        thinking = []
        if not self.started:
            lead = self.held.lstrip()
            if OPEN.startswith(lead):  # nothing yet, or a piece of <think>: wait
                return "", ""
            self.started = True
            if lead.startswith(OPEN):
                self.inside, self.held = True, lead[len(OPEN) :]
        if self.inside:
            end = self.held.find(CLOSE)
            if end < 0:
                keep = _partial(self.held, CLOSE)
                out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
                return out, ""
            thinking.append(self.held[:end])
            self.held, self.inside, self.done = self.held[end + len(CLOSE) :], False, True
        answer, self.held = self.held, ""
        return "".join(thinking), answer

    def flush(self) -> tuple[str, str]:
        """Whatever is held: a piece of a tag that never completed is text of the side it was on."""
        held, self.held = self.held, ""
        if not self.started and held.lstrip() == OPEN:  # the text ended right after opening its thinking
            self.started = self.inside = True
            return "", ""
        if self.inside:
            return held, ""
        self.started = True
        return "", held


def split(text: str, inside: bool = False) -> tuple[str | None, str, bool]:
    """(thinking or None when the text has none, answer, unfinished) of a whole text."""
    s = ThinkSplitter(inside=inside)
    thinking, answer = s.push(text)
    more_thinking, more_answer = s.flush()
    thinking += more_thinking
    had = inside or s.done or s.unfinished
    return (thinking if had else None), answer + more_answer, s.unfinished


def _partial(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def template_kwargs(body: dict) -> dict:
    """vLLM's `chat_template_kwargs` of a chat-completions body: only `enable_thinking` (Qwen3's switch) and
    `thinking` (DeepSeek's), each true or false, reach the template."""
    from kvlab.server.errors import invalid

    value = body.get("chat_template_kwargs")
    if value is None:
        return {}
    if not isinstance(value, dict) or set(value) - {"enable_thinking", "thinking"} or \
            not all(isinstance(v, bool) for v in value.values()):  # fmt: skip
        raise invalid("'chat_template_kwargs' takes only 'enable_thinking' and 'thinking', each true or false",
                      "chat_template_kwargs")  # fmt: skip
    return dict(value)
