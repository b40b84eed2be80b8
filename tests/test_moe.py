"""Mixture-of-experts models against transformers' own classes, on tiny random checkpoints in float32.

Qwen3-MoE (top-2 renormalised, a dense layer among sparse ones), OLMoE (q/k norms over the whole
projections, top-2 as is), Qwen2-MoE (a shared expert behind its sigmoid gate, q/k/v biases, a dense
layer) and gpt-oss (attention sinks, q/k/v/o biases, sliding and full layers, YaRN, router bias, top-k
then softmax, clamped SwiGLU experts stored fused and interleaved): last-position logits within 1e-4,
and greedy tokens identical to transformers' generate on several prompts served together by the engine
(paged cache, chunked prefill, decode steps of several rows). The bytes the model holds are the file's
and `kvlab mem`'s; a token reads only its top_k experts; an MoE kvlab does not compute is refused in one line.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_cli import run_cli
from test_paged import run_all
from test_real import reference_greedy
from tiny import add_tiny_tokenizer
from tiny_moe import MOE_ARCHS, build_tiny_moe

from kvlab.config import EngineConfig, MoE, load_config
from kvlab.engine import LLMEngine
from kvlab.kv.cache import ContiguousKVCache
from kvlab.memory import weight_bytes
from kvlab.model.loader import load_model
from kvlab.model.experts import group_by_expert
from kvlab.model.moe import route
from kvlab.runner.driver import ModelDriver
from kvlab.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=MOE_ARCHS)
def pair(request, tmp_path_factory):
    """(kind, folder, our LoadedModel, transformers' model) on the same tiny random MoE."""
    import transformers

    directory = build_tiny_moe(request.param, tmp_path_factory.mktemp(request.param))
    add_tiny_tokenizer(directory)
    ref = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return request.param, directory, load_model(directory), ref


def prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=g).tolist()


def test_the_config_says_which_layers_are_sparse_and_how_they_route(pair):
    kind, _, loaded, _ = pair
    mlps = [layer.mlp for layer in loaded.config.layers]
    sparse = [isinstance(m, MoE) for m in mlps]
    assert sparse == ([True, False, True] if kind in ("qwen3_moe", "qwen2_moe") else [True, True, True])
    moe = mlps[0]
    assert (moe.num_experts, moe.top_k) == (8, 2)
    assert moe.routing == ("topk_softmax" if kind == "gpt_oss" else "softmax_topk")
    assert moe.norm_topk_prob == (kind == "qwen3_moe")
    assert (moe.shared_size, moe.shared_gate) == ((48, True) if kind == "qwen2_moe" else (0, False))
    if kind == "gpt_oss":
        attn = loaded.config.layers[0].mixer
        assert attn.sinks and attn.o_bias and attn.qkv_bias and moe.expert_bias and moe.router_bias
        assert [layer.mixer.window for layer in loaded.config.layers] == [8, None, 8]
        assert (moe.activation, moe.swiglu_limit, moe.swiglu_alpha) == ("clamped_swiglu", 7.0, 1.702)
    if kind == "olmoe":
        assert loaded.config.layers[0].mixer.qk_norm_whole


def test_last_position_logits_match_transformers(pair):
    kind, _, loaded, ref = pair
    ids = torch.tensor([prompt(40)])
    with torch.inference_mode():
        expected = ref(ids).logits[:, -1]
        got = ModelDriver(loaded.model).run(ids, ContiguousKVCache.for_model(loaded.config, 64))
    assert expected.std() > 0.5, "logits too flat to test anything"
    assert (got - expected).abs().max().item() < 1e-4, kind


def test_greedy_tokens_of_several_prompts_match_transformers(pair):
    """Four prompts of different lengths served together (chunked prefill of 16, then batched decode steps)."""
    kind, _, loaded, ref = pair
    batch = [prompt(n, seed=n) for n in (3, 11, 20, 33)]
    engine = LLMEngine(loaded, None, EngineConfig(block_size=4, kv_memory_bytes=1 << 21, max_num_batched_tokens=16))
    assert run_all(engine, batch, GREEDY) == [reference_greedy(ref, p, 24) for p in batch], kind
    assert engine.kv.pool.check_integrity().used == 0


def test_the_bytes_held_are_the_files_and_kvlab_mems(pair, capsys):
    kind, directory, loaded, _ = pair
    estimate = weight_bytes(load_config(directory))
    assert estimate.exact and loaded.weight_bytes == estimate.bytes, kind
    params = estimate.params
    assert params.active < params.total
    code, out, _ = run_cli(capsys, "mem", str(directory))
    assert code == 0 and f"{loaded.weight_bytes:,}" in out and "active per token" in out


def test_a_token_reads_only_its_top_k_experts(pair):
    kind, _, loaded, _ = pair
    model = loaded.model
    experts = model.layers[0].mlp.experts
    assert experts.bytes_read_per_token() * 4 == experts.nbytes()  # 2 of 8 experts
    assert model.decode_read_bytes() < model.weight_bytes()


def test_routing_follows_transformers_rules():
    logits = torch.tensor([[0.1, 2.0, 1.0, -1.0], [3.0, 0.0, 2.9, 0.5]])
    moe = MoE(num_experts=4, top_k=2, expert_size=8)
    weights, ids = route(logits, moe)
    probs = torch.softmax(logits, dim=-1)
    assert ids.tolist() == [[1, 2], [0, 2]]
    assert torch.equal(weights, probs.gather(1, ids))  # not renormalised
    weights, _ = route(logits, MoE(num_experts=4, top_k=2, expert_size=8, norm_topk_prob=True))
    assert torch.allclose(weights.sum(-1), torch.ones(2))
    weights, ids = route(logits, MoE(num_experts=4, top_k=2, expert_size=8, routing="topk_softmax"))
    assert torch.equal(weights, torch.softmax(logits.gather(1, ids), dim=-1))


def test_rows_are_grouped_by_expert_stably():
    ids = torch.tensor([[2, 0], [0, 3], [2, 1]])  # 3 tokens, top-2 of 4 experts
    order, tokens, counts = group_by_expert(ids, 4)
    assert counts == [2, 1, 2, 1]
    assert order.tolist() == [1, 2, 5, 0, 4, 3]  # flat (token, slot) indices, expert by expert, in token order
    assert tokens.tolist() == [0, 1, 2, 0, 2, 1]


@pytest.mark.parametrize("change, words", [
    ({"hidden_act": "gelu"}, ["mixture of experts", "gelu experts"]),
    ({"scoring_func": "sigmoid"}, ["mixture of experts", "sigmoid_topk"]),
])  # fmt: skip
def test_an_moe_kvlab_does_not_compute_is_one_line_and_exit_2(tmp_path, capsys, change, words):
    directory = build_tiny_moe("qwen3_moe", tmp_path / "m")
    add_tiny_tokenizer(directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **change}))
    capsys.readouterr()  # transformers' progress bars while saving
    code, _, err = run_cli(capsys, "run", str(directory), "hi")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert all(word in lines[0] for word in words), lines[0]


def test_quantization_at_load_keeps_the_experts_stacked_in_blocks(pair, tmp_path):
    kind, directory, loaded, _ = pair
    if kind == "qwen2_moe":  # the tiny shared expert (48 wide) is no whole number of 32-weight blocks: 64 here
        directory = build_tiny_moe(kind, tmp_path / kind, shared_expert_intermediate_size=64)
        loaded = load_model(directory)
    from kvlab.backends.cpu import CpuDecodeBackend

    q8 = load_model(directory, quantization="q8_0")
    assert q8.model.layers[0].mlp.experts.formats == {"gate_up": ["Q8_0", "Q8_0"], "down": ["Q8_0"]}
    assert q8.weight_bytes < loaded.weight_bytes / 3
    assert isinstance(CpuDecodeBackend.build(q8.model), CpuDecodeBackend)
    ids = torch.tensor([prompt(20)])
    with torch.inference_mode():
        full = ModelDriver(loaded.model).run(ids, ContiguousKVCache.for_model(loaded.config, 32))
        packed = ModelDriver(q8.model).run(ids, ContiguousKVCache.for_model(q8.config, 32))
    assert (full - packed).abs().max() < 0.1 * full.abs().max()
