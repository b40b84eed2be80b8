"""The draft-model proposer: a smaller model with the target's tokenizer drafts k tokens per round, from
its own paged KV cache in the same engine (its own pool, block tables and runner).

Each target request has a shadow Request here whose `all_token_ids` are exactly the tokens whose K/V
the draft cache holds (plus the one being fed). A round, for every drafting request at once:

    1. sync     keep the draft's K/V up to the longest prefix it shares with the target's tokens (what the
                target accepted); truncate the rest (KVCacheManager.truncate)
    2. catch up feed the target's tokens after that prefix (the last round's accepted drafts and the
                target's own token; a whole prompt the first time) → logits → draft token 1
    3. k − 1 passes of one token each (decode rows) → draft tokens 2..k

Draft tokens are the draft's argmax for greedy requests; for sampled ones they are drawn from q (the
draft's distribution under the request's own temperature and filters) with the request's seeded
generator, and q is kept for the verifier.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from kvlab.config import EngineConfig
from kvlab.errors import KvlabError
from kvlab.kv.formats import KVFormats
from kvlab.kv.layout import KVLayout
from kvlab.kv.paged import PagedKVCache
from kvlab.request import Request
from kvlab.runner.pipeline import build_pipeline
from kvlab.scheduler import ScheduledChunk, SchedulerOutput
from kvlab.spec_decode.rejection_sampler import _invert, draft_distribution


def check_same_tokenizer(target_tokenizer, draft_tokenizer, target_config, draft_config, name: str) -> None:
    """KvlabError unless the draft reads and writes the target's token ids."""
    if (target_tokenizer is None) != (draft_tokenizer is None):
        raise KvlabError(f"the draft model {name} and the target must both have a tokenizer, or neither")
    if target_tokenizer is None:
        if target_config.vocab_size != draft_config.vocab_size:
            raise KvlabError(f"the draft model {name} has a vocabulary of {draft_config.vocab_size} tokens, the target "
                             f"{target_config.vocab_size}: speculative decoding needs the same tokenizer")  # fmt: skip
        return
    mine, theirs = target_tokenizer.backend.get_vocab(), draft_tokenizer.backend.get_vocab()
    if mine != theirs:
        differing = sorted(set(mine.items()) ^ set(theirs.items()), key=lambda kv: kv[1])
        example = f" (e.g. {differing[0][0]!r} → {differing[0][1]})" if differing else ""
        raise KvlabError(f"the draft model {name} has another tokenizer than the target ({len(theirs)} vs "
                         f"{len(mine)} tokens{example}): speculative decoding needs the same tokenizer")  # fmt: skip


class DraftModelProposer:
    """`loaded`, the draft model, with its own pipeline (runner/pipeline.py) built from the target's
    EngineConfig: the same block size, context and KV formats (K and V as the target stores them), as many
    blocks as the target's pool, no prefix caching."""

    def __init__(self, loaded, vocab_size: int, target_config: EngineConfig, target_plan, policy, name: str):
        self.loaded, self.model = loaded, loaded.model
        self.vocab_size = vocab_size  # the target's: q rows are laid over it
        config, max_model_len = loaded.config, target_plan.max_model_len
        if any(layer.label == "linear_attention" for layer in config.layers):
            raise KvlabError(f"the draft model {name} has Gated DeltaNet layers: a draft's own rejected tokens would "
                             "need its recurrent state rolled back, which kvlab does only for the target")  # fmt: skip
        if config.max_position_embeddings < max_model_len:
            raise KvlabError(f"the draft model's context ({config.max_position_embeddings} tokens) is shorter than "
                             f"the target's max_model_len {max_model_len}: give --max-model-len ≤ "
                             f"{config.max_position_embeddings}")  # fmt: skip
        layout, block_size = KVLayout.for_model(config), target_config.block_size
        try:
            formats = KVFormats.resolve(target_config.kv_cache_dtype, target_config.cache_type_k,
                                        target_config.cache_type_v, self.model.dtype, target_config.kv_rotation)  # fmt: skip
            per_block = PagedKVCache.bytes_per_block_for(config, self.model.dtype, block_size, layout, formats)
            engine = replace(target_config, max_model_len=max_model_len, speculative_config=None,
                             kv_memory_bytes=target_plan.num_blocks * per_block * len(layout.groups))  # fmt: skip
            pipeline = build_pipeline(loaded, engine, policy, prefix_caching=False)
        except KvlabError as e:
            raise KvlabError(f"the draft model {name} cannot hold the target's KV cache "
                             f"({target_plan.formats.description}): {e}") from None  # fmt: skip
        self.pool_plan, self.cache, self.kv, self.runner = pipeline.pool_plan, pipeline.cache, pipeline.kv, pipeline.runner
        self.shadows: dict[str, Request] = {}
        self._synced: dict[str, int] = {}  # leading shadow tokens known to equal the target's
        self.num_passes = 0  # draft forwards run (one per drafted position, batched over requests)
        self.pass_s = 0.0  # their time

    def release(self, request_id: str) -> None:
        shadow = self.shadows.pop(request_id, None)
        self._synced.pop(request_id, None)
        if shadow is not None:
            self.kv.free(shadow)

    def _sync(self, request: Request, keep_last: bool = True) -> Request | None:
        """The request's shadow holding the draft K/V of the longest prefix it shares with the target (with
        `keep_last`, short of the last token: it is fed to draft the next one)."""
        target = request.all_token_ids
        shadow = self.shadows.get(request.request_id)
        if shadow is None:
            shadow = Request(request.request_id, [], request.params, max_tokens=1 << 30)
            shadow.all_token_ids = []
            self.shadows[request.request_id], self._synced[request.request_id] = shadow, 0
        have = shadow.all_token_ids
        m = min(self._synced[request.request_id], shadow.num_computed_tokens)
        limit = min(shadow.num_computed_tokens, len(target) - keep_last)  # at least one token is fed
        while m < limit and have[m] == target[m]:
            m += 1
        m = min(m, limit)
        if shadow.num_computed_tokens > m:
            self.kv.truncate(shadow, m)
        shadow.all_token_ids = list(target)
        self._synced[request.request_id] = len(target)
        return shadow

    def _run(self, chunks: list[ScheduledChunk]) -> dict[str, torch.Tensor]:
        t0 = time.perf_counter()
        inputs = self.runner.prepare_inputs(SchedulerOutput(step=0, chunks=chunks, block_ops=self.kv.take_pending_ops()))
        inputs.block_ops += self._ops  # copies owed by truncations first, then zero the blocks just allocated
        self._ops = []
        logits = self.runner.forward(inputs)
        if all(c.num_new_tokens == 1 or c.as_rows for c in chunks):  # a draft step (not a prompt's prefill): timed for c
            self.num_passes += 1
            self.pass_s += time.perf_counter() - t0
        return {r.request_id: logits[i] for i, r in enumerate(inputs.sampling)}  # rows come decodes first

    def prefill(self, requests: list[Request]) -> None:
        """The draft's K/V of prompts the target is prefilling in this step (in the same step, as the target's
        prefill: its time is the request's time to first token, not its decoding's)."""
        self._ops, chunks = [], []
        for r in requests:
            shadow = self._sync(r, keep_last=False)
            n = shadow.num_tokens - shadow.num_computed_tokens
            ops = self.kv.allocate_slots(shadow, n) if n else None
            if ops is None:
                if n:
                    self.release(r.request_id)
                continue
            self._ops += ops
            chunks.append(ScheduledChunk(shadow, shadow.num_computed_tokens, n, self.kv.block_tables[r.request_id]))
        if chunks:
            self._run(chunks)
            for c in chunks:
                c.request.num_computed_tokens = c.end

    def propose(self, requests: list[Request], ks: dict[str, int], states) -> tuple[dict[str, list[int]], dict]:
        """Draft ks[id] tokens for each request: (drafts, q [k, V] of each sampled request)."""
        self._ops = []
        active, drafts, probs = [], {}, {}
        for r in requests:
            shadow = self._sync(r)
            n = shadow.num_tokens - shadow.num_computed_tokens
            ops = self.kv.allocate_slots(shadow, n + ks[r.request_id] - 1)
            if ops is None:  # the draft pool is full: this request decodes plainly this round
                self.release(r.request_id)
                continue
            self._ops += ops
            active.append((r, shadow))
            drafts[r.request_id], probs[r.request_id] = [], []
        step = 0
        while active:
            chunks = []
            for r, shadow in active:
                start = shadow.num_computed_tokens
                n = shadow.num_tokens - start
                small = n <= ks[r.request_id] + 1  # a short catch-up runs as decode rows (the fused step)
                chunks.append(ScheduledChunk(shadow, start, n, self.kv.block_tables[r.request_id], as_rows=small and n > 1))
            logits = self._run(chunks)
            still = []
            for r, shadow in active:
                row = logits[r.request_id]
                shadow.num_computed_tokens = shadow.num_tokens
                token = self._draw(r, row, states(r), probs[r.request_id])
                drafts[r.request_id].append(token)
                if len(drafts[r.request_id]) < ks[r.request_id]:
                    shadow.all_token_ids.append(token)
                    still.append((r, shadow))
            active, step = still, step + 1
        q = {rid: torch.stack(p) for rid, p in probs.items() if p}
        return drafts, q

    def _draw(self, request: Request, row: torch.Tensor, state, probs: list) -> int:
        params = request.params
        if params.is_greedy:
            if state.bias_ids is not None:
                row = row.clone()
                row[state.bias_ids.to(row.device)] += state.bias_values.to(row.device)
            return int(row[: self.vocab_size].argmax())
        q = draft_distribution(row, params, self.vocab_size, state)
        probs.append(q)
        return _invert(q, state.uniform())
