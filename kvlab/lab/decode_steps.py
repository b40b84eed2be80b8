"""The serving engine's decode steps, timed (the batching experiment's part 1; the moe experiment's too).

An engine as `kvlab serve` builds one (LLMEngine over its paged cache, the decode backend where the model
takes it) starts B requests untimed, then runs of consecutive engine steps in which each of the B
sequences gains one token. Every timed step is checked to be exactly B one-token decode rows, which path
ran it is counted, and each step's reads (the weights it streams, every sequence's K/V) and
multiply-adds (B × the matrices' of one token) are kept beside its time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.lab.common import Lab, Timing

DECODE_STEPS, QUICK_DECODE_STEPS = 8, 2  # consecutive engine steps per timed run


@dataclass
class DecodeStepPoint:
    sequences: int  # B: sequences in the step, one new token each
    step: Timing  # seconds per engine step (each run: `steps_per_run` consecutive steps, ÷ that)
    tok_s: float  # B ÷ the median step
    ms_per_token: float
    relative_cost: float  # the median step ÷ the 1-sequence step's
    steps_per_run: int
    timed_steps: int  # steps the runs took, warm-up included
    backend_steps: int  # of those, steps the decode backend ran (the rest: the modules)
    pure_decode: bool  # every one was exactly B one-token decode rows, no prompt chunk among them
    read_bytes: int = 0  # a step's reads: the weights one decode step streams, and every sequence's K/V
    read_gb_s: float = 0.0  # read_bytes ÷ the median step, 1e9 bytes a second (0: not known)
    gmac_s: float = 0.0  # B × the matrices' multiply-adds per token ÷ the median step, in 1e9 a second



def decode_engine(lab: Lab, max_batch: int, context: int):
    """A serving engine as `kvlab serve` builds one (LLMEngine, paged cache, the decode backend), with
    room for `max_batch` sequences of `context` prompt tokens plus every timed step."""
    from kvlab.config import EngineConfig
    from kvlab.engine import LLMEngine
    from kvlab.kernels import ThreadPolicy

    longest = context + _max_new_tokens(lab) + 16
    per_token = kv_bytes_per_token(lab)
    config = EngineConfig(max_model_len=max(longest, 32), kv_memory_bytes=per_token * (longest + 32) * max_batch,
                          enable_prefix_caching=False, max_num_seqs=max_batch, max_num_batched_tokens=512)  # fmt: skip
    return LLMEngine(lab.loaded, None, config, policy=ThreadPolicy(threads=torch.get_num_threads()))


def kv_bytes_per_token(lab: Lab) -> int:
    """K and V bytes of one token over every layer in decode_engine's cache (the model's dtype)."""
    from kvlab.kv.paged import PagedKVCache

    return PagedKVCache.bytes_per_token_for(lab.config, lab.model.dtype)


def _max_new_tokens(lab: Lab) -> int:
    steps = QUICK_DECODE_STEPS if lab.quick else DECODE_STEPS
    # every timed run and the warm-up, and what the first prompts decode while later ones are prefilled
    return steps * (lab.repeat + 1) + 64


def time_decode_steps(lab: Lab, engine, batch: int, context: int, one_s: float | None = None) -> DecodeStepPoint:
    """B requests prefilled (and their first tokens sampled) untimed; then runs of consecutive engine
    steps, each one token for every sequence: seconds per step. `one_s`: the 1-sequence step's median."""
    from kvlab.sampling import SamplingParams

    steps = QUICK_DECODE_STEPS if lab.quick else DECODE_STEPS
    params = SamplingParams(max_tokens=_max_new_tokens(lab), temperature=0, ignore_eos=True)
    prompts = lab.prompt(context, batch=batch, seed=batch).tolist()
    ids = [engine.add_request(p, params) for p in prompts]
    started: set[str] = set()
    while len(started) < batch:  # until every prompt is in and has its first token
        outputs = engine.step()
        failed = [o for o in outputs if getattr(o, "error", None)]
        if failed or not engine.has_unfinished_requests:
            why = failed[0].error if failed else "none left"
            raise RuntimeError(f"the engine could not start {batch} sequences: {why}")
        started |= {o.request_id for o in outputs if o.output.token_ids}
    seen = {"steps": 0, "backend": 0, "pure": True}
    driver, scheduler = engine.runner.driver, engine.scheduler
    fused_step, schedule = driver._fused_step, scheduler.schedule

    def counted_fused_step(*args, **kwargs):  # which path ran the step (the driver asks once a pass)
        backend = fused_step(*args, **kwargs)
        seen["backend"] += backend is not None
        return backend

    def checked_schedule():  # each timed step: exactly B one-token decode rows
        plan = schedule()
        seen["steps"] += 1
        seen["pure"] &= len(plan.chunks) == batch and all(c.is_decode for c in plan.chunks)
        return plan

    def run():
        for _ in range(steps):
            engine.step()

    def cached_tokens() -> int:  # K/V rows the running sequences' next step reads
        return sum(r.num_tokens for r in scheduler.running)

    driver._fused_step, scheduler.schedule = counted_fused_step, checked_schedule
    try:
        before = cached_tokens()
        timing = lab.measure(run)
        tokens = (before + cached_tokens()) / 2  # the runs' middle: the average step's keys
    finally:
        driver._fused_step, scheduler.schedule = fused_step, schedule
        for rid in ids:
            if engine.has_request(rid):
                engine.abort_request(rid)
    read = lab.loaded.decode_weight_bytes() + int(tokens * kv_bytes_per_token(lab))
    macs = batch * sum(lab.model.matmul_macs_per_token())  # the matrices' multiply-adds of B tokens
    return decode_step_point(batch, Timing.of([s / steps for s in timing.samples_s]), steps, seen["steps"],
                             seen["backend"], seen["pure"], one_s, read, macs)  # fmt: skip


def decode_step_point(batch: int, step: Timing, steps_per_run: int, timed: int, backend: int, pure: bool,
                      one_s: float | None = None, read_bytes: int = 0, macs: int = 0) -> DecodeStepPoint:
    """A point from its step timing; `one_s`: the 1-sequence step's median (None: this is that step);
    `read_bytes` and `macs`: what one step reads and multiplies (0: not known)."""
    one = step.median_s if one_s is None else one_s
    return DecodeStepPoint(batch, step, batch / step.median_s, step.median_s * 1e3 / batch, step.median_s / one,
                           steps_per_run, timed, backend, pure, read_bytes, read_bytes / step.median_s / 1e9,
                           macs / step.median_s / 1e9)  # fmt: skip

