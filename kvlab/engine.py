"""LLMEngine: many requests, one batched forward per step, over a paged KV cache.

    add_request ─► Scheduler ─► ModelRunner ─► Transformer ─► Sampler ─► OutputState ─► StepOutput
                   what runs    tensors,       attention       tokens    text, stop
                   this step    slot mapping   through blocks            strings

`step()` is the whole engine: schedule → execute (the runner: prepare inputs, forward, sample or verify)
→ update and detokenize → drafts for the next step, each timed (`stats`). The device side (KV pool,
cache, block manager, runner) is built by `runner/pipeline.py`, as a draft model's is. Callers add requests and call `step()` until `has_unfinished_requests` is
False: the offline `LLM` does it in its own thread, the server in an engine thread.
"""

from __future__ import annotations

import itertools
import logging
import time

from kvlab.config import EngineConfig
from kvlab.errors import KvlabError
from kvlab.kernels import ThreadPolicy
from kvlab.kv.manager import KVLedger
from kvlab.kv.prompt_cache import MemoryOnly, PromptCache
from kvlab.model.loader import LoadedModel
from kvlab.output.group import RequestGroup
from kvlab.output.processor import OutputState, StepOutput
from kvlab.output.result import RequestOutput
from kvlab.parallel.group import RankFailed
from kvlab.request import Request, RequestStatus, check_token_ids
from kvlab.runner.pipeline import build_pipeline
from kvlab.sampling.params import SamplingParams
from kvlab.sampling.sampler import BatchSampler
from kvlab.sampling.structured import GrammarCompiler
from kvlab.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, StepResult
from kvlab.spec_decode import SpecDecoder
from kvlab.spec_decode.metrics import SpecDecodingStats
from kvlab.stats import STEP_PHASES, EngineStats, peak_memory_bytes

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self, loaded: LoadedModel, tokenizer=None, config: EngineConfig | None = None, policy: ThreadPolicy | None = None
    ):
        """`policy`: how this engine's passes use the CPU (its threads; default: torch's thread count)."""
        config = config or EngineConfig()
        self.config, self.loaded, self.tokenizer = config, loaded, tokenizer
        model, model_config = loaded.model, loaded.config
        # the model's end-of-sequence ids and the tokenizer's (end-of-turn tokens, generation_config's)
        eos = set(model_config.eos_token_ids) | set(tokenizer.eos_token_ids if tokenizer else ())
        self.eos_token_ids: tuple[int, ...] = tuple(sorted(eos))
        self.vocab_size = model_config.vocab_size
        self.grammars = GrammarCompiler(tokenizer, self.vocab_size, self.eos_token_ids) if tokenizer else None
        sampler = BatchSampler(self.vocab_size, model.device, self.grammars)
        pipeline = build_pipeline(loaded, config, policy, sampler)  # the device side: pool, cache, blocks, runner
        self.pool_plan, self.cache, self.kv, self.runner = pipeline.pool_plan, pipeline.cache, pipeline.kv, pipeline.runner
        self.max_model_len = self.pool_plan.max_model_len
        # what runs a decode step (kvlab/backends): the C backend, or the modules and why, said once here
        self.decode_path = self.runner.driver.decode_path(self.cache)
        logger.info("%s", self.decode_path.describe())
        seats, backend = self.pool_plan.max_num_seqs, self.decode_path.backend
        steady = backend.steady_rows(self.runner.driver.policy) if backend is not None else None
        if config.max_num_seqs is None and steady:  # the default seats, kept where each sequence's numbers stay its own
            seats = min(seats, steady)
        scheduler_config = SchedulerConfig(self.max_model_len, seats, config.max_num_batched_tokens,
                                           recompute_every_step=not config.use_cache)  # fmt: skip
        self.scheduler = Scheduler(scheduler_config, self.kv)
        # speculative decoding (spec_decode/): the runner's proposer drafts, its sampling verifies
        self.runner.spec = SpecDecoder.create(config.speculative_config, loaded, tokenizer, config, pipeline)
        self.stats = EngineStats()
        # the prefix cache's disk tier (--prompt-cache-dir, kv/prompt_cache.py; None: memory only) and its hooks
        self.prompt_cache = PromptCache.create(config, loaded, self.cache, self.kv)
        self._disk = self.prompt_cache or MemoryOnly()
        self._states: dict[str, tuple[Request, OutputState]] = {}  # per sequence (a request, or one of its choices)
        self._groups: dict[str, RequestGroup] = {}  # per request id: its choices
        self._ids = itertools.count()

    # ---- requests in and out -----------------------------------------------------------------------

    def check_prompt(self, prompt_ids: list[int], max_tokens: int | None = None) -> None:
        """Raise KvlabError for an empty prompt, one that leaves no room in the context, or unknown token ids.

        With `max_tokens`, the prompt and max_tokens must fit together (the server's rule); without it
        generation simply stops at the context's end.
        """
        check_token_ids(prompt_ids, self.loaded.config.vocab_size)
        total = len(prompt_ids) + (max_tokens or 1)
        if len(prompt_ids) >= self.max_model_len or total > self.max_model_len:
            asked = f"{len(prompt_ids)} prompt tokens" + (f" + {max_tokens} max_tokens" if max_tokens else "")
            raise KvlabError(
                f"{asked} do not fit the context of {self.max_model_len} tokens "
                f"(prompt and answer together): shorten the prompt" + (" or lower max_tokens" if max_tokens else "")
            )

    def check_params(self, params: SamplingParams) -> None:
        """Raise KvlabError for what only this engine can judge: logit_bias ids outside the vocabulary, a
        structured output its grammar engine cannot compile (compiled grammars are cached)."""
        k = params.num_speculative_tokens
        if k and self.spec is None:
            raise KvlabError("num_speculative_tokens: this engine does not speculate (start it with --speculative-config)")
        if k and k > self.spec.k:
            raise KvlabError(f"num_speculative_tokens must be at most the engine's {self.spec.k}, got {k}")
        bad = [t for t in (params.logit_bias or ()) if t >= self.vocab_size]
        if bad:
            raise KvlabError(f"logit_bias token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
        if params.structured_outputs is not None:
            if self.grammars is None:
                raise KvlabError("structured outputs need the model's tokenizer")
            self.grammars.compile(params.structured_outputs)

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        output: RequestOutput | None = None,
        arrival_s: float | None = None,
        cache_salt: str | None = None,
        client_id: str | None = None,
    ) -> str:
        """Queue a request; it runs from the next step on. Returns its id.

        `cache_salt`: the request shares prefix-cache blocks only with requests of the same salt. A request
        with prompt_logprobs is salted apart (its own id): every prompt token must go through the model.
        With n > 1 (or best_of) the prompt is prefilled once and the other choices fork from it.
        `client_id`: the scheduler shares seats and prompt tokens fairly between clients (scheduler/fair.py).
        """
        self.check_prompt(prompt_token_ids)
        self.check_params(params)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._groups:
            raise KvlabError(f"request id {request_id!r} is already in the engine")
        if params.prompt_logprobs is not None:
            cache_salt = f"{cache_salt}\0prompt-logprobs\0{request_id}"
        request = Request(
            request_id, list(prompt_token_ids), params,
            max_tokens=min(params.max_tokens, self.max_model_len - len(prompt_token_ids)),
            eos_token_ids=frozenset(self.eos_token_ids), arrival_s=arrival_s or time.perf_counter(),
            cache_salt=cache_salt, client_id=client_id,
            fork_ids=tuple(Request.choice_id(request_id, i) for i in range(1, params.num_sequences)),
        )  # fmt: skip
        output = output or RequestOutput(prompt=None, prompt_token_ids=list(prompt_token_ids))
        output.request_id = request_id
        group = self._groups[request_id] = RequestGroup.new(output, params, request_id)
        self._states[request_id] = (request, OutputState(request, self.tokenizer, output, group.choice(0)))
        if not self._disk.hold(request):  # held: its blocks are read from disk first
            self.scheduler.add_request(request)
        return request_id

    def abort_request(self, request_id: str) -> StepOutput | None:
        """Stop a request now, every choice of it (their blocks go back to the pool); None if it is not in
        the engine. Returns the last choice's final output (`finished` set)."""
        group = self._groups.get(request_id)
        if group is None:
            return None
        if (held := self._disk.cancel(request_id)) is not None:
            self.scheduler.add_request(held)  # where finish_request looks for it
        out = None
        for seq_id in sorted(group.live):
            if seq_id not in self._states:  # lost in a step that failed while finalizing it
                group.live.discard(seq_id)
                continue
            request, state = self._states[seq_id]
            self.scheduler.finish_request(request, RequestStatus.FINISHED_ABORTED)
            out = self._finalize(request, state, state.finish(request))
        if request_id in self._groups and not group.live:  # every choice was lost: forget the request
            del self._groups[request_id]
        return out

    def has_request(self, request_id: str) -> bool:
        return request_id in self._groups

    @property
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests or bool(self._disk.num_held)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + self._disk.num_held

    # ---- one step ------------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """Advance every scheduled request by one chunk; return what each request gained.

        An exception inside the step ends only requests of this step (`_fail_step`), whose outputs
        carry `error`; the engine goes on with every other request.
        """
        plan = None
        try:
            t0 = time.perf_counter()
            self._admit_restored()  # 0. requests whose blocks came back from disk (kv/prompt_cache.py)
            plan = self.scheduler.schedule()  # 1. which requests, how many tokens each
            t1 = time.perf_counter()
            if not plan.chunks:
                return []
            step = self.runner.execute(plan)  # 2-4. tensors, forward, a token per request (sampled or verified)
            t4 = time.perf_counter()
            tokens = step.tokens
            outputs = [o for r, e in step.failed if self.has_request(r.group_id) and (o := self._fail(r, e)) is not None]
            outputs += self._update(plan, tokens, step_s=t4 - t0)  # 5. append, stop, detokenize
            self._disk.save_new_blocks()  # the blocks this step filled, copied out for the disk's writer
            t5 = time.perf_counter()
        except RankFailed:
            raise  # another rank of a tensor-parallel job is gone: no request can go on (kvlab/parallel)
        except Exception as error:
            return self._fail_step(plan, error)
        phases = dict(zip(STEP_PHASES, (t1 - t0, step.prepare_s, step.forward_s, step.sample_s, t5 - t4)))
        prompt = any(c.start < c.request.num_prompt_tokens for c in plan.chunks)
        self.stats.record_step(phases, plan.num_tokens, tokens.num_sampled, prompt)
        if self.spec is not None:
            pure = all(c.is_decode or c.spec_token_ids for c in plan.chunks)
            self.spec.record_step(t5 - t0, pure, sum(1 for c in plan.chunks if c.spec_token_ids), tokens.num_sampled,
                                  plan.num_tokens)  # fmt: skip
        try:
            self.runner.propose(self.scheduler.running)  # 6. drafts for the next step's decodes
        except RankFailed:
            raise
        except Exception as error:
            return outputs + self._fail_step(None, error)
        return outputs

    def _admit_restored(self) -> None:
        """Hand the scheduler the held requests whose disk reads are done; wait a little for one only when
        nothing else would run (a read never stalls other requests' steps)."""
        self._disk.save_new_blocks()  # blocks a failed step registered: intact until this step allocates
        idle = not self.scheduler.has_unfinished_requests
        for request in self._disk.ready(wait_s=0.05 if idle else 0.0):
            self.scheduler.add_request(request)

    def close(self) -> None:
        """Write the disk tier's queued blocks and stop its threads (nothing to do without one)."""
        self._disk.save_new_blocks()
        self._disk.close()

    @property
    def spec(self):
        """The runner's SpecDecoder (spec_decode/), None when the engine does not speculate."""
        return self.runner.spec

    # ---- step-failure isolation: an exception in a step ends that step's requests, not the engine ----

    def _fail_step(self, plan: SchedulerOutput | None, error: Exception) -> list[StepOutput]:
        """A step raised and no single request can be blamed: end every request of the step (every
        request, when planning itself failed), then check the pool; a broken pool raises (engine dead)."""
        logger.exception("engine step failed; ending the requests it carried")
        requests = [c.request for c in plan.chunks] if plan else [*self.scheduler.running, *self.scheduler.waiting]
        outputs = []
        for r in dict.fromkeys(requests):
            if self.has_request(r.group_id):  # not already ended with another choice of its request
                outputs.append(self._fail(r, error))
        self.kv.pool.check_integrity()
        return [out for out in outputs if out is not None]

    def _fail(self, request: Request, error: Exception) -> StepOutput | None:
        """End a request (every choice) with an error: aborted, blocks freed; half-written last blocks are
        not cached."""
        for seq_id in self._groups[request.group_id].live:
            seq = self._states[seq_id][0] if seq_id in self._states else request
            seq.num_computed_tokens -= seq.num_computed_tokens % self.kv.block_size
        out = self.abort_request(request.group_id)
        if out is not None:
            out.error = f"{type(error).__name__}: {error}"
        return out

    def _update(self, plan: SchedulerOutput, tokens: StepResult, step_s: float) -> list[StepOutput]:
        plan.account(step_s)
        for c in plan.chunks:  # speculation's counts: drafted, accepted (before the scheduler forgets the drafts)
            rid = c.request.request_id
            if c.spec_token_ids and rid in tokens.sampled_token_ids:
                k = len(c.spec_token_ids)
                self.spec.observe(c.request, k, k - tokens.num_rejected_tokens.get(rid, 0))
        now = time.perf_counter()
        self._add_prompt_logprobs(tokens)
        outputs = []
        for request in self.scheduler.update(plan, tokens) + self._fork(tokens):
            timings = request.timings
            timings.first_token_s = timings.first_token_s or now
            timings.last_token_s = now
            state = self._states[request.request_id][1]
            out = state.update(request, tokens.logprobs.get(request.request_id))
            out.finished = False  # a choice's end; the request's is _finalize's to say
            if state.stop_hit:
                self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED)
            self._fill_metrics(request, state.choice)
            outputs.append(self._finalize(request, state, out) if request.is_finished else out)
        return outputs

    def _add_prompt_logprobs(self, tokens: StepResult) -> None:
        for seq_id, logprobs in tokens.prompt_logprobs.items():
            entry = self._states.get(seq_id)
            if entry is not None:
                self._groups[entry[0].group_id].output.prompt_logprobs.extend(logprobs)
                entry[0].num_prompt_logprobs += len(logprobs)

    def _fork(self, tokens: StepResult) -> list[Request]:
        """The other choices of requests whose prompt just finished: each drew its first token from the
        prompt's logits (the sampler) and now shares the prompt's blocks (Scheduler.fork)."""
        children = []
        for parent_id, child_ids in tokens.forks.items():
            entry = self._states.get(parent_id)
            if entry is None:  # the request ended in this step
                continue
            parent = entry[0]
            parent.fork_ids = ()
            group = self._groups[parent.group_id]
            for index, child_id in enumerate(child_ids, start=parent.index + 1):
                child = Request(child_id, list(parent.prompt_token_ids), parent.params, parent.max_tokens,
                                parent.eos_token_ids, parent.arrival_s, cache_salt=parent.cache_salt,
                                client_id=parent.client_id, group_id=parent.group_id, index=index)  # fmt: skip
                child.timings.first_scheduled_s = parent.timings.first_scheduled_s
                group.live.add(child_id)
                self._states[child_id] = (child, OutputState(child, self.tokenizer, group.output, group.choice(index)))
                status = child.append_token(tokens.sampled_token_ids[child_id][0])
                if status is not None:  # ended at its first token: it never needs a block
                    child.status = status
                elif self.scheduler.fork(parent, child):
                    child.num_cached_tokens = child.num_prompt_tokens
                children.append(child)
        return children

    def _fill_metrics(self, request: Request, output: RequestOutput) -> None:
        t, m = request.timings, output.metrics
        m.prompt_tokens, m.cached_prompt_tokens = request.num_prompt_tokens, request.num_cached_tokens
        m.generated_tokens = request.num_output_tokens
        if t.first_scheduled_s is not None:
            m.queue_s = t.first_scheduled_s - t.arrival_s
        if t.first_token_s is not None:
            m.ttft_s = t.first_token_s - t.arrival_s
            m.prefill_s = t.first_token_s - (t.first_scheduled_s or t.arrival_s)
            m.decode_s = t.last_token_s - t.first_token_s
        m.prefill_compute_s, m.prefill_chunks = t.prefill_compute_s, t.prefill_chunks
        m.prefill_shared_steps, m.decode_steps = t.prefill_shared_steps, t.decode_steps
        m.mean_decode_batch = t.decode_batch_sum / t.decode_steps if t.decode_steps else 0.0
        m.num_preemptions = request.num_preemptions
        m.cached_prompt_tokens_disk = self._disk.disk_tokens(request)
        if self.spec is not None:
            m.spec_decoding = self.spec.report(request.spec_stats or SpecDecodingStats()).to_dict()
        held = request.num_computed_tokens if self.config.use_cache else 0
        layout, bs, per_block = self.pool_plan.layout, self.kv.block_size, self.pool_plan.bytes_per_block
        m.kv_blocks = layout.blocks_for_sequence(held, bs)  # sliding groups: only the window's blocks
        m.kv_cache_bytes = layout.slots_for_sequence(held, bs) * (per_block // bs)
        m.kv_cache_allocated_bytes = m.kv_blocks * per_block

    def _finalize(self, request: Request, state: OutputState, out: StepOutput) -> StepOutput:
        """A sequence has ended: close its choice, forget its sampler and state, count it; the request
        has ended (`out.finished`) with its last choice."""
        output = state.choice
        output.finish_reason = "stop" if state.stop_hit else request.finish_reason
        self._fill_metrics(request, output)
        output.metrics.peak_memory_bytes = peak_memory_bytes(self.cache.device)
        self.runner.release(request.request_id)
        self._disk.forget(request)
        if self.spec is not None:
            self.spec.release(request.request_id)
        del self._states[request.request_id]
        out.choice_finished = True
        out.finished = self._groups[request.group_id].finish(request.request_id)
        if out.finished:
            del self._groups[request.group_id]
        self.stats.record_finished(output.finish_reason, output.metrics)
        return out

    # ---- accounting -----------------------------------------------------------------------------------

    def ledger(self) -> KVLedger:
        """The KV ledger (call between steps): blocks per request, shared ones once, equal to the pool's count."""
        return self.kv.ledger()
