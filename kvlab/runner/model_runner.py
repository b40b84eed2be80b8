"""ModelRunner: a step's plan turned into tensors, one forward through the model, tokens sampled.

    SchedulerOutput ─prepare_inputs─► StepInputs ─forward─► logits [S, V] ─sample─► StepResult

The step's tokens are packed into one row, decodes first, then each prompt chunk:

    input_ids  [1, N]   the new tokens                 positions [1, N]  their absolute positions
    per KV group (one, unless the model has sliding windows: kv/layout.py):
      slot_mapping [N]  block_table[p // bs] * bs + p % bs: where each one's K/V is written
      groups            who attends to which keys (kv/paged.py); a sliding group's tables start at
                        the first block the window reaches, and its masks hide what lies before it
    logits_index [S]    the last token of each chunk that reaches its request's end: only those go
                        through the LM head, and a token is sampled for each

With `pack_prompts=False` each prompt chunk runs as a forward of its own after the decodes' (the
layout the benchmark compares against); packing is the default.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kvlab.backends.ops import ops_for
from kvlab.kernels import ThreadPolicy
from kvlab.kv.cache import AttentionMetadata, build_metadata, window_mask
from kvlab.kv.layout import KVGroup, window_start
from kvlab.kv.paged import AttentionGroup, KVGroupMetadata, PagedKVCache, PagedMetadata
from kvlab.kv.state_slots import plan_states
from kvlab.request import Request
from kvlab.runner.driver import ModelDriver
from kvlab.sampling.logprobs import Logprob, prompt_logprobs
from kvlab.sampling.sampler import BatchSampler
from kvlab.scheduler import ScheduledChunk, SchedulerOutput, StepResult


@dataclass
class ModelInputs:
    """One forward pass."""

    input_ids: torch.Tensor  # [1, N]
    meta: PagedMetadata
    logits_index: torch.Tensor  # [S] packed index of each sampling chunk's last token
    sampling: list[Request]  # the request of each logits row
    chunks: list[ScheduledChunk] = field(default_factory=list)  # packed in this order (prompt log-probabilities)


@dataclass
class StepExecution:
    """What `ModelRunner.execute` made of a plan: each request's tokens, the requests whose sampling failed
    (with why: they end; the others keep their tokens), and the device side's phases in seconds."""

    tokens: StepResult
    failed: list[tuple[Request, Exception]]
    prepare_s: float
    forward_s: float
    sample_s: float


@dataclass
class StepInputs:
    passes: list[ModelInputs] = field(default_factory=list)
    block_ops: list = field(default_factory=list)  # zero new blocks, copy prefix runs: done first, in order
    prompt_logprobs: dict[str, list[Logprob]] = field(default_factory=dict)  # the forward's, per request

    @property
    def sampling(self) -> list[Request]:
        return [r for p in self.passes for r in p.sampling]


class ModelRunner:
    def __init__(self, model, cache: PagedKVCache, pack_prompts: bool = True, policy: ThreadPolicy | None = None,
                 sampler: BatchSampler | None = None):  # fmt: skip
        self.model = model
        self.cache = cache
        self.device = cache.device
        self.block_size = cache.block_size
        self.layout = cache.layout
        # the windows each KV group's layers mask with (a one-table layout masks sliding layers in its one group)
        self.mask_windows = [sorted({cache.layout.layer_windows[i] for i in g.layers} - {None})
                             for g in cache.layout.groups]  # fmt: skip
        self.pack_prompts = pack_prompts
        self.driver = ModelDriver(model, policy, ops_for(self.device))  # the cache's device's ops
        # every sequence's sampling state (seeded generators, penalty counts, grammar matchers)
        self.sampler = sampler or BatchSampler(model.config.vocab_size if model is not None else 0, self.device)
        self.spec = None  # a SpecDecoder (spec_decode/) when the engine speculates: drafts, verifies, counts

    # ---- the step ----------------------------------------------------------------------------------

    def execute(self, plan: SchedulerOutput) -> StepExecution:
        """The device side of one step: the plan as tensors, the forward (a draft model prefills the prompts
        it finishes, as the target does), then a token per request that reached its end, sampled or
        verified against its drafts."""
        t0 = time.perf_counter()
        inputs = self.prepare_inputs(plan)  # token ids, positions, slot mapping, block tables
        t1 = time.perf_counter()
        logits = self.forward(inputs)  # one batched forward (per pass)
        if self.spec is not None:
            self.spec.prefill(plan)
        t2 = time.perf_counter()
        tokens, failed = self._sample_isolated(inputs, logits)
        return StepExecution(tokens, failed, t1 - t0, t2 - t1, time.perf_counter() - t2)

    def propose(self, running: list[Request]) -> None:
        """Drafted tokens for the running requests whose next step is a decode (no-op without speculation)."""
        if self.spec is not None:
            self.spec.propose(running)

    def _sample_isolated(self, inputs: StepInputs, logits) -> tuple[StepResult, list[tuple[Request, Exception]]]:
        """`sample`; if it raises, each request alone, to find the one(s) that cannot be sampled.

        A retried request that had drawn before the failure draws again: its seeded text differs
        from a run without the failure. The forward's prompt log-probabilities join the result.
        """
        requests = inputs.sampling
        tokens, failed = StepResult(prompt_logprobs=dict(inputs.prompt_logprobs)), []
        try:
            tokens.merge(self.sample(requests, logits))
            return tokens, []
        except Exception:
            if len(requests) <= 1:
                raise
        for request, lo, hi in row_groups(requests):  # a verifying request's k + 1 rows stay together
            try:
                tokens.merge(self.sample(requests[lo:hi], logits[lo:hi]))
            except Exception as error:
                failed.append((request, error))
        return tokens, failed

    # ---- 1. tensors --------------------------------------------------------------------------------

    def prepare_inputs(self, plan: SchedulerOutput) -> StepInputs:
        # a chunk verifying drafted tokens runs as decode rows, one per token (each its own query over
        # the same block table, writing its K/V before any row attends): a decode step's shape, so the
        # fused decode step and the kernels take it, with the numbers a plain decode of each would give
        decodes = [row for c in plan.chunks if c.is_decode or c.as_rows for row in (c.rows() if c.as_rows else [c])]
        prompts = [c for c in plan.chunks if not (c.is_decode or c.as_rows)]
        if self.pack_prompts:
            batches = [decodes + prompts]
        else:
            batches = ([decodes] if decodes else []) + [[c] for c in prompts]
        return StepInputs([self._build(chunks) for chunks in batches], list(plan.block_ops))

    def _build(self, chunks: list[ScheduledChunk]) -> ModelInputs:
        ids: list[int] = []
        positions: list[int] = []
        logits_index: list[int] = []
        sampling: list[Request] = []
        for c in chunks:
            ids.extend(c.token_ids())
            positions.extend(range(c.start, c.end))
            if c.samples or c.logits_row:  # a verification's rows: one logits row each (the request repeated)
                logits_index.append(len(ids) - 1)
                sampling.append(c.request)
        kv_groups = [self._kv_group(chunks, g, group) for g, group in enumerate(self.layout.groups)]
        tensor = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)  # noqa: E731
        meta = PagedMetadata(positions=tensor([positions]), kv_groups=kv_groups)
        states = getattr(self.cache, "states", None)  # a hybrid's StatePool (kv/state_pool.py)
        if states is not None:  # which state slot each token continues (kv/state_slots.py)
            meta.states = plan_states(chunks, states.slots)
        return ModelInputs(tensor([ids]), meta, tensor(logits_index), sampling, chunks)

    def _kv_group(self, chunks: list[ScheduledChunk], g: int, kv: KVGroup) -> KVGroupMetadata:
        """KV group g's slots and attention groups: the decodes as one batch, then each prompt chunk."""
        bs, windows = self.block_size, self.mask_windows[g]
        slots: list[int] = []
        for c in chunks:
            table = c.block_tables[g]
            slots.extend(table[p // bs] * bs + p % bs for p in range(c.start, c.end))
        decodes = [c for c in chunks if c.is_decode]
        groups = [self._decode_group(decodes, g, kv, windows)] if decodes else []
        lo = len(decodes)
        for run in _fresh_runs(chunks[len(decodes) :]):
            groups.append(self._chunk_group(run, lo, g, kv, windows))
            lo += sum(c.num_new_tokens for c in run)
        return KVGroupMetadata(torch.tensor(slots, dtype=torch.long, device=self.device), groups)

    def _decode_group(self, decodes: list[ScheduledChunk], g: int, kv: KVGroup, windows) -> AttentionGroup:
        """B sequences, one new token each: keys gathered to the longest, the rest masked. A sliding
        group gathers each sequence from the first block its window reaches."""
        bs = self.block_size
        first = [window_start(kv.window, c.start) // bs for c in decodes]
        lens = [c.end - f * bs for c, f in zip(decodes, first)]  # keys gathered per sequence
        L = max(lens)
        num_blocks = -(-L // bs)
        tables = [c.block_tables[g][f : f + num_blocks] for c, f in zip(decodes, first)]
        tables = [t + [0] * (num_blocks - len(t)) for t in tables]  # padding: block 0, masked
        positions = torch.tensor([[c.start] for c in decodes], device=self.device)  # [B, 1]
        keys = torch.tensor(first, device=self.device)[:, None] * bs + torch.arange(L, device=self.device)  # [B, L]

        padded = min(lens) != L

        def meta(window: int | None) -> AttentionMetadata:  # a mask [B, 1, 1, L] where some key is hidden
            cut = window is not None and any(c.start - window + 1 > f * bs for c, f in zip(decodes, first))
            hides = padded or cut
            mask = window_mask(positions, keys, window)[:, None] if hides else None
            return AttentionMetadata(positions=positions, start=L - 1, attn_mask=mask)

        plain = meta(None)
        plain.windowed = {w: meta(w) for w in windows}
        tables_t = torch.tensor(tables, dtype=torch.long, device=self.device)
        return AttentionGroup(0, len(decodes), tables_t, L, plain)

    def _chunk_group(self, run: list[ScheduledChunk], lo: int, g: int, kv: KVGroup, windows) -> AttentionGroup:
        """Prompt chunks of T new tokens each after `start` cached ones, causal (and windowed): one chunk,
        or several fresh ones of the same T (`_fresh_runs`), attending as one batch."""
        bs, c = self.block_size, run[0]
        first = window_start(kv.window, c.start) // bs
        tables = torch.tensor([r.block_tables[g][first : -(-r.end // bs)] for r in run], dtype=torch.long,
                              device=self.device)  # fmt: skip
        if first == 0:
            meta = build_metadata(c.start, c.num_new_tokens, len(run), self.device, windows)
        else:  # a sliding group past its first blocks: every query's window starts inside what is gathered
            positions = torch.arange(c.start, c.end, device=self.device)[None]
            keys = torch.arange(first * bs, c.end, device=self.device)
            mask = window_mask(positions[0], keys, kv.window)[None, None]  # [1, 1, T, L]
            meta = AttentionMetadata(positions=positions, start=c.start, attn_mask=mask)
            meta.windowed = {kv.window: meta}
        return AttentionGroup(lo, lo + len(run) * c.num_new_tokens, tables, c.end - first * bs, meta)

    # ---- 2. the model --------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, step: StepInputs) -> torch.Tensor:
        """Run every pass; logits [S, V] float32 for the sampling chunks, in `step.sampling` order.

        Requests with prompt_logprobs also get the LM head at their prompt positions in the same pass;
        their log-probabilities go to `step.prompt_logprobs`."""
        self.cache.apply(step.block_ops)
        rows = []
        for p in step.passes:
            # a pass with nothing to sample still needs the forward (it writes K/V); one LM-head row is cheap
            index = p.logits_index if p.sampling else p.logits_index.new_tensor([p.input_ids.shape[1] - 1])
            extra, num_sampling = _prompt_rows(p.chunks), index.numel()
            if extra:
                index = torch.cat([index, index.new_tensor([row for _, _, rws in extra for row in rws])])
            logits = self.driver.run(p.input_ids, self.cache, p.meta, logits_index=index)[0]  # [S (+ prompt rows), V]
            if self.spec is not None:  # an MTP proposer keeps the pass's hidden states
                self.spec.observe_pass(p.chunks)
            if extra:
                self._prompt_logprobs(step, extra, logits[num_sampling:])
                logits = logits[:num_sampling]
            if p.sampling:
                rows.append(logits)
        if not rows:
            return torch.empty(0, 0)
        return rows[0] if len(rows) == 1 else torch.cat(rows)

    def _prompt_logprobs(self, step: StepInputs, extra, logits: torch.Tensor) -> None:
        at = 0
        for request, first, rws in extra:
            ids = request.all_token_ids
            nxt = [ids[q + 1] for q in range(first, first + len(rws))]
            lps = prompt_logprobs(logits[at : at + len(rws)], nxt, request.params.prompt_logprobs)
            step.prompt_logprobs.setdefault(request.request_id, []).extend(lps)
            at += len(rws)

    # ---- 3. tokens --------------------------------------------------------------------------------

    def sample(self, requests: list[Request], logits: torch.Tensor) -> StepResult:
        """One token per request (and the first token of each choice it forks), all rows together
        (sampling/sampler.py's BatchSampler); a request verifying k drafts has k + 1 rows in a row and
        keeps what the verifier accepts (spec_decode/), its rejected drafts' positions to roll back.

        Under the engine's thread policy, as the forward was: a few rows' argmax on PyTorch's threads
        woke its OpenMP workers against the kernels' pool (5.9 ms for one 49,152-row argmax at two
        threads, 0.1 ms at one, measured here)."""
        groups = row_groups(requests)
        if len(groups) < len(requests):
            return self._sample_verifying(groups, logits)
        with self.driver.ops.applied(self.driver.policy, len(requests)):
            out = self.sampler.sample(requests, logits)
        return StepResult({sid: [t] for sid, t in out.tokens.items()},
                          logprobs={sid: [lp] for sid, lp in out.logprobs.items()}, forks=out.forks)  # fmt: skip

    def _sample_verifying(self, groups, logits: torch.Tensor) -> StepResult:
        plain = [(r, lo) for r, lo, hi in groups if hi - lo == 1]
        result = StepResult()
        if plain:
            index = torch.tensor([lo for _, lo in plain], device=logits.device)
            result = self.sample([r for r, _ in plain], logits[index])
        verifying = [(r, lo, hi) for r, lo, hi in groups if hi - lo > 1]
        with self.driver.ops.applied(self.driver.policy, len(verifying)):
            fast = [(r, lo, hi) for r, lo, hi in verifying if r.params.is_plain_greedy]
            if fast:
                rows = torch.cat([logits[lo:hi] for _, lo, hi in fast])
                spans, at = [], 0
                for _, lo, hi in fast:
                    spans.append((at, at + hi - lo))
                    at += hi - lo
                kept = self.spec.verify_greedy_many([r for r, _, _ in fast], rows, spans)
            else:
                kept = {}
            for r, lo, hi in verifying:
                if r.request_id not in kept:
                    kept[r.request_id] = self.spec.verify(r, logits[lo:hi])
        for r, lo, hi in verifying:
            tokens, accepted = kept[r.request_id]
            result.sampled_token_ids[r.request_id] = tokens
            result.num_rejected_tokens[r.request_id] = hi - lo - 1 - accepted
        return result

    def release(self, request_id: str) -> None:
        """Forget a finished sequence's sampling state."""
        self.sampler.release(request_id)


def row_groups(requests: list[Request]) -> list[tuple[Request, int, int]]:
    """(request, first row, end row) of each request in a step's logits rows: one row each, k + 1 in a row
    for a request verifying k drafted tokens."""
    groups: list[tuple[Request, int, int]] = []
    for i, r in enumerate(requests):
        if groups and groups[-1][0] is r and r.spec_token_ids:
            groups[-1] = (r, groups[-1][1], i + 1)
        else:
            groups.append((r, i, i + 1))
    return groups


def _prompt_rows(chunks: list[ScheduledChunk]) -> list[tuple[Request, int, list[int]]]:
    """For each chunk of a request that wants prompt log-probabilities: (request, first position q, packed
    rows of positions q.. whose logits predict the prompt token at q + 1), skipping positions done before."""
    out, offset = [], 0
    for c in chunks:
        r = c.request
        if r.params.prompt_logprobs is not None:
            first, last = max(c.start, r.num_prompt_logprobs), min(c.end, r.num_prompt_tokens - 1)
            if first < last:
                out.append((r, first, [offset + q - c.start for q in range(first, last)]))
        offset += c.num_new_tokens
    return out


def _fresh_runs(prompts: list[ScheduledChunk]) -> list[list[ScheduledChunk]]:
    """The prompt chunks in runs that attend as one batch: consecutive chunks with nothing cached before
    them (start 0) and the same number of tokens share a run; every other chunk is a run of its own. Each
    sequence's numbers are those of its own call (SmolLM2, a burst's 8 × 64 tokens: 30 attention calls a
    pass instead of 240, 33 → 23 ms of a 150 ms pass)."""
    runs: list[list[ScheduledChunk]] = []
    for c in prompts:
        last = runs[-1][-1] if runs else None
        if c.start == 0 and last is not None and last.start == 0 and last.num_new_tokens == c.num_new_tokens:
            runs[-1].append(c)
        else:
            runs.append([c])
    return runs
