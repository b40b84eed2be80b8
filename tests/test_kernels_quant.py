"""The block-format kernels (kernels/quant.c) against the gguf package: products, dequantization, layouts.

Products are checked against the gguf package's dequantization followed by a float64 matmul (relative
error max|y − ref| / max|ref| ≤ 1e-5); dequantization bit for bit. The machine's own build is tested,
and the portable C path (no AVX-512) is built separately and held to the same numbers.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvlab.kernels import quant
from kvlab.kernels.policy import ThreadPolicy
from kvlab.quant.formats import FORMATS
from kvlab.quant.linear import PackedLinear, PackedTensor
from quant_blocks import FP16_FIELDS, oracle, random_blocks

needs_kernel = pytest.mark.skipif(not quant.available(), reason="no C compiler: the reference dequantization serves")

QUANTIZED = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q5_K", "Q6_K"]
ROWS = [1, 2, 3, 8, 16, 17, 32, 40, 72, 136]  # 40, 72, 136: more than one pass over the blocks (32, 64 or 128 rows)


def odd_shapes(fmt: str) -> list[tuple[int, int]]:
    """(out, in): output rows that no work item's row count divides; whole blocks of input."""
    return [(13, 256), (67, 768)] if FORMATS[fmt].block_values == 256 else [(13, 96), (67, 288)]


def packed(fmt: str, blocks: np.ndarray, in_features: int) -> PackedTensor:
    return PackedTensor(fmt, (blocks.shape[0], in_features), torch.from_numpy(blocks))


def plain(fmt: str, w: torch.Tensor) -> PackedTensor:
    dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[fmt]
    return PackedTensor(fmt, tuple(w.shape), w.to(dtype).contiguous().view(torch.uint8).reshape(w.shape[0], -1))


def relative_error(y: torch.Tensor, x: torch.Tensor, w: np.ndarray) -> float:
    ref = x.double().numpy() @ w.astype(np.float64).T
    return float(np.abs(y.double().numpy() - ref).max() / np.abs(ref).max())


def activations(rows: int, in_features: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, in_features, generator=torch.Generator().manual_seed(seed))


# ---- products ---------------------------------------------------------------------------------


@needs_kernel
@pytest.mark.parametrize("fmt", QUANTIZED)
def test_products_of_random_blocks_match_gguf_dequantize_then_float64(fmt):
    for out, n in odd_shapes(fmt) + [(67, 1280)]:  # 1,280 inputs: AVX-512's passes take 32 rows there, not 64
        blocks = random_blocks(fmt, out, n, seed=out)
        w = oracle(fmt, blocks, n)
        for rows in ROWS:
            x = activations(rows, n, seed=rows)
            y = quant.packed_linear(x, [packed(fmt, blocks, n)], out, threads=2)
            assert y.shape == (rows, out) and y.dtype == torch.float32
            assert relative_error(y, x, w) <= 1e-5, (fmt, out, n, rows)


@needs_kernel
@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0", "Q4_1", "Q5_0"])
def test_products_of_weights_quantized_by_gguf(fmt):
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(5)
    w = (rng.standard_normal((67, 288)) * 0.02).astype(np.float32)
    w[3, 17], w[40, :32] = 0.9, 0.0  # an outlier that owns its block's scale; an all-zero block (d = 0)
    blocks = quants.quantize(w, GGMLQuantizationType[fmt])
    for rows in ROWS:
        x = activations(rows, 288, seed=rows)
        y = quant.packed_linear(x, [packed(fmt, blocks, 288)], 67)
        assert relative_error(y, x, oracle(fmt, blocks, 288)) <= 1e-5, (fmt, rows)


@needs_kernel
@pytest.mark.parametrize("fmt", ["F32", "F16", "BF16"])
def test_plain_rows_go_through_the_same_entry_point(fmt):
    for out, n in [(13, 37), (67, 100), (5, 600)]:
        part = plain(fmt, activations(out, n, seed=n))
        w = part.dequantize().numpy()
        for rows in ROWS:
            x = activations(rows, n, seed=rows + n)
            assert relative_error(quant.packed_linear(x, [part], out), x, w) <= 1e-5, (fmt, out, n, rows)


@needs_kernel
@pytest.mark.parametrize("fmt", QUANTIZED + ["F16"])
@pytest.mark.parametrize("wide", [False, True])
def test_results_are_bit_identical_at_any_thread_count_and_batch(fmt, wide):
    """Each output value is one thread's sum in one fixed order: the same bits on 1, 2 or 3 threads, and
    the same bits for a row alone as inside a batch of 16, 40, 72 or 150 (the one-row and many-row paths
    agree), with few inputs and with many (AVX-512's passes: 128 rows of blocks, 64 or 32 float rows)."""
    out, n = odd_shapes(fmt)[1] if fmt != "F16" else (67, 288)
    n = 1280 if wide else n
    part = packed(fmt, random_blocks(fmt, out, n, seed=9), n) if fmt != "F16" else plain(fmt, activations(out, n, 9))
    x = activations(150, n, seed=11)  # more rows than one pass over the blocks takes
    one = quant.packed_linear(x, [part], out, threads=1)
    for threads in (2, 3):
        assert torch.equal(quant.packed_linear(x, [part], out, threads=threads), one), threads
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 16, 17, 32, 33, 40, 64, 72, 128, 129):
        assert torch.equal(quant.packed_linear(x[:rows], [part], out, threads=2), one[:rows]), rows


@needs_kernel
def test_each_part_of_a_fused_matrix_is_written_into_its_own_columns():
    """q, k, v in different formats: one output, each part in its column slice (the kernel's row stride)."""
    n = 256
    formats, sizes = ["Q4_K", "Q5_0", "Q8_0", "F16", "Q6_K"], [13, 5, 7, 3, 9]
    parts = [
        plain(f, activations(rows, n, i)) if f == "F16" else packed(f, random_blocks(f, rows, n, seed=i), n)
        for i, (f, rows) in enumerate(zip(formats, sizes))
    ]
    x = activations(3, n, seed=1)
    y = quant.packed_linear(x, parts, sum(sizes))
    start = 0
    for part, rows in zip(parts, sizes):
        alone = quant.packed_linear(x, [part], rows)
        assert torch.equal(y[:, start : start + rows], alone), part.fmt
        start += rows
    whole = np.concatenate([quant.dequantize(p).numpy() for p in parts])
    assert relative_error(y, x, whole) <= 1e-5


@needs_kernel
def test_views_and_float_types_of_the_activations_are_accepted():
    out, n = 13, 96
    part = packed("Q4_0", random_blocks("Q4_0", out, n), n)
    x = activations(4, 2 * n, seed=2)[:, ::2]  # not contiguous
    expected = quant.packed_linear(x.contiguous(), [part], out)
    assert torch.equal(quant.packed_linear(x, [part], out), expected)
    assert torch.equal(quant.packed_linear(x.contiguous().bfloat16(), [part], out),
                       quant.packed_linear(x.contiguous().bfloat16().float(), [part], out))  # fmt: skip


@needs_kernel
def test_mismatched_parts_are_refused_before_the_kernel_reads_them():
    part = packed("Q4_0", random_blocks("Q4_0", 8, 64), 64)
    with pytest.raises(ValueError, match="inputs"):
        quant.packed_linear(torch.randn(1, 96), [part], 8)
    with pytest.raises(ValueError, match="do not make"):
        quant.packed_linear(torch.randn(1, 64), [part], 9)
    short = PackedTensor("Q4_0", (8, 64), part.data[:, :18])  # one block where a row needs two
    with pytest.raises(ValueError, match="needs uint8"):
        quant.packed_linear(torch.randn(1, 64), [short], 8)
    with pytest.raises(ValueError, match="whole blocks"):
        quant.packed_linear(torch.randn(1, 48), [PackedTensor("Q4_0", (8, 48), part.data)], 8)


# ---- dequantization ---------------------------------------------------------------------------


@needs_kernel
@pytest.mark.parametrize("fmt", QUANTIZED)
def test_dequantize_gives_the_gguf_packages_bits(fmt):
    for out, n in odd_shapes(fmt):
        blocks = random_blocks(fmt, out, n, seed=out + 1)
        got = quant.dequantize(packed(fmt, blocks, n), threads=2)
        assert got.dtype == torch.float32 and np.array_equal(got.numpy(), oracle(fmt, blocks, n)), (fmt, out, n)


@needs_kernel
@pytest.mark.parametrize("fmt", QUANTIZED)
def test_every_finite_fp16_scale_dequantizes_exactly(fmt):
    """Zero, subnormal and the largest scales: every finite fp16 number as the block scale (and min)."""
    values, size = FORMATS[fmt].block_values, FORMATS[fmt].block_bytes
    scales = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    scales = scales[np.isfinite(scales.view(np.float16))]
    blocks = random_blocks(fmt, len(scales), values, seed=3).reshape(-1, size)
    for at in FP16_FIELDS[fmt]:
        blocks[:, at : at + 2] = scales.view(np.uint8).reshape(-1, 2)
    blocks = blocks.reshape(256, -1)
    n = blocks.shape[1] // size * values
    expected = oracle(fmt, blocks, n)
    got = quant.dequantize(packed(fmt, blocks, n)).numpy()
    assert np.array_equal(got, expected, equal_nan=True)


@needs_kernel
@pytest.mark.parametrize("fmt", ["F32", "F16", "BF16"])
def test_dequantize_plain_rows(fmt):
    part = plain(fmt, activations(13, 37, seed=4))
    assert torch.equal(quant.dequantize(part), part.dequantize())


# ---- the layer --------------------------------------------------------------------------------


@needs_kernel
def test_packed_linear_layer_end_to_end(cpu_ops):
    """PackedLinear with the kernels: every row count through packed_linear by default (the tiles beat
    dequantizing for BLAS; on AVX2 up to PROMPT_TILE_ROWS rows), prompt-sized ones through the C
    dequantization and BLAS when the policy says so; both equal float math on the file's values, the
    bias added."""
    n = 256
    parts = [packed(f, random_blocks(f, rows, n, seed=rows), n) for f, rows in (("Q5_0", 24), ("Q4_K", 8), ("Q8_0", 8))]
    bias = torch.randn(40)
    layer = PackedLinear(parts, bias=bias)
    w = torch.cat([torch.from_numpy(oracle(p.fmt, p.data.numpy(), n)) for p in parts])
    assert quant.available()
    for packed_prompts in (True, False):
        with ThreadPolicy(packed_prompts=packed_prompts).active():
            for rows in (1, 3, 32, 33, 300):
                x = torch.randn(1, rows, n, generator=torch.Generator().manual_seed(rows))
                tiles = rows <= quant.PROMPT_TILE_ROWS.get(quant.isa(), rows)
                assert quant.applies(x.view(rows, n), layer.formats) == ((packed_prompts and tiles) or rows <= 32)
                y = layer(x)
                ref = F.linear(x.double(), w.double(), bias.double())
                assert y.shape == (1, rows, 40) and y.dtype == torch.float32
                assert (y - ref).abs().max() <= 1e-5 * ref.abs().max(), rows
                assert layer(x.bfloat16()).dtype == torch.bfloat16
    with ThreadPolicy(use_kernels=False).active():
        assert not quant.applies(torch.randn(1, n), layer.formats)


@needs_kernel
def test_the_build_names_the_exact_path_this_cpu_takes():
    flags = set(" ".join(line for line in Path("/proc/cpuinfo").read_text(errors="ignore").splitlines()
                         if line.startswith("flags")).split())  # fmt: skip
    expected = "avx512" if {"avx512f", "avx512vl"} <= flags else "avx2" if {"avx2", "fma"} <= flags else "portable"
    assert quant.isa() == expected
    rows = quant.PROMPT_TILE_ROWS.get(expected)
    if rows is not None:  # a mixture's prompt is shared out among its experts: not one product of that size
        x = torch.randn(rows + 1, 256)
        assert not quant.applies(x, ["Q4_K"]) and quant.applies(x, ["Q4_K"], whole=False)
        assert quant.applies(x[:rows], ["Q4_K"])


# ---- the narrower builds: AVX2 on an AVX-512 machine, and the portable C path on any -----------

_QUANT_C = Path(quant.__file__).with_name("quant.c")
_NARROWER = {"avx2": ["-mno-avx512f"], "portable": ["-mno-avx512f", "-mno-avx2", "-mno-fma"]}


@pytest.fixture(scope="module", params=sorted(_NARROWER))
def portable(request, tmp_path_factory):
    """quant.c built for a narrower machine than this one: without AVX-512 (the AVX2 path, where this
    machine has AVX-512), or without AVX2 and FMA too (the portable path that expands chunks)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    flags_here = Path("/proc/cpuinfo").read_text(errors="ignore")
    if compiler is None or (request.param == "avx2" and "avx512f" not in flags_here):
        pytest.skip("no compiler, or no AVX-512 here: the machine's own build is the AVX2 one")
    target = tmp_path_factory.mktemp(request.param) / "quant.so"
    sources = [str(_QUANT_C), str(_QUANT_C.with_name("quant_i8.c")), str(_QUANT_C.with_name("pool.c"))]
    flags = ["-O3", "-march=native", *_NARROWER[request.param], "-pthread", "-shared", "-fPIC", "-std=gnu11"]
    subprocess.run([compiler, *flags, *sources, "-o", str(target), "-lm"], check=True, capture_output=True)
    lib = ctypes.CDLL(str(target))
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.kvlab_quant_matmul.argtypes = [i32, p, i64, p, p, i64, i64, i64, i64, i32]
    lib.kvlab_quant_dequantize.argtypes = [i32, p, i64, p, i64, i64, i64, i32]
    return lib


@needs_kernel
@pytest.mark.parametrize("fmt", QUANTIZED)
def test_portable_build_gives_the_same_numbers(portable, fmt):
    fid = quant._format_ids()[fmt]
    out, n = odd_shapes(fmt)[1]
    blocks = random_blocks(fmt, out, n, seed=7)
    w = oracle(fmt, blocks, n)
    got = torch.empty(out, n)
    assert portable.kvlab_quant_dequantize(fid, blocks.ctypes.data, blocks.shape[1], got.data_ptr(), n, out, n, 2) == 0
    assert np.array_equal(got.numpy(), w)
    x = activations(16, n, seed=8)
    y = torch.empty(16, out)
    ones = []
    for rows in (1, 3, 5, 16):
        assert portable.kvlab_quant_matmul(fid, blocks.ctypes.data, blocks.shape[1], x.data_ptr(), y.data_ptr(),
                                           rows, n, out, out, 2) == 0  # fmt: skip
        assert relative_error(y[:rows], x[:rows], w) <= 1e-5, rows
        ones.append(y[0].clone())
    assert all(torch.equal(row, ones[0]) for row in ones)


@needs_kernel
@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("m", [1, 3, 16, 32, 33, 65])
def test_a_fused_matrix_in_one_dispatch_gives_each_parts_bits_alone(interleave, m):
    """q, k and v (or gate and up) as one job of the pool (kvlab_quant_matmul_parts): each part's columns
    are the bits its own call gives, on 1 or 2 threads; two parts quantizing x alike share it (int8)."""
    spec = [("Q4_K", 40), ("Q4_K", 8), ("Q6_K", 24), ("Q8_0", 16)]
    parts = []
    for i, (fmt, rows) in enumerate(spec):
        part = packed(fmt, random_blocks(fmt, rows, 512, seed=i), 512)
        if interleave:
            found = quant.interleave(part)
            part = PackedTensor(found[0], part.shape, found[1])
        parts.append(part)
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
    for threads in (1, 2):
        y = quant.packed_linear(x, parts, sum(rows for _, rows in spec), threads=threads)
        start = 0
        for part in parts:
            alone = quant.packed_linear(x, [part], part.shape[0], threads=threads)
            assert torch.equal(y[:, start : start + part.shape[0]], alone), (part.fmt, threads)
            start += part.shape[0]


@needs_kernel
def test_a_matrix_past_the_caches_gives_each_rows_bits_alone_with_8_bit_activations():
    """An LM-head-sized interleaved matrix (over 16 MB: its items ask for the lines two items on while
    several rows run) gives 5 and 16 rows the bits each row gets alone, on 1 and 2 threads."""
    rows, n = 36_000, 512  # Q8_0: 34 bytes per 32 values, 17 per 16 interleaved: about 19.6 MB
    part = packed("Q8_0", random_blocks("Q8_0", rows, n, seed=7), n)
    found = quant.interleave(part)
    part = PackedTensor(found[0], part.shape, found[1])
    x = torch.randn(16, n, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([quant.packed_linear(x[i : i + 1], [part], rows, threads=1) for i in range(16)])
    for m in (5, 16):
        for threads in (1, 2):
            assert torch.equal(quant.packed_linear(x[:m], [part], rows, threads=threads), alone[:m]), (m, threads)
