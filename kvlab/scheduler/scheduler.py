"""Scheduler: which requests run this step, and how many of their tokens, within a token budget.

Pure Python, no torch. There is no prefill phase and no decode phase: each request has tokens whose
K/V are not in the cache yet (`num_tokens - num_computed_tokens`: a whole prompt, part of one, or
the one token sampled last step) and every step closes some of that gap for as many requests as
the budget (`max_num_batched_tokens`) and `max_num_seqs` allow:

    1. running requests, one-token gaps (decodes) first, then unfinished prompts (chunked prefill);
       when the pool has no block for one, the most recently admitted request is preempted: its
       blocks are freed and it goes back to the front of the queue, to be recomputed later;
    2. then waiting requests, first come first served, each starting after its prefix-cache hit.

With several clients (`Request.client_id`: the server names one per HTTP request) seats and prompt
tokens are shared between them (`fair.py`): a client below its share of the seats takes one from the
client holding the most (preempted), admission goes to the client holding the fewest seats, and
the prompt tokens of a step are split by max-min fairness. One client: exactly the order above.

A chunk that reaches the end of its request's known tokens yields logits, and tokens are sampled.
After the step, `update` takes the runner's StepResult: a request keeps the K/V of the positions
that were accepted (all of them, unless a verifier rejected drafted ones, which are truncated away),
only then are its newly full blocks made findable, the blocks its sliding windows left behind go back
to the pool, and its new tokens are appended.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from typing import TYPE_CHECKING

from kvlab.kv.manager import BlockOp, KVCacheManager, PrefixHit
from kvlab.request import Request, RequestStatus
from kvlab.scheduler.fair import PrefillShares, admission_order, seat_victims

if TYPE_CHECKING:  # no torch here: a Logprob is a plain dataclass, only named in annotations
    from kvlab.sampling.logprobs import Logprob


@dataclass
class StepResult:
    """What a step's forward and sampling gave each request (the runner's answer to a plan)."""

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)  # request id → tokens to append
    # request id → positions computed this step whose K/V must be dropped (drafts a verifier rejected)
    num_rejected_tokens: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, list[Logprob]] = field(default_factory=dict)  # request id → one per sampled token
    prompt_logprobs: dict[str, list[Logprob]] = field(default_factory=dict)  # request id → prompt positions computed
    # request id → choices that drew their first token from its prompt's logits (n > 1): the engine forks them
    forks: dict[str, list[str]] = field(default_factory=dict)

    @property
    def num_sampled(self) -> int:
        return sum(len(t) for t in self.sampled_token_ids.values())

    def merge(self, other: StepResult) -> None:
        for mine, theirs in ((self.sampled_token_ids, other.sampled_token_ids), (self.logprobs, other.logprobs),
                             (self.num_rejected_tokens, other.num_rejected_tokens), (self.forks, other.forks),
                             (self.prompt_logprobs, other.prompt_logprobs)):  # fmt: skip
            mine.update(theirs)


@dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int
    max_num_seqs: int = 32  # requests running at once
    max_num_batched_tokens: int = 1024  # tokens through the model in one step (EngineConfig's default)
    recompute_every_step: bool = False  # no KV cache: forget a request's tokens after each sample
    # share seats and prompt tokens between clients (Request.client_id; fair.py). False: first come, first served
    fair_share: bool = True

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


@dataclass
class ScheduledChunk:
    """One request's share of a step: tokens [start, start + num_new_tokens) go through the model."""

    request: Request
    start: int
    num_new_tokens: int
    block_tables: list[list[int]]  # the request's block table in each KV group (kv/layout.py)
    # drafted tokens after the request's last one, verified in this chunk (speculative decoding): the
    # chunk is the last token and these, each a row of its own with its own logits
    spec_token_ids: tuple[int, ...] = ()
    as_rows: bool = False  # run each token as a decode row (verification; a draft model's short catch-up)
    logits_row: bool = False  # a row whose logits are needed although it is not the chunk's last

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def samples(self) -> bool:
        """True when the chunk reaches the last known token (or drafted one): its logits give the next token."""
        return self.end == self.request.num_tokens + len(self.spec_token_ids)

    @property
    def is_decode(self) -> bool:
        """A decode row: one token, attending as one row of the step's decode batch."""
        return self.num_new_tokens == 1

    def token_ids(self) -> list[int]:
        """The ids of this chunk's tokens: the request's, then drafted ones."""
        ids, n = self.request.all_token_ids, self.request.num_tokens
        if self.end <= n:
            return ids[self.start : self.end]
        return ids[self.start : n] + list(self.spec_token_ids[max(self.start - n, 0) : self.end - n])

    def rows(self) -> list[ScheduledChunk]:
        """The chunk as decode rows, one per token (every one with logits when it verifies drafts)."""
        verify = bool(self.spec_token_ids)
        return [ScheduledChunk(self.request, p, 1, self.block_tables, self.spec_token_ids,
                               logits_row=verify or p == self.end - 1) for p in range(self.start, self.end)]  # fmt: skip


@dataclass
class SchedulerOutput:
    step: int
    chunks: list[ScheduledChunk] = field(default_factory=list)
    block_ops: list[BlockOp] = field(default_factory=list)  # zero new blocks, copy prefix runs: in order, first
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    def account(self, step_s: float) -> None:
        """Each request's share of the step in its timings: a prompt chunk (prefill) or a fed-back token (decode)."""
        n = len(self.chunks)
        for c in self.chunks:
            t = c.request.timings
            if (c.num_new_tokens == 1 or c.spec_token_ids) and c.start >= c.request.num_prompt_tokens:
                t.decode_steps += 1
                t.decode_batch_sum += n
            else:
                t.prefill_chunks += 1
                t.prefill_shared_steps += n > 1
                t.prefill_compute_s += step_s


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_steps = 0
        self.num_preemptions = 0

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    # ---- the plan for one step -------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(step=self.num_steps, block_ops=self.kv.take_pending_ops())
        self.num_steps += 1
        budget = self.config.max_num_batched_tokens
        scheduled: set[str] = set()
        if self.config.fair_share:  # a waiting client below its share of the seats takes one (fair.py)
            for victim in seat_victims(self.running, self.waiting, self.config.max_num_seqs):
                self._preempt(victim)
                out.preempted.append(victim)
        admits = self._admission_order()
        shares = None  # each client's prompt tokens this step, set at the first prompt chunk (fair.py)
        short_of_blocks = False
        decodes_first = sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1)
        for req in decodes_first:
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:  # preempted for an earlier request of this loop
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n > 1:  # a prompt chunk: within its client's share of the budget
                shares = shares or self._prefill_shares(admits, budget)
                if (n := shares.grant(req.client_id, n)) == 0:
                    continue
            spec = self._spec_tokens(req, n, budget)
            ops = self.kv.allocate_slots(req, n + len(spec)) if spec else None
            if spec and ops is None:
                spec = req.spec_token_ids = []  # no room for the drafts: a plain decode (no preemption for them)
            n += len(spec)
            while ops is None and (ops := self.kv.allocate_slots(req, n)) is None:
                victim = next(r for r in reversed(self.running) if r.request_id not in scheduled)
                self._preempt(victim)
                out.preempted.append(victim)
                short_of_blocks = True
                if victim is req:
                    break
            else:
                out.chunks.append(ScheduledChunk(req, req.num_computed_tokens, n, self.kv.block_tables[req.request_id],
                                                 tuple(spec), as_rows=bool(spec)))  # fmt: skip
                out.block_ops.extend(ops)
                scheduled.add(req.request_id)
                budget -= n

        shares = shares or self._prefill_shares(admits, budget)
        for req in admits:  # waiting requests, as many as there are seats, in the order fair.py gives
            if budget == 0 or short_of_blocks or len(self.running) >= self.config.max_num_seqs:
                break
            hit = self.kv.find_prefix(req)
            n = shares.grant(req.client_id, min(req.num_tokens - hit.num_tokens, budget))
            if n == 0:
                continue  # its client's share of this step is spent
            ops = self.kv.allocate_slots(req, n, hit)
            if ops is None:
                break  # wait for blocks; later requests wait behind it (first come, first served)
            self.waiting.remove(req)
            self._admit(req, hit.num_tokens)
            out.chunks.append(ScheduledChunk(req, req.num_computed_tokens, n, self.kv.block_tables[req.request_id]))
            out.block_ops.extend(ops)
            budget -= n
        return out

    def _admission_order(self) -> list[Request]:
        """The waiting requests the free seats go to this step, in order: the queue's front (one client,
        or fair_share off), else the first of the client holding the fewest seats, in turn (fair.py)."""
        seats = self.config.max_num_seqs - len(self.running)
        if not self.config.fair_share:
            return list(itertools.islice(self.waiting, max(seats, 0)))
        return admission_order(self.waiting, self.running, seats)

    def _prefill_shares(self, admits: list[Request], budget: int) -> PrefillShares:
        """Split what is left of the step's budget between the clients with prompt tokens to compute."""
        demands: dict = {}
        if self.config.fair_share:
            for r in itertools.chain(self.running, admits):
                gap = r.num_tokens - r.num_computed_tokens
                if gap > 1 or r.status is RequestStatus.WAITING:
                    demands[r.client_id] = demands.get(r.client_id, 0) + gap
        return PrefillShares(demands, budget)

    def _spec_tokens(self, req: Request, n: int, budget: int) -> list[int]:
        """The drafted tokens `req` verifies this step: only on a decode (its last token is all it has to
        compute), as many as the budget, its max_tokens and the context leave room for."""
        spec = req.spec_token_ids
        if not spec:
            return []
        if n != 1:
            req.spec_token_ids = []
            return []
        room = min(budget - 1, req.max_tokens - req.num_output_tokens - 1, self.config.max_model_len - req.num_tokens)
        if room < len(spec):
            spec = req.spec_token_ids = spec[: max(room, 0)]
        return spec

    def _admit(self, req: Request, num_cached: int) -> None:
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = num_cached
        if req.timings.first_scheduled_s is None:  # first admission (not a return after preemption)
            req.timings.first_scheduled_s = time.perf_counter()
            req.num_cached_tokens = num_cached
            self.kv.stats.record(req.num_prompt_tokens, num_cached)
        self.running.append(req)

    def _preempt(self, req: Request) -> None:
        """Free every block of `req` and queue it first: it will recompute what it had (recomputation)."""
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---- after the step ----------------------------------------------------------------------------

    def update(self, out: SchedulerOutput, result: StepResult) -> list[Request]:
        """Advance every scheduled request by its accepted positions; append its sampled tokens.

        Returns the requests that gained tokens. Blocks become findable only once every token in them
        is accepted; rejected positions are truncated from the request's KV first.
        """
        got = []
        for chunk in out.chunks:
            req = chunk.request
            if req.is_finished:
                continue
            req.spec_token_ids = []  # verified now: accepted ones come back as sampled tokens
            rejected = result.num_rejected_tokens.get(req.request_id, 0)
            req.num_computed_tokens = chunk.end - rejected
            if rejected:
                self.kv.truncate(req, req.num_computed_tokens)
            tokens = result.sampled_token_ids.get(req.request_id) or []
            status = None
            for i, token in enumerate(tokens):  # appended before the blocks are registered: accepted drafts need them
                status = req.append_token(token)
                if status is not None:
                    if i + 1 < len(tokens) and req.num_computed_tokens > req.num_tokens - 1:
                        self.kv.truncate(req, req.num_tokens - 1)  # ended inside accepted drafts: drop the rest
                    break
            self.kv.register_full_blocks(req)
            self.kv.slide_windows(req)  # sliding-window blocks no later query sees go back to the pool
            if not tokens:
                continue
            got.append(req)
            if status is not None:
                self.finish_request(req, status)
            elif self.config.recompute_every_step:
                self.kv.free(req)
                req.num_computed_tokens = 0
        return got

    def fork(self, parent: Request, child: Request) -> bool:
        """Run `child` (a choice of `parent`'s request: its prompt and one sampled token) from `parent`'s
        prompt blocks: every block shared, the partial last one copied before it is written (copy on
        write, through KVCacheManager.truncate). Without a running parent, a free block or a seat, the
        child waits at the front of the queue instead and recomputes (mostly prefix-cache hits).
        Returns whether it shares."""
        bs, prompt_len = self.kv.block_size, child.num_prompt_tokens
        can_share = (
            parent.status is RequestStatus.RUNNING and parent.num_computed_tokens >= prompt_len
            and not self.config.recompute_every_step and len(self.running) < self.config.max_num_seqs
            and (prompt_len % bs == 0 or self.kv.pool.num_free_blocks > 0)
        )  # fmt: skip
        if not can_share:
            self.waiting.appendleft(child)
            return False
        tables = [t[: self.kv.blocks_for(prompt_len)] for t in self.kv.block_tables[parent.request_id]]
        self.kv.allocate_slots(child, 0, PrefixHit(tables, prompt_len))  # one table per KV group
        self.kv.fork_state(parent, child)  # a hybrid's recurrent state after the prompt, copied
        child.num_computed_tokens = prompt_len
        self.kv.truncate(child, prompt_len)  # the shared partial block becomes the child's own copy
        child.status = RequestStatus.RUNNING
        self.running.append(child)
        return True

    def finish_request(self, req: Request, status: RequestStatus) -> None:
        """End a request (stop string, abort, EOS, length): its blocks go back to the pool."""
        if req.is_finished:
            return
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = status
        req.timings.finished_s = time.perf_counter()
