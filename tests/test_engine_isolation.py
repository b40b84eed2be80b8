"""The engine's isolation: cache salts split the prefix cache, a failing step ends only its own requests.

Scheduler-level tests run without a model (each sampled token is 7, as in test_scheduler.py);
step-failure tests drive a tiny model's engine directly and make one phase of one step raise.
"""

from __future__ import annotations

import pytest

from kvlab import LLM, SamplingParams
from kvlab.kv.manager import KVCacheManager
from kvlab.request import Request
from kvlab.scheduler import Scheduler, SchedulerConfig, StepResult

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest


def scheduler(num_blocks: int = 32, block_size: int = 4) -> Scheduler:
    return Scheduler(SchedulerConfig(max_model_len=64), KVCacheManager(num_blocks, block_size))


def run(s: Scheduler, rid: str, prompt: list[int], salt: str | None = None, max_tokens: int = 2) -> Request:
    """Serve one request to its end; return it (its `num_cached_tokens` is the prefix hit it got)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    r = Request(rid, list(prompt), params, max_tokens=max_tokens, cache_salt=salt)
    s.add_request(r)
    while s.has_unfinished_requests:
        plan = s.schedule()
        s.update(plan, StepResult({c.request.request_id: [7] for c in plan.chunks if c.samples}))
    s.kv.pool.check_integrity()
    return r


PROMPT = list(range(100, 114))  # 3 whole blocks of 4 and 2 tokens


def test_blocks_are_shared_only_under_the_same_salt():
    s = scheduler()
    assert run(s, "a1", PROMPT, salt="tenant-a").num_cached_tokens == 0
    assert run(s, "b1", PROMPT, salt="tenant-b").num_cached_tokens == 0  # not even the copied partial run
    assert run(s, "plain", PROMPT).num_cached_tokens == 0  # unsalted is a namespace of its own
    assert run(s, "a2", PROMPT, salt="tenant-a").num_cached_tokens == len(PROMPT) - 1
    assert run(s, "b2", PROMPT, salt="tenant-b").num_cached_tokens == len(PROMPT) - 1
    assert s.kv.pool.check_integrity().used == 0


def test_identical_requests_leave_one_cached_tail_block():
    s = scheduler()
    run(s, "first", PROMPT)
    cached = s.kv.pool.check_integrity().cached
    for i in range(3):
        run(s, f"again-{i}", PROMPT)
        assert s.kv.pool.check_integrity().cached == cached  # same tokens, same tail: nothing new to keep
    run(s, "longer", PROMPT, max_tokens=3)  # a tail that goes further is worth one more block
    assert s.kv.pool.check_integrity().cached == cached + 1


# ---- a step that raises ------------------------------------------------------------------------------


@pytest.fixture
def llm(tiny_chat_model):
    return LLM(tiny_chat_model, max_model_len=128)


def drive(engine, max_steps: int = 500) -> dict:
    """Step until every request has ended; return each request's final StepOutput."""
    final = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests:
            break
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


def add(engine, rid: str, max_tokens: int = 6, **params) -> None:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **{"temperature": 0, **params})
    engine.add_request([10, 11, 12, 13, 14], params, request_id=rid)


def assert_idle(engine) -> None:
    assert not engine.has_unfinished_requests
    assert engine.kv.pool.check_integrity().used == 0 and engine.ledger().held_blocks == 0


def test_a_request_that_cannot_be_sampled_fails_alone(llm, monkeypatch):
    engine = llm.engine
    sample = engine.runner.sample

    def broken(requests, logits):
        if any(r.request_id == "bad" for r in requests):
            raise FloatingPointError("invalid distribution")
        return sample(requests, logits)

    monkeypatch.setattr(engine.runner, "sample", broken)
    add(engine, "good", temperature=0.7, seed=1)
    add(engine, "bad", temperature=0.7, seed=2)
    final = drive(engine)
    assert final["bad"].error == "FloatingPointError: invalid distribution"
    assert final["bad"].output.finish_reason == "abort" and final["bad"].output.token_ids == []
    assert final["good"].error is None and len(final["good"].output.token_ids) == 6
    assert_idle(engine)


def test_a_forward_that_raises_ends_that_steps_requests_and_the_engine_goes_on(llm, monkeypatch):
    engine = llm.engine
    forward, calls = engine.runner.forward, []

    def fails_on_the_third_call(inputs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("device lost")
        return forward(inputs)

    monkeypatch.setattr(engine.runner, "forward", fails_on_the_third_call)
    add(engine, "a")
    add(engine, "b")
    final = drive(engine)
    assert {rid: out.error for rid, out in final.items()} == dict.fromkeys("ab", "RuntimeError: device lost")
    assert all(len(out.output.token_ids) == 2 for out in final.values())  # two steps ran before the failure
    assert_idle(engine)
    add(engine, "after")
    assert drive(engine)["after"].error is None
    assert_idle(engine)


def test_a_plan_that_raises_ends_every_request_and_the_engine_goes_on(llm, monkeypatch):
    engine = llm.engine
    schedule = engine.scheduler.schedule
    monkeypatch.setattr(engine.scheduler, "schedule", lambda: (_ for _ in ()).throw(KeyError("lost block")))
    add(engine, "a")
    add(engine, "b")
    final = {out.request_id: out for out in engine.step()}
    assert set(final) == {"a", "b"} and all(out.finished and "KeyError" in out.error for out in final.values())
    assert_idle(engine)
    monkeypatch.setattr(engine.scheduler, "schedule", schedule)
    add(engine, "after")
    assert len(drive(engine)["after"].output.token_ids) == 6
    assert_idle(engine)
