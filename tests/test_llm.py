"""The Python API: generate, stream, chat sessions, stop conditions and the metrics of each answer."""

from __future__ import annotations

import pytest

from kvlab import LLM, SamplingParams
from kvlab.errors import KvlabError

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def test_generate_one_and_many_in_order(tiny_llm):
    prompts = ["The capital of France is", "def f(x):", "Héllo"]
    single = [tiny_llm.generate(p, GREEDY) for p in prompts]
    batch = tiny_llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in batch] == [o.token_ids for o in single]
    assert [o.prompt for o in batch] == prompts
    assert all(len(o.token_ids) == 24 and o.finish_reason == "length" for o in batch)


def test_text_is_the_decoded_tokens(tiny_llm):
    out = tiny_llm.generate("The capital", GREEDY)
    assert out.text == tiny_llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_stream_pieces_join_to_the_text(tiny_llm):
    stream = tiny_llm.stream("The capital of", GREEDY)
    pieces = list(stream)
    assert "".join(pieces) == stream.output.text
    assert stream.output.token_ids == tiny_llm.generate("The capital of", GREEDY).token_ids


def test_token_prompts_work_without_text(tiny_llm):
    ids = tiny_llm.encode("The capital")
    a = tiny_llm.generate({"prompt_token_ids": ids}, GREEDY)
    assert a.token_ids == tiny_llm.generate("The capital", GREEDY).token_ids
    assert a.prompt is None and a.prompt_token_ids == ids


def test_stop_string_ends_the_text_before_it(tiny_llm):
    full = tiny_llm.generate("The capital of France is", GREEDY).text
    stop = full[5:8]
    assert stop and stop in full
    out = tiny_llm.generate("The capital of France is", SamplingParams(max_tokens=24, temperature=0, stop=[stop]))
    assert out.finish_reason == "stop"
    assert out.text == full[: full.index(stop)]
    assert stop not in out.text


def test_eos_stops_unless_ignored(tiny_llm):
    ids = tiny_llm.generate("Paris", GREEDY).token_ids
    eos_before = tiny_llm.engine.eos_token_ids
    tiny_llm.engine.eos_token_ids = (ids[3],)  # pretend the 4th token is end-of-sequence
    try:
        out = tiny_llm.generate("Paris", SamplingParams(max_tokens=24, temperature=0))
        assert out.finish_reason == "stop" and out.token_ids == ids[: ids.index(ids[3]) + 1]
        assert tiny_llm.generate("Paris", GREEDY).token_ids == ids
    finally:
        tiny_llm.engine.eos_token_ids = eos_before


def test_the_engine_knows_the_tokenizers_eos_ids_too(tiny_llm):
    """LLMEngine itself (not only LLM) ends requests at the tokenizer's end-of-turn tokens."""
    from kvlab.engine import LLMEngine

    engine = LLMEngine(tiny_llm.loaded, tiny_llm.tokenizer)
    assert set(engine.eos_token_ids) == set(tiny_llm.config.eos_token_ids) | set(tiny_llm.tokenizer.eos_token_ids)
    assert tiny_llm.tokenizer.eos_token_ids


def test_seed_reproduces_sampling(tiny_llm):
    p = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=42, ignore_eos=True)
    a, b = tiny_llm.generate("x", p), tiny_llm.generate("x", p)
    c = tiny_llm.generate("x", SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=43, ignore_eos=True))
    assert a.token_ids == b.token_ids and a.text == b.text
    assert a.token_ids != c.token_ids


def test_metrics_describe_the_request(tiny_llm):
    out = tiny_llm.generate("The capital of France is", GREEDY)
    m = out.metrics
    assert m.prompt_tokens == len(out.prompt_token_ids) and m.generated_tokens == 24
    assert m.ttft_s > 0 and m.decode_s > 0 and m.prefill_tok_s > 0 and m.decode_tok_s > 0
    c = tiny_llm.config
    per_token = c.num_layers * 2 * c.num_kv_heads * c.head_dim * 4
    assert m.kv_cache_bytes == per_token * (m.prompt_tokens + 23)  # the last token is never fed back
    assert m.kv_cache_allocated_bytes >= m.kv_cache_bytes
    assert m.peak_memory_bytes > 0
    d = out.to_dict()
    for key in ("text", "token_ids", "prompt_tokens", "generated_tokens", "ttft_s", "prefill_tok_s",
                "decode_tok_s", "kv_cache_bytes"):  # fmt: skip
        assert key in d


def test_chat_session_prefills_only_new_tokens(tiny_chat_model):
    # a fresh engine (an empty prefix cache): the shared fixture's cache holds other tests' prompts
    llm = LLM(tiny_chat_model)
    session = llm.new_session()
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    messages = [{"role": "user", "content": "hi there"}]
    first = llm.chat_stream(messages, params, session=session).finish()
    assert first.metrics.cached_prompt_tokens == 0
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "and now?"}]
    second = llm.chat_stream(messages, params, session=session).finish()
    assert second.metrics.cached_prompt_tokens >= len(first.prompt_token_ids)
    assert second.metrics.prefill_tokens == second.metrics.prompt_tokens - second.metrics.cached_prompt_tokens
    # turns reuse K/V through the prefix cache: without it, everything is prefilled, to the same tokens
    fresh = LLM(tiny_chat_model, enable_prefix_caching=False).chat(messages, params)
    assert fresh.token_ids == second.token_ids
    assert fresh.metrics.cached_prompt_tokens == 0


def test_no_cache_mode_gives_the_same_tokens(tiny_chat_model, tiny_llm):
    uncached = LLM(tiny_chat_model, use_cache=False)
    p = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert uncached.generate("The capital", p).token_ids == tiny_llm.generate("The capital", p).token_ids
    assert uncached.generate("x", p).metrics.kv_cache_bytes == 0


def test_prompt_longer_than_the_context_is_refused(tiny_llm):
    with pytest.raises(KvlabError, match="context"):
        tiny_llm.generate({"prompt_token_ids": [5] * 600}, GREEDY)


def test_generation_stops_at_the_context_end(tiny_chat_model):
    llm = LLM(tiny_chat_model, max_model_len=20)
    out = llm.generate({"prompt_token_ids": [5] * 15}, SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_chat_needs_string_contents(tiny_llm):
    with pytest.raises(KvlabError):
        tiny_llm.chat([{"role": "user"}])


def test_seats_default_to_vllms_cpu_server_and_the_flag_overrides(tiny_chat_model, tiny_llm):
    from kvlab.config.engine import DEFAULT_MAX_NUM_SEQS

    assert DEFAULT_MAX_NUM_SEQS == 128  # vLLM's CPU server's max_num_seqs
    engine = tiny_llm.engine
    assert engine.pool_plan.max_num_seqs == 128 and engine.pool_plan.num_state_slots == 0  # no recurrent layer
    # float matrices: past the kernels' rows a decode step goes to BLAS, whose numbers are the batch's
    assert engine.decode_path.name == "cpu-c" and engine.runner.driver.policy.max_kernel_rows == 32
    assert engine.scheduler.config.max_num_seqs == 32
    few = LLM(tiny_chat_model, max_num_seqs=3)
    assert few.engine.scheduler.config.max_num_seqs == 3
    outs = few.generate([{"prompt_token_ids": [5 + i, 6, 7]} for i in range(5)], SamplingParams(max_tokens=4))
    assert all(len(o.token_ids) == 4 for o in outs)  # five requests through three seats
    assert max(o.metrics.mean_decode_batch for o in outs) <= 3
    many = LLM(tiny_chat_model, max_num_seqs=100)  # given: taken as it is
    assert many.engine.scheduler.config.max_num_seqs == 100
    with pytest.raises(KvlabError, match="max_num_seqs .* at least 1, got 0"):
        LLM(tiny_chat_model, max_num_seqs=0)
