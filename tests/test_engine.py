"""The serving engine through the offline API: batches, timing splits, the KV ledger, aborts, prefix hits."""

from __future__ import annotations

import pytest

from kvlab import LLM, SamplingParams
from kvlab.output.result import RequestMetrics

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest


@pytest.fixture
def llm(tiny_chat_model):
    return LLM(tiny_chat_model)  # an empty prefix cache for every test


def ids(n: int, first: int = 10) -> dict:
    return {"prompt_token_ids": [first + i % 400 for i in range(n)]}


def assert_empty(llm: LLM) -> None:
    counts = llm.engine.kv.pool.check_integrity()
    assert counts.used == 0 and llm.engine.ledger().held_blocks == 0 and not llm.engine.has_unfinished_requests


def test_generate_returns_each_output_in_input_order_with_its_own_timing_split(llm):
    prompts = ["The capital of France is", "def f(x):", "Héllo wörld", "x"]
    outs = llm.generate(prompts, GREEDY)
    assert [o.prompt for o in outs] == prompts
    assert [o.token_ids for o in outs] == [llm.generate(p, GREEDY).token_ids for p in prompts]
    for o in outs:
        m = o.metrics
        assert m.generated_tokens == 12 and o.finish_reason == "length"
        assert 0 <= m.queue_s <= m.ttft_s and m.ttft_s == pytest.approx(m.queue_s + m.prefill_s)
        assert m.prefill_chunks == 1 and m.decode_steps == 11
        assert m.mean_decode_batch == 4  # every decode step carried all four requests
        assert m.prefill_shared_steps == 1  # the four prompts went through the model together
        assert m.kv_blocks == -(-(m.prompt_tokens + 11) // 16)
        split = m.timing_split()
        for key in ("queue_s", "prefill_compute_s", "prefill_chunks", "decode_s", "cached_prompt_tokens"):
            assert key in split
    assert_empty(llm)


def test_continuous_batching_admits_a_request_while_others_decode(llm):
    engine = llm.engine
    first = engine.add_request(ids(20)["prompt_token_ids"], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    for _ in range(3):
        engine.step()
    late = engine.add_request(ids(30, first=200)["prompt_token_ids"], GREEDY)
    plan_sizes = []
    finished = {}
    while engine.has_unfinished_requests:
        tokens_before = engine.stats.step_tokens
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.output.metrics
        plan_sizes.append(engine.stats.step_tokens - tokens_before)
    assert plan_sizes[0] == 1 + 30  # the first request's decode and the late prompt in one forward
    assert finished[late].prefill_shared_steps == 1 and finished[late].queue_s >= 0
    assert finished[first].decode_steps == 9 and finished[first].mean_decode_batch > 1
    assert_empty(llm)


def test_the_ledger_equals_the_allocator_at_every_step(tiny_chat_model):
    llm = LLM(tiny_chat_model, max_num_batched_tokens=24, max_num_seqs=3)
    engine = llm.engine
    shared = ids(40)["prompt_token_ids"]
    for i in range(5):  # a common 40-token prefix, then a different tail each
        engine.add_request(shared + [300 + i] * (i + 1), SamplingParams(max_tokens=6 + i, temperature=0, ignore_eos=True))
    seen_shared = False
    while engine.has_unfinished_requests:
        engine.step()
        ledger = engine.ledger()
        assert ledger.is_balanced and ledger.held_blocks == engine.kv.pool.check_integrity().used
        assert ledger.tokens + ledger.unused_slots == engine.kv.block_size * sum(r.blocks for r in ledger.requests.values())
        seen_shared |= any(r.shared_blocks for r in ledger.requests.values())
    assert seen_shared  # the prefix's blocks were held by several requests at once, counted once
    assert engine.kv.stats.hit_rate > 0
    assert_empty(llm)


def test_a_prefix_hit_prefills_only_the_uncached_tokens(llm):
    base = ids(40)["prompt_token_ids"]
    llm.generate({"prompt_token_ids": base}, GREEDY)
    before = llm.engine.stats.step_tokens
    out = llm.generate({"prompt_token_ids": base + [7] * 10}, GREEDY)
    assert out.metrics.cached_prompt_tokens == 40  # 2 whole blocks shared, 8 tokens copied from the third
    assert out.metrics.prefill_tokens == 10
    assert llm.engine.stats.step_tokens - before == 10 + 11  # the 10 new prompt tokens, then 11 decodes
    uncached = LLM(llm.loaded.path, enable_prefix_caching=False)
    assert out.token_ids == uncached.generate({"prompt_token_ids": out.prompt_token_ids}, GREEDY).token_ids
    stats = llm.engine.kv.stats
    assert (stats.queries, stats.hits) == (40 + 50, 40)
    assert_empty(llm)


def test_closing_a_stream_aborts_the_request_and_frees_its_blocks(llm):
    stream = llm.stream("The capital of France is", SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    pieces = iter(stream)
    next(pieces)
    assert llm.engine.kv.pool.num_used_blocks > 0
    pieces.close()
    assert stream.output.finish_reason == "abort"
    assert_empty(llm)
    assert llm.generate("x", GREEDY).generated_tokens == 12  # the engine carries on


def test_stop_strings_finish_the_request_in_the_engine(llm):
    full = llm.generate("The capital of France is", GREEDY).text
    stop = full[4:7]
    out = llm.generate("The capital of France is", SamplingParams(max_tokens=12, temperature=0, stop=[stop]))
    assert out.finish_reason == "stop" and out.text == full[: full.index(stop)]
    assert out.generated_tokens < 12
    assert_empty(llm)


def test_engine_stats_split_every_step(llm):
    llm.generate(["a b c", "d e f"], GREEDY)
    stats = llm.engine.stats
    assert stats.steps == 12 and stats.generation_tokens == 24
    assert set(stats.phase_seconds) == {"schedule", "prepare_inputs", "forward", "sample", "detokenize"}
    assert all(v > 0 for v in stats.phase_seconds.values())
    assert stats.ttft.count == 2 and stats.finished == {"length": 2}


def test_metrics_of_the_single_sequence_engine_keep_their_meaning():
    m = RequestMetrics(prompt_tokens=10, cached_prompt_tokens=4, generated_tokens=5, prefill_s=0.5, decode_s=1.0)
    assert m.prefill_tokens == 6 and m.decode_tok_s == 4.0 and m.tpot_s == 0.25


def test_the_engine_times_its_prompt_steps_apart_and_the_load_generator_reports_them(llm):
    from kvlab.bench.serve import Workload, run_in_process

    engine, stats = llm.engine, llm.engine.stats
    engine.add_request(ids(40)["prompt_token_ids"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    engine.step()  # the whole prompt in one step
    after_prompt = stats.prompt_step_seconds
    assert after_prompt > 0
    steps = stats.steps
    while engine.has_unfinished_requests:
        engine.step()
    assert stats.steps == steps + 5 and stats.prompt_step_seconds == after_prompt  # decode rows only: not counted

    result = run_in_process(engine, Workload(num_requests=4, concurrency=2, prompt_len=24, output_len=5, seed=3))
    s = result.summary()
    assert s["completed"] == 4 and 0 < s["prompt_step_s"] < s["duration_s"]
    assert s["prompt_step_s"] == pytest.approx(stats.prompt_step_seconds - after_prompt)
    assert "steps with prompt tokens" in result.table()
