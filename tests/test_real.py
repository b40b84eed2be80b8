"""Real models pulled from PyPI: 64 greedy tokens identical to transformers on the same GGUF."""

from __future__ import annotations

import pytest
import torch

from kvlab import LLM, SamplingParams

pytestmark = pytest.mark.real

RAW_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three primary colors."},
    ],
]
GREEDY_64 = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=["smollm2-135m", "qwen2.5-coder-0.5b"])
def models(request, real_model, transformers_reference):
    path = real_model(request.param)
    ours = LLM(request.param)
    return request.param, ours, transformers_reference(path)  # the Oracle: transformers' model, built when needed


def reference_greedy(ref, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = ref.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=n,
            do_sample=False, eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("prompt", RAW_PROMPTS)
def test_raw_prompt_64_greedy_tokens_match_transformers(models, prompt):
    name, ours, oracle = models
    out = ours.generate(prompt, GREEDY_64)
    assert out.token_ids == oracle.greedy(out.prompt_token_ids, 64), name


@pytest.mark.parametrize("messages", CHATS, ids=["user", "system+user"])
def test_chat_prompt_64_greedy_tokens_match_transformers(models, messages):
    name, ours, oracle = models
    out = ours.chat(messages, GREEDY_64)
    assert out.token_ids == oracle.greedy(out.prompt_token_ids, 64), name


def test_answers_paris(models):
    name, ours, _ = models
    out = ours.chat(CHATS[0], SamplingParams(max_tokens=32, temperature=0))
    assert "Paris" in out.text, (name, out.text)
    assert out.finish_reason == "stop"  # the model ends its turn with its own end-of-turn token


SIXTEEN = [f"{opening} {n}" for n in range(4) for opening in ("Count to", "The year", "def f(x): return x *", "Item number")]


@pytest.mark.parametrize("activation_quant", [None, "int8"])
def test_sixteen_requests_together_give_each_ones_tokens_alone(models, activation_quant):
    """A batch of 16 decodes on packed weights (quant.c's tiles, or the int8 kernels) gives every request
    exactly the tokens it gets alone: a row's products do not depend on its company.

    The int8 engine prefills each prompt in a pass of its own, without prefix caching: a prompt packed
    with others, or prefilled over cached blocks, gets logits that differ from its lone prefill in the
    last bits (attention over another shape: 1e-7 measured on the exact path), and rounding activations
    to 8 bits turns such a difference into a visible one (1e-3), which can flip a near tie. What is
    compared here is the batched decode step alone, whose rows are bit-independent."""
    name, ours, _ = models
    llm = ours if activation_quant is None else LLM(name, activation_quant=activation_quant,
                                                    enable_prefix_caching=False, pack_prompts=False)  # fmt: skip
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in SIXTEEN]
    together = [o.outputs[0].token_ids for o in llm.generate(SIXTEEN, params)]
    assert together == alone
