"""A mixed pass's decode rows attend through the decode step's C attention (backends/cpu_attention.py).

A step that carries prompt chunks beside running sequences' next tokens runs the model's modules; their
one-token rows read the paged cache's stored codes in place instead of gathering them. Checked here:
  - in such steps every decode group goes through attend_rows, and each call's output is PyTorch's
    attention over the gathered keys and values (the reference: `PagedKVCache.gather`, then the layer's
    own attention), within float32 rounding: float and quantized caches, Hadamard-rotated keys and values,
    Gemma 3's sliding layers (a KV group of their own, each with its window) and q·k scale, gpt-oss's sinks;
  - requests served together, their prompts chunked among the others' decode rows, give each one's
    greedy tokens alone;
  - with the decode step off (ThreadPolicy(fused_decode=False)) the rows gather: PyTorch's attention
    stays the reference the fused step's tests compare against;
  - the lab's materialized attention (no Softmax handed to the cache) gathers too.
"""

from __future__ import annotations

import pytest
import torch

import kvlab.backends.cpu_attention as cpu_attention
from kvlab.config import EngineConfig
from kvlab.engine import LLMEngine
from kvlab.kernels import ThreadPolicy
from kvlab.kernels.decode import library
from kvlab.model.attention import sdpa_attention, sink_attention
from kvlab.model.loader import load_model

from interleaved import run_all
from tiny import build_tiny
from tiny_moe import build_tiny_moe

pytestmark = pytest.mark.skipif(not library(), reason="no C compiler: the decode step's attention is not built")


@pytest.fixture(scope="module", params=["qwen2-d64", "gemma3", "gpt_oss"])
def model(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    if request.param == "gpt_oss":
        return load_model(build_tiny_moe("gpt_oss", directory, head_dim=32))  # quantized K/V: whole blocks of 32
    kind, _, d = request.param.partition("-d")
    return load_model(build_tiny(kind, directory, head_dim=int(d) if d else None))


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 400, (int(k),), generator=g).tolist() for k in torch.randint(3, 60, (n,), generator=g)]


def engine(model, kv: str = "auto", budget: int = 40, **policy) -> LLMEngine:
    """Prompts chunked `budget` tokens a step beside the decodes: most steps are mixed."""
    config = EngineConfig(enable_prefix_caching=False, max_num_seqs=8, max_num_batched_tokens=budget,
                          kv_cache_dtype=kv)  # fmt: skip
    return LLMEngine(model, None, config, policy=ThreadPolicy(**policy))


def reference(cache, layer: int, q: torch.Tensor, group, softmax) -> torch.Tensor:
    """PyTorch's attention of the group's rows over its gathered keys and values: [H, B, D]."""
    k_all, v_all = cache.gather(layer, group)
    meta = group.meta.for_window(cache.window(layer))
    rows = q.transpose(0, 1).unsqueeze(2)  # [B, H, 1, D]
    if softmax.sinks is not None:
        out = sink_attention(rows, k_all, v_all, meta, sinks=softmax.sinks, scale=softmax.scale)
    else:
        out = sdpa_attention(rows, k_all, v_all, meta, scale=softmax.scale)
    return out[:, :, 0].transpose(0, 1)


@pytest.mark.parametrize("kv", ["auto", "bfloat16", "q8_0", "q4_0", "fp8_e4m3"])
def test_mixed_steps_decode_rows_are_pytorchs_attention_over_the_gathered_keys(model, kv, monkeypatch):
    real, seen = cpu_attention.attend_rows, {"calls": 0, "worst": 0.0, "sinks": False, "windowed": False}

    def checked(cache, layer, q, group, g, positions, softmax):
        out = real(cache, layer, q, group, g, positions, softmax)
        assert out is not None, "a float32 cache in a format decode.c reads: the C attention takes the rows"
        want = reference(cache, layer, q, group, softmax)
        seen["worst"] = max(seen["worst"], float((out - want).abs().max() / want.abs().max().clamp(min=1e-6)))
        seen["calls"] += 1
        seen["sinks"] |= softmax.sinks is not None
        seen["windowed"] |= cache.window(layer) is not None
        return out

    monkeypatch.setattr(cpu_attention, "attend_rows", checked)
    eng = engine(model, kv)
    run_all(eng, prompts(6))
    assert seen["calls"] > 0, "no mixed step ran: the test's schedule lost its point"
    assert seen["worst"] < 2e-5, seen
    mixers = [layer.mixer for layer in model.config.layers]
    assert seen["windowed"] == any(m.window for m in mixers)  # Gemma 3's and gpt-oss's sliding layers
    assert seen["sinks"] == any(getattr(m, "sinks", False) for m in mixers)  # gpt-oss
    assert eng.cache.formats.rotate_k == (kv in ("q8_0", "q4_0"))  # the rotated keys' basis, q rotated to match


def test_requests_served_among_each_others_prompt_chunks_decode_as_alone(model):
    batch = prompts(6, seed=1)
    eng = engine(model)
    alone = [run_all(eng, [p])[0] for p in batch]
    assert run_all(eng, batch) == alone


def test_without_the_decode_step_or_with_the_labs_attention_the_rows_gather(model, monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_attention, "attend_rows", lambda *a: calls.append(1))
    run_all(engine(model, fused_decode=False), prompts(4))
    assert not calls
    model.model.set_attention("materialized")
    try:
        run_all(engine(model), prompts(4))
    finally:
        model.model.set_attention("sdpa")
    assert not calls
