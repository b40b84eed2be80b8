"""A tiny DeepSeek-V3 written as a deepseek2 GGUF the way llama.cpp's converter writes it (one KV head of
kv_lora_rank + rope numbers, the MLA sizes apart, kv_b whole or split into k_b / v_b, the experts stacked, the
routing keys, the YaRN log multiplier): the same layers and the same greedy tokens as transformers."""

from __future__ import annotations

import pytest
import torch
from test_paged import run_all
from test_real import reference_greedy
from tiny import add_tiny_tokenizer
from tiny_deepseek import build_tiny_deepseek, build_tiny_deepseek_gguf

from kvlab.config import EngineConfig, load_config
from kvlab.engine import LLMEngine
from kvlab.model.loader import load_model
from kvlab.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest


@pytest.fixture(scope="module", params=[("q_lora", True), ("no_q_lora", False), ("grouped", True)],
                ids=["q_lora-split_kv_b", "no_q_lora-kv_b", "grouped-split_kv_b"])  # fmt: skip
def files(request, tmp_path_factory):
    """(kind, folder, GGUF file, transformers' model) of one tiny random DeepSeek-V3."""
    import transformers

    kind, split = request.param
    directory = build_tiny_deepseek(kind, tmp_path_factory.mktemp(kind))
    add_tiny_tokenizer(directory)
    gguf = build_tiny_deepseek_gguf(directory, directory / "model.gguf", split_kv_b=split)
    ref = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return kind, directory, gguf, ref


def test_the_gguf_describes_the_same_layers(files):
    _, directory, gguf, _ = files
    hf, ours = load_config(directory), load_config(gguf)
    assert ours.architecture == "deepseek2" and ours.layers == hf.layers
    assert (ours.rope.type, ours.rope.factor) == (hf.rope.type, hf.rope.factor)


def test_greedy_tokens_from_the_gguf_match_transformers(files):
    kind, _, gguf, ref = files
    loaded = load_model(gguf)
    batch = [torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (7, 26)]
    engine = LLMEngine(loaded, None, EngineConfig(block_size=4, kv_memory_bytes=1 << 20, max_num_batched_tokens=16))
    greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    assert run_all(engine, batch, greedy) == [reference_greedy(ref, p, 32) for p in batch], kind
