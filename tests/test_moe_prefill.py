"""A prompt's routed experts in one C call (kernels/moe.c's kvlab_moe_experts, kernels/moe_prefill.py): the
rows grouped by expert, each chosen expert's rows in tiles over the pool's threads, each row's experts summed
in ascending order.

Against the modules' per-expert loop (Experts.forward_by_expert) at 1 to 600 rows, and past the C call's
first round of rows, with Q8_0, Q4_0 and int8-activation experts: within float32 rounding (the SiLU is C's,
not PyTorch's), every row's bits independent of the thread count and of the rows beside it; and greedy
tokens served with it equal those served with the per-expert loop.
"""

from __future__ import annotations

import pytest
import torch
from test_paged import run_all
from tiny import add_tiny_tokenizer
from tiny_moe import MOE_ARCHS, build_tiny_moe, build_tiny_moe_gguf

from kvlab.config import EngineConfig
from kvlab.engine import LLMEngine
from kvlab.kernels import moe_prefill
from kvlab.kernels.policy import ThreadPolicy
from kvlab.model.experts import Experts
from kvlab.model.loader import load_model
from kvlab.model.moe import MoEBlock, route
from kvlab.quant.activations import with_int8_activations
from kvlab.sampling import SamplingParams

pytestmark = [pytest.mark.usefixtures("one_thread", "cpu_ops"),
              pytest.mark.skipif(not moe_prefill.available(), reason="the C kernels are not built here")]  # fmt: skip

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def tiny_moe(kind: str, experts: str, directory):
    """A tiny random MoE of `kind` from GGUF, its experts in `experts` blocks (int8: Q8_0 interleaved)."""
    directory = add_tiny_tokenizer(build_tiny_moe(kind, directory, yarn_truncate=True))
    blocks = "Q8_0" if experts == "int8" else experts
    model = load_model(build_tiny_moe_gguf(directory, directory / "m.gguf", experts_type=blocks))
    return with_int8_activations(model) if experts == "int8" else model


@pytest.fixture(scope="module", params=[(a, t) for a in MOE_ARCHS for t in ("Q8_0", "Q4_0", "int8")],
                ids=lambda p: f"{p[0]}-{p[1]}")  # fmt: skip
def loaded(request, tmp_path_factory):
    kind, experts = request.param
    return tiny_moe(kind, experts, tmp_path_factory.mktemp(kind))


def moe_blocks(loaded) -> list[MoEBlock]:
    return [layer.mlp for layer in loaded.model.layers if isinstance(layer.mlp, MoEBlock)]


def routed(block: MoEBlock, rows: int):
    """Random rows [rows, hidden] and the router's weights and expert ids for them."""
    x = torch.randn(rows, block.experts.hidden, generator=torch.Generator().manual_seed(rows))
    return (x, *route(block.router(x), block.moe))


@pytest.mark.parametrize("rows", [1, 3, 16, 33, 200, 600])
def test_one_c_call_computes_what_the_per_expert_loop_computes(loaded, rows):
    for block in moe_blocks(loaded):
        with torch.inference_mode(), ThreadPolicy(threads=1).active():
            x, weights, ids = routed(block, rows)
            assert block.experts._c_description(x, weights) is not None  # the C call takes these experts
            got = block.experts(x, weights, ids)
            expected = block.experts.forward_by_expert(x, weights, ids)
        assert (got - expected).abs().max().item() < 1e-5 * max(1.0, expected.abs().max().item())


@pytest.mark.parametrize("rows", [3, 33, 600])
def test_a_rows_bits_depend_neither_on_the_threads_nor_on_the_rows_beside_it(loaded, rows):
    for block in moe_blocks(loaded):
        with torch.inference_mode():
            x, weights, ids = routed(block, rows)
            with ThreadPolicy(threads=1).active():
                one = block.experts(x, weights, ids)
                half = block.experts(x[rows // 2 :], weights[rows // 2 :], ids[rows // 2 :])
            with ThreadPolicy(threads=2).active():
                two = block.experts(x, weights, ids)
        assert torch.equal(one, two)
        assert torch.equal(one[rows // 2 :], half)


def test_rows_past_a_round_of_the_c_call_are_computed_alike(tmp_path):
    """A round holds 2^24 floats of the pairs' outputs: 131,072 rows of these (hidden 64, top-2)."""
    rows, split = 131_072 + 1_000, 131_072 - 500
    loaded = tiny_moe("qwen3_moe", "Q4_0", tmp_path)
    block = moe_blocks(loaded)[0]
    with torch.inference_mode(), ThreadPolicy(threads=2).active():
        x, weights, ids = routed(block, rows)
        got = block.experts(x, weights, ids)
        expected = block.experts.forward_by_expert(x, weights, ids)
        tail = block.experts(x[split:], weights[split:], ids[split:])
    assert (got - expected).abs().max().item() < 1e-5 * max(1.0, expected.abs().max().item())
    assert torch.equal(got[split:], tail)


def test_served_prompts_give_the_per_expert_loops_greedy_tokens(loaded, monkeypatch):
    calls = []
    run = moe_prefill.experts
    monkeypatch.setattr(moe_prefill, "experts", lambda *a: calls.append(a[1].shape[0]) or run(*a))
    batch = [list(range(5, 45)), [(7 * i) % 500 + 3 for i in range(70)], [9, 8, 7]]
    config = EngineConfig(block_size=4, kv_memory_bytes=1 << 21, max_num_batched_tokens=128)
    tokens = run_all(LLMEngine(loaded, None, config), batch, GREEDY)
    assert max(calls) >= 70  # the prompts' rows went through the C call
    monkeypatch.setattr(Experts, "forward", Experts.forward_by_expert)
    assert tokens == run_all(LLMEngine(loaded, None, config), batch, GREEDY)
