"""The CPU decode backend runs mixture-of-experts layers in C (kernels/moe.c): each step routes its B
rows, groups them by expert and multiplies each chosen expert once for all the rows that chose it.

moe.c's MLP against the modules' (kvlab/model/moe.py) at 1, 3, 16 and 32 rows, with float, Q8_0 and MXFP4
experts; and greedy tokens of a batch served with the fused decode step equal the modules' own.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from test_paged import run_all
from tiny import add_tiny_tokenizer
from tiny_moe import MOE_ARCHS, build_tiny_moe, build_tiny_moe_gguf

from kvlab.backends.cpu import CpuDecodeBackend
from kvlab.backends.cpu_moe import describe_moe
from kvlab.config import EngineConfig
from kvlab.engine import LLMEngine
from kvlab.kernels import gemv
from kvlab.kernels.decode import library
from kvlab.kernels.policy import ThreadPolicy
from kvlab.model.loader import load_model
from kvlab.model.moe import MoEBlock
from kvlab.sampling import SamplingParams

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(library() is None, reason="the C kernels are not built here")]  # fmt: skip

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=[(a, t) for a in MOE_ARCHS for t in ("float", "Q8_0", "MXFP4")],
                ids=lambda p: f"{p[0]}-{p[1]}")  # fmt: skip
def loaded(request, tmp_path_factory):
    kind, experts = request.param
    directory = add_tiny_tokenizer(build_tiny_moe(kind, tmp_path_factory.mktemp(kind), yarn_truncate=True))
    if experts == "float":
        return load_model(directory)
    return load_model(build_tiny_moe_gguf(directory, directory / "m.gguf", experts_type=experts))


def moe_c(block: MoEBlock, x: torch.Tensor, threads: int = 1) -> torch.Tensor:
    """moe.c's mixture of experts of x [B, hidden]."""
    desc, lib = describe_moe(block), library()
    fn = gemv._state["lib"].kvlab_moe
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_void_p, ctypes.c_int]
    B, E = x.shape
    out, scratch = torch.empty(B, E), torch.empty(lib["moe_scratch_floats"](ctypes.byref(desc), B, E))
    fn(ctypes.byref(desc), x.data_ptr(), out.data_ptr(), B, E, scratch.data_ptr(), threads)
    return out


@pytest.mark.parametrize("rows", [1, 3, 16, 32])
def test_the_c_mixture_of_experts_is_the_modules(loaded, rows):
    x = torch.randn(rows, loaded.config.hidden_size, generator=torch.Generator().manual_seed(rows))
    for layer in loaded.model.layers:
        if isinstance(layer.mlp, MoEBlock):
            with torch.inference_mode():
                expected = layer.mlp(x[None])[0]
            got = moe_c(layer.mlp, x)
            assert (got - expected).abs().max().item() < 1e-5 * max(1.0, expected.abs().max().item())
            assert torch.equal(got, moe_c(layer.mlp, x, threads=2))  # the thread count changes no bit


def test_the_fused_decode_step_gives_the_modules_tokens(loaded, monkeypatch):
    assert isinstance(CpuDecodeBackend.build(loaded.model), CpuDecodeBackend)  # every layer, MoE ones too, in C
    steps = []
    run = CpuDecodeBackend.run
    monkeypatch.setattr(CpuDecodeBackend, "run", lambda self, *a: steps.append(1) or run(self, *a))
    batch = [[5, 6, 7], list(range(9, 20)), list(range(30, 58))]
    tokens = []
    for fused in (True, False):
        engine = LLMEngine(loaded, None, EngineConfig(block_size=4, kv_memory_bytes=1 << 21),
                           policy=ThreadPolicy(fused_decode=fused))  # fmt: skip
        tokens.append(run_all(engine, batch, GREEDY))
        if fused:
            assert len(steps) >= 19  # every decode step of the batch ran in C
    assert tokens[0] == tokens[1]


def test_kvlab_show_predicts_the_c_step_for_these_models(loaded):
    from kvlab.backends import C_STEP_EXPERTS, C_STEP_ROUTINGS, expected_decode_path
    from kvlab.kernels.decode import EXPERT_ACTIVATIONS, ROUTINGS

    assert set(C_STEP_ROUTINGS) == set(ROUTINGS) and set(C_STEP_EXPERTS) == set(EXPERT_ACTIVATIONS)
    assert expected_decode_path(loaded.config).name == "cpu-c"
