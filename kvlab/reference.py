"""ReferenceEngine: one sequence, a contiguous cache, prefill in one pass, one decode step per token.

    tokens ─► ReferenceEngine.generate() ─► prefill forward ─► sample ─► decode forward ─► sample ─► …
                 │ a Session keeps the cache and the ids it holds between chat turns

Every user-facing path (LLM, `kvlab run`/`chat`, the server, the benchmarks) goes through the serving
engine, `kvlab.engine.LLMEngine`. This one stays as the simplest correct loop, and the oracle the
tests hold the paged engine to, token for token; with `use_cache=False` every step recomputes the
whole sequence (what the cache saves). Its forwards go through the one ModelDriver.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from kvlab.errors import KvlabError
from kvlab.kernels import ThreadPolicy
from kvlab.kv.cache import ContiguousKVCache, NoCache, SingleBatchKVCache
from kvlab.model.loader import LoadedModel
from kvlab.output.result import RequestMetrics
from kvlab.request import check_token_ids
from kvlab.runner.driver import ModelDriver
from kvlab.sampling.params import SamplingParams
from kvlab.sampling.sampler import Sampler
from kvlab.stats import peak_memory_bytes


@dataclass
class Session:
    """A conversation's cache and the token ids whose K/V it holds (kept between turns)."""

    cache: ContiguousKVCache
    cached_ids: list[int] = field(default_factory=list)


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class ReferenceEngine:
    def __init__(self, loaded: LoadedModel, max_model_len: int | None = None, use_cache: bool = True,
                 policy: ThreadPolicy | None = None):  # fmt: skip
        self.loaded = loaded
        self.model = loaded.model
        self.config = loaded.config
        self.driver = ModelDriver(self.model, policy)
        self.device = self.model.device
        self.max_model_len = min(max_model_len or self.config.max_position_embeddings, self.model.rotary.cos.shape[0])
        self.use_cache = use_cache
        self.eos_token_ids: tuple[int, ...] = self.config.eos_token_ids

    def new_session(self, capacity: int = 256) -> Session:
        cache = ContiguousKVCache.for_model(
            self.config, min(capacity, self.max_model_len), dtype=self.model.dtype, device=self.device
        )
        return Session(cache)

    def forward(self, ids: list[int], cache: SingleBatchKVCache) -> torch.Tensor:
        """Append `ids` to the (single) sequence in `cache`; logits [V] of the last one."""
        return self.driver.append(ids, cache)

    def check_prompt(self, prompt_ids: list[int]) -> None:
        check_token_ids(prompt_ids, self.config.vocab_size)
        if len(prompt_ids) >= self.max_model_len:
            raise KvlabError(
                f"the prompt is {len(prompt_ids)} tokens; the context holds {self.max_model_len} "
                f"(prompt and answer together): shorten the prompt"
            )

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        metrics: RequestMetrics,
        session: Session | None = None,
    ) -> Iterator[int]:
        """Yield each new token id. Stops at EOS (unless ignore_eos), max_tokens or the context's end.

        The caller may stop early (a stop string) by closing the generator; no forward runs after the
        last token is yielded.
        """
        self.check_prompt(prompt_ids)
        start = time.perf_counter()
        max_new = min(params.max_tokens, self.max_model_len - len(prompt_ids))
        sampler = Sampler(params, self.device)
        history = torch.tensor(prompt_ids, device=self.device) if params.repetition_penalty != 1.0 else None
        metrics.prompt_tokens = len(prompt_ids)

        if self.use_cache:
            session = session or self.new_session(len(prompt_ids) + max_new)
            step = self._cached_steps(prompt_ids, max_new, session, metrics)
        else:
            step = self._uncached_steps(prompt_ids)
        try:
            logits = next(step)
            for i in range(max_new):
                token = sampler(logits, history)
                now = time.perf_counter()
                if i == 0:
                    metrics.ttft_s = metrics.prefill_s = now - start
                    first = now
                metrics.decode_s = now - first
                metrics.generated_tokens = i + 1
                if history is not None:
                    history = torch.cat([history, history.new_tensor([token])])  # only with a penalty
                yield token
                if (token in self.eos_token_ids and not params.ignore_eos) or i + 1 == max_new:
                    break
                logits = step.send(token)
        finally:  # also when the caller stops early (stop string, closed stream)
            if self.use_cache:
                metrics.kv_cache_bytes = session.cache.used_bytes()
                metrics.kv_cache_allocated_bytes = session.cache.nbytes()
            metrics.peak_memory_bytes = peak_memory_bytes(self.device)

    def _cached_steps(self, prompt_ids, max_new, session: Session, metrics: RequestMetrics):
        """Prefill only what the session's cache lacks, then one forward per sent token."""
        reuse = min(common_prefix_len(session.cached_ids, prompt_ids), len(prompt_ids) - 1)
        session.cache.truncate(reuse)
        session.cache.reserve(len(prompt_ids) + max_new)
        metrics.cached_prompt_tokens = reuse
        session.cached_ids = list(prompt_ids)
        token = yield self.forward(prompt_ids[reuse:], session.cache)
        while True:
            session.cached_ids.append(token)
            token = yield self.forward([token], session.cache)

    def _uncached_steps(self, prompt_ids):
        """Recompute the whole sequence at every step: what the KV cache saves."""
        ids = list(prompt_ids)
        while True:
            token = yield self.forward(ids, NoCache.for_model(self.config, device=self.device))
            ids.append(token)
