"""SamplingParams: how to pick each next token and when to stop, named as in vLLM and the OpenAI API."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvlab.errors import KvlabError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # a seed is an int64 (OpenAI's `seed`); the generator maps it mod 2**64
# Numerical floors, applied when the params are built (as vLLM does): below them float32 underflows —
# logits / 1e-40 are inf, a top_p of 1e-300 is 0.0 in float32 and drops every token — and a draw
# from the resulting NaN distribution raises inside the engine step.
MIN_TEMPERATURE = 1e-2  # a temperature in (0, 0.01) samples at 0.01 (0 itself is greedy)
MIN_TOP_P = 1e-6  # a top_p in (0, 1e-6) keeps only the most likely token, as 1e-6 does
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-2, 1e2


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings.

    temperature 0 means greedy (argmax). top_k 0 or -1 and top_p 1 and min_p 0 disable those filters.
    The same seed gives the same text; no seed draws from the process's random state.

    Ranges (a KvlabError otherwise): temperature finite and >= 0 (the server narrows it to OpenAI's
    0-2), top_p in (0, 1], min_p in [0, 1], repetition_penalty in [0.01, 100], seed within int64.
    A temperature in (0, 0.01) is raised to 0.01 and a top_p below 1e-6 to 1e-6 (see MIN_TEMPERATURE).
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        self.validate()
        if 0 < self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)
        if self.top_p < MIN_TOP_P:
            object.__setattr__(self, "top_p", MIN_TOP_P)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        def number(x) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        def integer(x) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        checks = [
            (integer(self.max_tokens) and self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}"),
            (number(self.temperature) and self.temperature >= 0, f"temperature must be >= 0 (0 is greedy), got {self.temperature}"),
            (number(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (integer(self.top_k) and self.top_k >= -1, f"top_k must be -1, 0 (off) or a positive count, got {self.top_k}"),
            (number(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (number(self.repetition_penalty) and MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY,
             f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY:g}] (1 is off), "
             f"got {self.repetition_penalty}"),
            (self.seed is None or (integer(self.seed) and INT64_MIN <= self.seed <= INT64_MAX),
             f"seed must be an integer within int64, got {self.seed!r}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings"),
            (isinstance(self.ignore_eos, bool), f"ignore_eos must be true or false, got {self.ignore_eos!r}"),
        ]  # fmt: skip
        for ok, message in checks:
            if not ok:
                raise KvlabError(message)
