"""Hybrid models from GGUF (`qwen35`, `qwen3next`), written as llama.cpp's converter writes them.

The tiny checkpoints of test_deltanet, converted by tests/tiny_hybrid.py's writer (the gguf package): norms
+ 1, A = −exp(A_log), conv taps [C, K], Qwen3-Next's in_proj_qkvz as attn_qkv + attn_gate and its ssm_ba
grouped, qwen35's value heads tiled by key head. Float32 files give transformers' greedy tokens; Q8_0 files
keep their blocks and give the tokens of the same file expanded to floats.
"""

from __future__ import annotations

import pytest
import torch
from test_real import reference_greedy
from tiny_hybrid import HYBRID_ARCHS, build_tiny_hybrid, build_tiny_hybrid_gguf

from kvlab.config import GatedDeltaNet, load_config
from kvlab.llm import LLM
from kvlab.memory.kv import state_bytes
from kvlab.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest

GREEDY_64 = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=HYBRID_ARCHS)
def files(request, tmp_path_factory):
    """(kind, folder, F32 GGUF, Q8_0 GGUF, transformers' model)."""
    import transformers

    kind, root = request.param, tmp_path_factory.mktemp(request.param + "-gguf")
    folder = build_tiny_hybrid(kind, root / "hf")
    f32 = build_tiny_hybrid_gguf(folder, root / "f32.gguf", kind)
    q8 = build_tiny_hybrid_gguf(folder, root / "q8.gguf", kind, "Q8_0")
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return kind, folder, f32, q8, ref


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in (6, 150)]


def test_the_gguf_config_is_the_folders(files):
    kind, folder, f32, _, _ = files
    ours, theirs = load_config(f32), load_config(folder)
    assert [layer.label for layer in ours.layers] == [layer.label for layer in theirs.layers]
    assert [layer.mixer for layer in ours.layers if isinstance(layer.mixer, GatedDeltaNet)] == \
           [layer.mixer for layer in theirs.layers if isinstance(layer.mixer, GatedDeltaNet)]
    attention = ours.layers[1].mixer
    assert attention.output_gate and ours.rope.partial_rotary_factor == 0.25
    assert ours.norm_offset is None and theirs.norm_offset == 1.0  # the converter added the 1
    assert ours.state_dtype == "float32"


def test_float32_gguf_gives_transformers_tokens(files):
    kind, _, f32, _, ref = files
    llm = LLM(f32, max_num_batched_tokens=64)
    got = [o.token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts()], GREEDY_64)]
    assert got == [reference_greedy(ref, p, 64) for p in prompts()], kind
    assert llm.engine.cache.states.nbytes() // llm.engine.pool_plan.num_state_slots == state_bytes(load_config(f32))


def test_q8_0_blocks_stay_blocks_and_give_the_expanded_files_tokens(files):
    kind, _, _, q8, _ = files
    native, expanded = LLM(q8), LLM(q8, dequantize=True)
    assert native.loaded.weight_format == "Q8_0 (as stored)"
    ps = [{"prompt_token_ids": p} for p in prompts()]
    assert [o.token_ids for o in native.generate(ps, GREEDY_64)] == \
           [o.token_ids for o in expanded.generate(ps, GREEDY_64)], kind
