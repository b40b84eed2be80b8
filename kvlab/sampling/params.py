"""SamplingParams: how to pick each next token and when to stop, named as in vLLM and the OpenAI API."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvlab.errors import KvlabError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# torch's CPU generator (mt19937, every sequence's own) keeps only a seed's low 32 bits: a wider range would
# give two seeds the same text (-1 and 2**32 - 1, 0 and 2**32), so wider seeds are refused, not wrapped
MAX_SEED = 2**32 - 1
# Numerical floors, applied when the params are built (as vLLM does): below them float32 underflows —
# logits / 1e-40 are inf, a top_p of 1e-300 is 0.0 in float32 and drops every token — and a draw
# from the resulting NaN distribution raises inside the engine step.
MIN_TEMPERATURE = 1e-2  # a temperature in (0, 0.01) samples at 0.01 (0 itself is greedy)
MIN_TOP_P = 1e-6  # a top_p in (0, 1e-6) keeps only the most likely token, as 1e-6 does
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-2, 1e2
MAX_LOGPROBS = 20  # top log-probabilities per position (OpenAI's top_logprobs limit; vLLM's default cap)
MAX_N = 128  # choices of one request (n, best_of): each is a sequence in the engine
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for one logit_bias value: -100 bans a token, 100 forces it
LOGPROBS_MODES = ("processed", "raw")


@dataclass(frozen=True)
class StructuredOutputs:
    """Constrain the answer to a language (vLLM's StructuredOutputsParams): exactly one of
    `json` (a JSON schema, dict or string), `json_object` (any JSON object), `regex`, `choice`
    (one of these strings) or `grammar` (a Lark grammar in llguidance's dialect)."""

    json: Mapping[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.choice is not None and not isinstance(self.choice, tuple):
            object.__setattr__(self, "choice", tuple(self.choice) if isinstance(self.choice, (list, tuple)) else self.choice)
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object is True else []
        if len(given) != 1:
            raise KvlabError(f"structured outputs take exactly one of json, json_object, regex, choice, grammar; got "
                             f"{', '.join(given) or 'none'}")  # fmt: skip
        if self.json_object not in (True, False):
            raise KvlabError("structured outputs: json_object must be true or false")
        if self.choice is not None and (not isinstance(self.choice, tuple) or not self.choice or
                                        not all(isinstance(c, str) and c for c in self.choice)):  # fmt: skip
            raise KvlabError("structured outputs: choice must be a non-empty list of non-empty strings")
        for key in ("regex", "grammar"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, str) or not value):
                raise KvlabError(f"structured outputs: {key} must be a non-empty string")
        if self.json is not None and not isinstance(self.json, (Mapping, str)):
            raise KvlabError("structured outputs: json must be a JSON schema (an object, or its text)")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings.

    temperature 0 means greedy (argmax). top_k 0 or -1 and top_p 1 and min_p 0 disable those filters.
    The same seed gives the same text; no seed draws from the process's random state. With n > 1 (or
    best_of), choice i draws with seed + i.

    Logits are processed in this order, on one path for every request of a step: logit_bias →
    repetition penalty (prompt and output tokens) → presence and frequency penalties (output tokens,
    OpenAI's definitions) → the structured-output mask → temperature → top-k → top-p → min-p → draw.

    `logprobs` (0..20): the sampled token's log-probability and the top `logprobs` others, per generated
    token; `prompt_logprobs` the same for every prompt token after the first. `logprobs_mode`:
    "processed" (the default: the distribution after bias, penalties, the structured-output mask and
    temperature — greedy counts as temperature 1 — before the top-k/top-p/min-p cut) or "raw" (the
    model's own log-softmax). Prompt log-probabilities are always the model's own.

    `n` choices are returned; `best_of` (≥ n) are generated and the n with the highest cumulative
    log-probability kept.

    Ranges (a KvlabError otherwise): temperature finite and >= 0 (the server narrows it to OpenAI's
    0-2), top_p in (0, 1], min_p in [0, 1], repetition_penalty in [0.01, 100], presence and frequency
    penalties in [-2, 2], logit_bias values in [-100, 100], seed in [0, 2**32 - 1] (MAX_SEED).
    A temperature in (0, 0.01) is raised to 0.01 and a top_p below 1e-6 to 1e-6 (see MIN_TEMPERATURE).
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] | None = None  # token id → added to its logit
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    n: int = 1
    best_of: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logprobs_mode: str = "processed"
    structured_outputs: StructuredOutputs | None = None
    # speculative decoding (kvlab's): at most this many drafted tokens per step for this request, 0 none;
    # None: the engine's num_speculative_tokens. The output is the same either way, only the speed differs
    num_speculative_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        if self.logit_bias is not None and not self.logit_bias:
            object.__setattr__(self, "logit_bias", None)  # {} changes nothing
        self.validate()
        if 0 < self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)
        if self.top_p < MIN_TOP_P:
            object.__setattr__(self, "top_p", MIN_TOP_P)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def num_sequences(self) -> int:
        """Sequences the request runs: best_of, else n."""
        return self.best_of or self.n

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def needs_logprob(self) -> bool:
        """Whether each sampled token's log-probability is computed (asked for, or to rank best_of)."""
        return self.logprobs is not None or self.num_sequences > self.n

    @property
    def is_plain_greedy(self) -> bool:
        """Greedy with nothing that changes the logits or needs more than the argmax."""
        return (self.is_greedy and not self.has_penalties and self.logit_bias is None
                and self.structured_outputs is None and not self.needs_logprob)  # fmt: skip

    def validate(self) -> None:
        for ok, message in self._checks() + self._choice_checks():
            if not ok:
                raise KvlabError(message)

    def _checks(self) -> list[tuple[bool, str]]:
        return [
            (_integer(self.max_tokens) and self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}"),
            (_number(self.temperature) and self.temperature >= 0, f"temperature must be >= 0 (0 is greedy), got {self.temperature}"),
            (_number(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (_integer(self.top_k) and self.top_k >= -1, f"top_k must be -1, 0 (off) or a positive count, got {self.top_k}"),
            (_number(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (_number(self.repetition_penalty) and MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY,
             f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY:g}] (1 is off), "
             f"got {self.repetition_penalty}"),
            (_number(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (_number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.logit_bias is None or _bias_ok(self.logit_bias),
             f"logit_bias must map token ids (integers >= 0) to numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"),
            (self.seed is None or (_integer(self.seed) and 0 <= self.seed <= MAX_SEED),
             f"seed must be an integer in [0, {MAX_SEED}] (the generator keeps 32 bits), got {self.seed!r}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings"),
            (isinstance(self.ignore_eos, bool), f"ignore_eos must be true or false, got {self.ignore_eos!r}"),
            (self.num_speculative_tokens is None or (_integer(self.num_speculative_tokens) and 0 <= self.num_speculative_tokens <= 16),
             f"num_speculative_tokens must be an integer in 0..16, got {self.num_speculative_tokens!r}"),
        ]  # fmt: skip

    def _choice_checks(self) -> list[tuple[bool, str]]:
        return [
            (_integer(self.n) and 1 <= self.n <= MAX_N, f"n must be in [1, {MAX_N}], got {self.n!r}"),
            (self.best_of is None or (_integer(self.best_of) and _integer(self.n) and self.n <= self.best_of <= MAX_N),
             f"best_of must be an integer in [n, {MAX_N}], got {self.best_of!r}"),
            (self.logprobs is None or (_integer(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
             f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}"),
            (self.prompt_logprobs is None or (_integer(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
             f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}"),
            (self.logprobs_mode in LOGPROBS_MODES,
             f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}"),
            (self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputs),
             "structured_outputs must be a StructuredOutputs"),
            (self.structured_outputs is None or not self.ignore_eos,
             "structured outputs end at the end-of-sequence token: they cannot be combined with ignore_eos"),
        ]  # fmt: skip


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _integer(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _bias_ok(bias) -> bool:
    if not isinstance(bias, Mapping):
        return False
    return all(_integer(t) and t >= 0 and _number(v) and -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS for t, v in bias.items())
