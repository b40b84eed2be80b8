"""Request: one prompt's journey through the engine, and the timings it collects on the way.

No torch here: the scheduler and the KV manager only move these objects around.

    WAITING ──admit──► RUNNING ──EOS / max_tokens / stop string──► FINISHED_*
       ▲                  │
       └────preempt───────┘   (blocks freed, num_computed_tokens back to 0: recomputed later)

A request knows its tokens (`all_token_ids`: prompt, then generated) and how many of them have
their K/V in the cache (`num_computed_tokens`). Every step the scheduler gives it some of the
difference; when the difference closes, a token is sampled and the difference is 1 again. There is
no "prefill phase" or "decode phase" anywhere else than in the words used to report it.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kvlab.errors import KvlabError
from kvlab.sampling.params import SamplingParams


def check_token_ids(prompt_ids: list[int], vocab_size: int) -> None:
    """Raise KvlabError for an empty prompt or a token id outside the vocabulary (every engine's rule)."""
    if not prompt_ids:
        raise KvlabError("the prompt is empty: give at least one token")
    bad = [t for t in prompt_ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
    if bad:
        raise KvlabError(f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"  # an end-of-sequence token or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or the context's end
    FINISHED_ABORTED = "abort"  # the caller gave up (a closed stream, a disconnected client)

    @property
    def is_finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


@dataclass
class RequestTimings:
    """Where a request's time went, in seconds of time.perf_counter() and counts of engine steps."""

    arrival_s: float
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    finished_s: float | None = None
    prefill_chunks: int = 0  # engine steps that carried part of its prompt (chunked prefill, recomputation)
    prefill_shared_steps: int = 0  # of those, steps that also carried other requests' tokens
    prefill_compute_s: float = 0.0  # total time of those steps (the request shared them)
    decode_steps: int = 0  # steps that fed back one generated token (and checked its drafted tokens)
    decode_batch_sum: int = 0  # requests in each of those steps, summed (→ mean batch it decoded in)


@dataclass(eq=False)
class Request:
    """A prompt, its sampling settings, and the state the engine keeps while serving it.

    max_tokens is the number of tokens it may generate: params.max_tokens, clipped to the context.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    arrival_s: float = field(default_factory=time.perf_counter)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when first admitted
    num_preemptions: int = 0
    cache_salt: str | None = None  # prefix-cache namespace: blocks are shared only under the same salt
    client_id: str | None = None  # whom seats and tokens are shared between (scheduler/fair.py); None: anonymous
    # choices (n > 1, best_of): each is a sequence of its own; the first carries the caller's request id
    group_id: str | None = None  # the caller's request id (None: this request's own id)
    index: int = 0  # which choice this sequence is (its seed is seed + index)
    fork_ids: tuple[str, ...] = ()  # the other choices, forked from this one when its prompt is done
    num_prompt_logprobs: int = 0  # prompt positions whose log-probabilities were computed (prompt_logprobs)
    # speculative decoding: tokens a proposer drafted after the last one, checked by the next step's
    # forward (never in all_token_ids until accepted), and the request's counts (spec_decode/metrics.py)
    spec_token_ids: list[int] = field(default_factory=list)
    spec_draft_probs: object | None = None  # the draft model's q of each drafted token (a tensor [k, V]), sampled requests
    spec_stats: object | None = None
    timings: RequestTimings = field(init=False)

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = list(self.prompt_token_ids)  # prompt, then every generated token
        self.timings = RequestTimings(arrival_s=self.arrival_s)
        self.group_id = self.group_id or self.request_id

    @staticmethod
    def choice_id(group_id: str, index: int) -> str:
        """The sequence id of choice `index` (> 0) of a request."""
        return f"{group_id}#{index}"

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.is_finished else None

    def append_token(self, token_id: int) -> RequestStatus | None:
        """Record a sampled token; return the finished status it causes, if any (EOS, max_tokens)."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if token_id in self.eos_token_ids and not self.params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
