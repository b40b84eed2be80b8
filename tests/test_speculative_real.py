"""Real models: greedy speculative decoding gives plain decoding's tokens on qwen2.5-coder-1.5b, with its
0.5b sibling as the draft and with prompt lookup, on raw and chat prompts (the quantized weights, the
fused decode step and the kernels all in the path)."""

from __future__ import annotations

import pytest

from kvlab import LLM, SamplingParams

pytestmark = pytest.mark.real

RAW = ["def fibonacci(n):\n    ", "The capital of France is"]
CHATS = [
    [{"role": "user", "content": "Rename the function add to plus:\n\ndef add(a, b):\n    return a + b\n"}],
    [{"role": "user", "content": "Name three primary colors."}],
]
GREEDY = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def target(real_model):
    real_model("qwen2.5-coder-0.5b")
    real_model("qwen2.5-coder-1.5b")
    return LLM("qwen2.5-coder-1.5b", max_model_len=2048)


@pytest.fixture(scope="module")
def plain_answers(target):
    raw = [o.token_ids for o in target.generate(RAW, GREEDY)]
    chats = [target.chat(m, GREEDY).token_ids for m in CHATS]
    return raw, chats


@pytest.mark.parametrize(
    "config",
    [{"method": "ngram", "num_speculative_tokens": 4},
     {"method": "draft_model", "model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 3}],
    ids=["ngram", "draft_model"],
)  # fmt: skip
def test_greedy_speculation_is_token_for_token_plain_decoding(target, plain_answers, config):
    from kvlab.engine import LLMEngine

    raw, chats = plain_answers
    engine = LLMEngine(target.loaded, target.tokenizer, target.engine.config.__class__(
        max_model_len=2048, speculative_config=config), policy=target.policy)  # fmt: skip
    plain_engine, target.engine = target.engine, engine
    try:
        assert [o.token_ids for o in target.generate(RAW, GREEDY)] == raw
        assert [target.chat(m, GREEDY).token_ids for m in CHATS] == chats
        s = engine.spec.stats
        assert s.num_drafts > 0 and s.num_accepted_tokens > 0
    finally:
        target.engine = plain_engine
