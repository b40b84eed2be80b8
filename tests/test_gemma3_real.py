"""The real gemma3-270m (Q4_K_M GGUF, its own blocks): greedy tokens identical to transformers on the same
file, a prompt longer than its 512-token window included; its tokenizer; the bytes its engine holds
against `kvlab mem`; a base model's missing chat template."""

from __future__ import annotations

import subprocess
import sys

import pytest
from kvlab import LLM, SamplingParams
from kvlab.config import load_config
from kvlab.memory import kv_bytes

pytestmark = pytest.mark.real

# the last is about 900 tokens: its window slides, and a 512-token budget (`ours`) chunks its prefill
LONG = " ".join(f"Note {i}: the river passes the mill, and the baker on {i % 7} Elm Street sells rye bread."
               for i in range(40))  # fmt: skip
RAW_PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village,",
               LONG + "\nThe baker on Elm Street sells"]  # fmt: skip
GREEDY_64 = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def path(real_model):
    return real_model("gemma3-270m")


@pytest.fixture(scope="module")
def ours(path):
    return LLM("gemma3-270m", max_num_batched_tokens=512)


@pytest.fixture(scope="module")
def oracle(path, transformers_reference):
    return transformers_reference(path)


@pytest.mark.parametrize("prompt", RAW_PROMPTS, ids=["france", "code", "story", "long"])
def test_raw_prompt_64_greedy_tokens_match_transformers(ours, oracle, prompt):
    out = ours.generate(prompt, GREEDY_64)
    assert out.prompt_token_ids == oracle.tokenizer(prompt).input_ids  # the same SentencePiece tokens, BOS first
    assert out.token_ids == oracle.greedy(out.prompt_token_ids, 64)
    if prompt is RAW_PROMPTS[-1]:
        assert len(out.prompt_token_ids) > 512 and out.metrics.prefill_chunks > 1  # the window slid, chunked


def test_completes_the_capital_of_france(ours):
    out = ours.generate("The capital of France is", SamplingParams(max_tokens=9, temperature=0))
    assert out.text.startswith(" the capital of the country of France")


def test_the_engine_holds_what_kvlab_mem_counts(ours, path):
    """A 2,000-token prompt prefilled: the blocks its request holds are the calculator's bytes exactly."""
    config = load_config(path)
    engine = ours.engine
    ids = [2] + [(17 * i) % 50_000 + 1_000 for i in range(1_999)]
    rid = engine.add_request(ids, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    while engine.scheduler.running or engine.scheduler.waiting:
        engine.step()
        request = next((r for r in engine.scheduler.running if r.request_id == rid), None)
        if request is not None and request.num_computed_tokens == len(ids):
            break
    held = engine.ledger().requests[rid]
    assert held.blocks * engine.pool_plan.bytes_per_block == kv_bytes(config, 2_000, kv_dtype="float32")
    engine.abort_request(rid)
    assert engine.kv.pool.check_integrity().used == 0


def test_chat_without_a_template_is_refused_and_raw_completion_works():
    def run(prompt: str, *flags: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "kvlab.cli", "run", "gemma3-270m", prompt, "--max-tokens", "3",
                   "--temperature", "0", *flags]  # fmt: skip
        return subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)

    chat = run("Hello", "--chat")
    assert chat.returncode == 2 and "no chat template" in chat.stderr and "Traceback" not in chat.stderr
    raw = run("The capital of France is")
    assert raw.returncode == 0 and raw.stdout.startswith(" the capital")
