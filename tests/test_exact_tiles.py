"""`--activation-quant bf16x3`: exact products of interleaved matrices on AMX bfloat16 tiles
(kernels/quant_i8.c's kvlab_t16_matmul). Each activation is split into three bfloat16 whose sum it is,
the codes are integers exact in bfloat16, and the tiles sum the exact products in float32: every product
is within float32's rounding of the reference (gguf's dequantization, then a float64 product), and a
row's bits are the same alone, among 16, in a prompt's pass of 70, in one dispatch with other parts, on
one thread or two. Through the engine: a request's tokens the same alone or among 16 and 48, the logits
those of the exact path to float32's rounding, and the setting refused in one line where there are no
tiles."""

from __future__ import annotations

import pytest
import torch

from kvlab.config import EngineConfig
from kvlab.engine import LLMEngine
from kvlab.errors import KvlabError
from kvlab.kernels import quant
from kvlab.kv.cache import ContiguousKVCache
from kvlab.model.loader import load_model
from kvlab.quant.activations import activation_setting_of, setting_name, with_activation_setting
from kvlab.quant.linear import PackedLinear, PackedTensor
from kvlab.runner.driver import ModelDriver
from quant_blocks import oracle, random_blocks
from interleaved import assert_together_as_alone, mixed_gguf, prompts

pytestmark = pytest.mark.skipif(not quant.available() or not quant.exact_tiles(),
                                reason="no AMX tiles for bfloat16 here (or no C compiler)")  # fmt: skip
FORMATS = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q5_K", "Q6_K"]


def tiled(fmt: str, rows: int, n: int, seed: int) -> tuple[PackedTensor, torch.Tensor]:
    """A random matrix in its "t16" form, and the reference's float64 weights."""
    blocks = random_blocks(fmt, rows, n, seed=seed)
    name, data = quant.interleave(PackedTensor(fmt, (rows, n), torch.from_numpy(blocks)), quant.TILED)
    assert name == fmt + "t16"
    return PackedTensor(name, (rows, n), data), torch.from_numpy(oracle(fmt, blocks, n)).double()


def activations(m: int, n: int, seed: int) -> torch.Tensor:
    """Values over many binades (as a model's are): each needs all 24 bits of float32's significand."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, n, generator=g) * torch.exp(2 * torch.randn(m, n, generator=g))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 2, 3, 8, 9, 16, 17, 32, 70])
def test_products_are_exact_to_float32_rounding_and_each_rows_own(fmt, m):
    part, w = tiled(fmt, 48, 512, seed=m)
    x = activations(m, 512, seed=m)
    y = quant.packed_linear(x, [part], 48)
    reference = x.double() @ w.T
    bound = x.double().abs() @ w.abs().T  # Σ|x·w|: float32's rounding of a sum is relative to it
    assert ((y.double() - reference).abs() / bound).max() < 1e-6
    alone = torch.cat([quant.packed_linear(x[i : i + 1], [part], 48) for i in range(m)])
    assert torch.equal(alone, y)
    assert torch.equal(quant.packed_linear(x, [part], 48, threads=1), y)


def test_8_bit_activations_would_not_pass_the_same_bound():
    """The bound above can fail: the same matrix with int8 activations misses it by orders of magnitude."""
    part, w = tiled("Q4_1", 48, 512, seed=0)
    blocks = random_blocks("Q4_1", 48, 512, seed=0)
    name, data = quant.interleave(PackedTensor("Q4_1", (48, 512), torch.from_numpy(blocks)))
    x = activations(4, 512, seed=0)
    error = (quant.packed_linear(x, [PackedTensor(name, (48, 512), data)], 48).double() - x.double() @ w.T).abs()
    assert (error / (x.double().abs() @ w.abs().T)).max() > 1e-4


@pytest.mark.parametrize("m", [1, 5, 16, 40])
def test_a_fused_matrix_in_one_dispatch_gives_each_parts_bits_alone(m):
    """q, k and v of three formats (sub-blocks of 32 and 16): one split of x per sub-block size."""
    parts = [tiled(fmt, rows, 512, seed=i)[0] for i, (fmt, rows) in enumerate([("Q4_K", 64), ("Q6_K", 32), ("Q8_0", 40)])]
    x = activations(m, 512, seed=1)
    fused = quant.packed_linear(x, parts, 136)
    assert torch.equal(fused, torch.cat([quant.packed_linear(x, [p], p.shape[0]) for p in parts], dim=1))


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def gguf_file(request, tmp_path_factory):
    return mixed_gguf(request.param, tmp_path_factory.mktemp(request.param))


def test_every_packed_matrix_is_tiled_and_the_c_step_takes_them(gguf_file):
    loaded = with_activation_setting(load_model(gguf_file), "bf16x3")
    assert activation_setting_of(loaded.model) == "bf16x3"
    layers = [m for m in loaded.model.modules() if isinstance(m, PackedLinear)]
    assert layers and all(f.endswith("t16") for m in layers for f in m.formats)
    assert setting_name("bf16x3") in loaded.weight_format and "exact" in loaded.weight_format
    engine = LLMEngine(loaded, None, EngineConfig(kv_memory_bytes=1 << 24))
    assert engine.decode_path.backend is not None, engine.decode_path.reason


@pytest.mark.parametrize("n", [16, 48])
def test_requests_together_give_each_ones_tokens_alone_on_both_paths(gguf_file, n):
    """16 sequences, and 48 (past max_kernel_rows: the C step still takes a model all of blocks). Each
    prompt is prefilled alone (pack_prompts=False): what is compared is the batched decode step."""
    loaded = with_activation_setting(load_model(gguf_file), "bf16x3")
    assert_together_as_alone(loaded, n)


def test_logits_are_the_exact_paths_to_float32_rounding(gguf_file):
    """A prompt's pass and a decode step: not the same bits as the exact blocks' (other sums), but the same
    numbers to float32's rounding, where int8 activations are a few percent off."""
    exact = load_model(gguf_file)
    tiles = with_activation_setting(load_model(gguf_file), "bf16x3")
    ids = prompts(1)[0]
    caches = [ContiguousKVCache.for_model(m.config, 64) for m in (exact, tiles)]
    drivers = [ModelDriver(m.model) for m in (exact, tiles)]
    for step in (ids, ids[:1]):
        a, b = (d.append(step, c) for d, c in zip(drivers, caches))
        assert (a - b).abs().max() <= 1e-4 * a.abs().max()


def test_the_setting_is_refused_in_one_line_without_tiles(gguf_file, monkeypatch):
    monkeypatch.setattr(quant, "exact_tiles", lambda: False)
    with pytest.raises(KvlabError, match="AMX tiles for bfloat16"):
        with_activation_setting(load_model(gguf_file), "bf16x3")
    with pytest.raises(KvlabError, match="not one of"):
        with_activation_setting(load_model(gguf_file), "bf16")


@pytest.mark.parametrize("experts_type", ["Q8_0", "Q4_0"])
def test_experts_are_tiled_too_and_sixteen_together_give_each_ones_tokens(tmp_path, experts_type):
    """A mixture of experts: every expert's blocks in their "t16" form, the C step's expert products (moe.c,
    each on one thread inside the pool's work) reading them, the same tokens alone and among 16, and the
    logits the exact path's to float32's rounding."""
    from tiny_moe import build_tiny_moe, build_tiny_moe_gguf

    from kvlab.model.experts import Experts
    from tiny import add_tiny_tokenizer

    directory = add_tiny_tokenizer(build_tiny_moe("qwen3_moe", tmp_path / "moe"))
    path = build_tiny_moe_gguf(directory, tmp_path / "moe.gguf", experts_type=experts_type)
    loaded = with_activation_setting(load_model(path), "bf16x3")
    banks = [m for m in loaded.model.modules() if isinstance(m, Experts)]
    assert banks and all(f == experts_type + "t16" for b in banks for fmts in b.formats.values() for f in fmts)
    assert_together_as_alone(loaded, 16, any_rows=False)
    exact = load_model(path)
    ids = prompts(1)[0]
    a, b = (ModelDriver(m.model).append(ids, ContiguousKVCache.for_model(m.config, 64)) for m in (exact, loaded))
    assert (a - b).abs().max() <= 1e-4 * a.abs().max()
