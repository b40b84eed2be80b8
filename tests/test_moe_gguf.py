"""Mixture-of-experts models from GGUF: the tiny random checkpoints of test_moe.py written with the `gguf`
package's writer under llama.cpp's names (ffn_gate_inp, ffn_{gate,up,down}_exps, *_shexp, attn_sinks, ...).

F32 files give transformers' greedy tokens exactly; files whose experts are Q8_0 or MXFP4 blocks keep them
packed (the bytes held are the file's) and compute what their dequantized floats compute.
"""

from __future__ import annotations

import pytest
import torch
from test_paged import run_all
from test_real import reference_greedy
from tiny import add_tiny_tokenizer
from tiny_moe import MOE_ARCHS, build_tiny_moe, build_tiny_moe_gguf

from kvlab.config import EngineConfig, MoE
from kvlab.engine import LLMEngine
from kvlab.kv.cache import ContiguousKVCache
from kvlab.memory import weight_bytes
from kvlab.model.loader import load_model
from kvlab.runner.driver import ModelDriver
from kvlab.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=MOE_ARCHS)
def folder(request, tmp_path_factory):
    # llama.cpp's YaRN always rounds its ramp's ends: a gpt-oss compared with its GGUF says so in its config
    directory = build_tiny_moe(request.param, tmp_path_factory.mktemp(request.param), yarn_truncate=True)
    return request.param, add_tiny_tokenizer(directory)


def prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=g).tolist()


def serve(loaded, batch):
    engine = LLMEngine(loaded, None, EngineConfig(block_size=4, kv_memory_bytes=1 << 21, max_num_batched_tokens=16))
    return run_all(engine, batch, GREEDY)


def test_an_f32_gguf_gives_transformers_greedy_tokens(folder, tmp_path):
    import transformers

    kind, directory = folder
    loaded = load_model(build_tiny_moe_gguf(directory, tmp_path / f"{kind}.gguf"))
    assert [type(layer.mlp) is MoE for layer in loaded.config.layers] == \
        [type(layer.mlp) is MoE for layer in load_model(directory).config.layers]  # fmt: skip
    ref = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    batch = [prompt(n, seed=n) for n in (4, 19, 30)]
    assert serve(loaded, batch) == [reference_greedy(ref, p, 16) for p in batch], kind
    assert loaded.weight_bytes == loaded.config.file_weights.tensor_bytes == weight_bytes(loaded.config).bytes


@pytest.mark.parametrize("experts_type", ["Q8_0", "MXFP4"])
def test_experts_in_blocks_stay_packed_and_compute_what_their_floats_compute(folder, tmp_path, experts_type):
    kind, directory = folder
    path = build_tiny_moe_gguf(directory, tmp_path / f"{kind}.gguf", experts_type=experts_type)
    packed, floats = load_model(path), load_model(path, dequantize=True)
    assert experts_type in packed.weight_format
    experts = packed.model.layers[0].mlp.experts
    assert experts.formats == {"gate_up": [experts_type] * 2, "down": [experts_type]}
    assert packed.weight_bytes == packed.config.file_weights.tensor_bytes < floats.weight_bytes
    ids = torch.tensor([prompt(24)])
    with torch.inference_mode():
        a = ModelDriver(packed.model).run(ids, ContiguousKVCache.for_model(packed.config, 64))
        b = ModelDriver(floats.model).run(ids, ContiguousKVCache.for_model(floats.config, 64))
    assert (a - b).abs().max().item() < 1e-4
    batch = [prompt(n, seed=n) for n in (5, 21)]
    assert serve(packed, batch) == serve(floats, batch)


def test_openais_mxfp4_experts_load_packed_and_give_transformers_tokens_on_their_values(tmp_path):
    """gpt-oss as OpenAI ships it: experts as MXFP4 blocks and scales in safetensors. They stay blocks (the
    bytes held are the file's), and the tokens are transformers' on the floats those blocks hold."""
    import transformers
    from tiny_moe import gpt_oss_as_mxfp4

    directory = add_tiny_tokenizer(build_tiny_moe("gpt_oss", tmp_path / "hf"))
    mx_dir, float_dir = gpt_oss_as_mxfp4(directory, tmp_path / "mxfp4", tmp_path / "floats")
    packed = load_model(mx_dir)
    assert packed.model.layers[0].mlp.experts.formats == {"gate_up": ["MXFP4"], "down": ["MXFP4"]}
    estimate = weight_bytes(packed.config)
    assert estimate.exact and packed.weight_bytes == estimate.bytes
    ref = transformers.AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32).eval()
    batch = [prompt(n, seed=n) for n in (6, 27)]
    assert serve(packed, batch) == [reference_greedy(ref, p, 16) for p in batch]
