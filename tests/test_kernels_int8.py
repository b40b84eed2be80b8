"""8-bit activations (kernels/quant_i8.c, kvlab/quant/activations.py): the opt-in products.

Their contract: the exact weights times the activations rounded to int8 per sub-block (x̂ = dx·q with
dx = max|x| / 127, 32 values per sub-block, 16 for Q6_K), to float32 tolerance; the same bits for a row
alone or in any batch and on any number of threads; a model converted whole, its greedy output
still the model's own on the registry-style tiny GGUF. Where AMX has bfloat16 tiles, passes of
quant.bf16_prompt_rows() rows or more: the weights and activations rounded to bfloat16, summed in float32.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from kvlab.kernels import quant
from kvlab.quant.linear import PackedTensor
from quant_blocks import oracle, random_blocks

needs_kernel = pytest.mark.skipif(not quant.available(), reason="no C compiler: the reference dequantization serves")

FORMATS = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q5_K", "Q6_K"]
ROWS = [1, 2, 3, 8, 16, 17, 32, 40]


def sub_block(fmt: str) -> int:
    return 16 if fmt == "Q6_K" else 32


def rounded(x: torch.Tensor, size: int) -> np.ndarray:
    """x̂: each run of `size` values as int8 codes times their scale, in float32 as the kernel rounds."""
    v = x.numpy().astype(np.float32).reshape(x.shape[0], -1, size)
    amax = np.abs(v).max(axis=2, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.clip(np.rint(v * inv), -127, 127)
    return ((amax / np.float32(127)) * q).astype(np.float32).reshape(x.shape)


def shapes(fmt: str) -> list[tuple[int, int]]:
    """(out, in): row counts no item of 16 divides, and inputs of several blocks (17 and more sub-blocks:
    the quantizer's sixteen at a time, then one)."""
    return [(13, 256), (67, 768)] if fmt.endswith("K") else [(13, 96), (67, 544)]


def interleaved(fmt: str, out: int, n: int, seed: int) -> tuple[PackedTensor, np.ndarray]:
    blocks = random_blocks(fmt, out, n, seed=seed)
    found = quant.interleave(PackedTensor(fmt, (out, n), torch.from_numpy(blocks)))
    assert found is not None and found[0] == fmt + "x16"
    return PackedTensor(found[0], (out, n), found[1]), oracle(fmt, blocks, n)


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
def test_products_equal_the_exact_weights_times_int8_rounded_activations(fmt):
    for out, n in shapes(fmt):
        part, w = interleaved(fmt, out, n, seed=out)
        for rows in ROWS:
            x = torch.randn(rows, n, generator=torch.Generator().manual_seed(rows)) * 3
            y = quant.packed_linear(x, [part], out)
            ref = rounded(x, sub_block(fmt)).astype(np.float64) @ w.astype(np.float64).T
            err = np.abs(y.double().numpy() - ref).max() / np.abs(ref).max()
            assert err <= 1e-5, (fmt, out, n, rows, err)
            # and it is the rounding of x that separates it from the exact product: near, not equal
            exact = x.double().numpy() @ w.astype(np.float64).T
            assert 0 < np.abs(y.double().numpy() - exact).max() / np.abs(exact).max() < 0.05, (fmt, rows)


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_rows_bits_do_not_depend_on_its_batch_or_the_threads(fmt):
    out, n = shapes(fmt)[1]
    part, _ = interleaved(fmt, out, n, seed=5)
    x = torch.randn(40, n, generator=torch.Generator().manual_seed(3))
    one = quant.packed_linear(x, [part], out, threads=1)
    for threads in (2, 3):
        assert torch.equal(quant.packed_linear(x, [part], out, threads=threads), one), threads
    for rows in (1, 2, 3, 5, 8, 9, 16, 17, 32):
        assert torch.equal(quant.packed_linear(x[:rows], [part], out, threads=2), one[:rows]), rows
    for i in (0, 7, 39):  # a row alone, wherever it sat
        assert torch.equal(quant.packed_linear(x[i : i + 1], [part], out), one[i : i + 1]), i


# bytes a weight of the interleaved copy: the codes as the kernels read them (4-bit or widened to 8)
# and each sub-block's scale (and min) as the file keeps it, not as a float32
# 5-bit codes: 4 bits, and a plane of their fifth bits (4 bytes a row and 32 values)
BYTES_PER_WEIGHT = {"Q8_0": 1 + 2 / 32, "Q4_0": 0.5 + 2 / 32, "Q4_1": 0.5 + 4 / 32, "Q5_0": 0.5 + 4 / 32 + 2 / 32,
                    "Q4_K": 0.5 + 2 / 32 + 8 / 256, "Q5_K": 0.5 + 4 / 32 + 2 / 32 + 8 / 256, "Q6_K": 1 + 1 / 16 + 4 / 256}


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_interleaved_copy_keeps_the_files_scales_not_float32_ones(fmt):
    part, _ = interleaved(fmt, 32, 512, seed=4)
    assert part.data.numel() == 32 * 512 * BYTES_PER_WEIGHT[fmt]


@needs_kernel
def test_zero_and_tiny_activations_and_a_fused_matrix():
    """An all-zero sub-block (scale 0) gives exact zeros; each part of a fused matrix fills its columns."""
    parts, ws = zip(*(interleaved(f, rows, 256, seed=i) for i, (f, rows) in enumerate((("Q4_K", 20), ("Q8_0", 7), ("Q6_K", 16)))))
    x = torch.randn(4, 256)
    x[1] = 0
    x[2, :32] = 1e-30
    y = quant.packed_linear(x, list(parts), 43)
    assert torch.equal(y[1], torch.zeros(43))
    start = 0
    for part, w in zip(parts, ws):
        alone = quant.packed_linear(x, [part], part.shape[0])
        assert torch.equal(y[:, start : start + part.shape[0]], alone)
        start += part.shape[0]


@needs_kernel
def test_interleaved_parts_take_prompt_sized_passes_and_refuse_dequantizing():
    part, w = interleaved("Q4_0", 24, 64, seed=1)
    x = torch.randn(60, 64)  # more rows than a decode step: still the kernel (no float copy exists)
    assert quant.applies(x, [part.fmt])
    y = quant.packed_linear(x, [part], 24)
    ref = rounded(x, 32).astype(np.float64) @ w.astype(np.float64).T
    assert np.abs(y.double().numpy() - ref).max() / np.abs(ref).max() <= 1e-5
    # a pass over wide rows goes in passes of rows whose activations stay in L2 (48 rows at 8,192
    # inputs): the same bits as each row alone (60 rows: below the bfloat16 passes' rows, on any machine)
    wide, w = interleaved("Q8_0", 20, 8192, seed=2)
    x = torch.randn(60, 8192, generator=torch.Generator().manual_seed(4))
    y = quant.packed_linear(x, [wide], 20)
    ref = rounded(x, 32).astype(np.float64) @ w.astype(np.float64).T
    assert np.abs(y.double().numpy() - ref).max() / np.abs(ref).max() <= 1e-5
    for i in (0, 47, 48, 59):
        assert torch.equal(quant.packed_linear(x[i : i + 1], [wide], 20), y[i : i + 1]), i
    with pytest.raises(ValueError):
        quant.dequantize(part)
    assert quant.interleave(PackedTensor("F16", (4, 8), torch.zeros(4, 16, dtype=torch.uint8))) is None


_NO_AMX = ["-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"]
_NARROWER = {"vnni": _NO_AMX, "avx2": ["-mno-avx512f", *_NO_AMX], "portable": ["-mno-avx512f", "-mno-avx2", "-mno-fma", *_NO_AMX]}
_NEEDS = {"vnni": "amx_int8", "avx2": "avx512_vnni"}  # a narrower build than this machine's only where this one has it


@pytest.fixture(scope="module", params=sorted(_NARROWER))
def portable(request, tmp_path_factory):
    """The kernels built for a narrower machine than this one: without AMX (quant_i8.c's VNNI products
    for every row, where this machine has AMX tiles), without AVX-512 (its AVX2 products, where this
    machine has VNNI), or without AVX2 too (its plain C loop)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    needs = _NEEDS.get(request.param)
    if compiler is None or (needs and needs not in Path("/proc/cpuinfo").read_text(errors="ignore")):
        pytest.skip(f"no compiler, or no {needs} here: this machine's own build is the narrower one")
    here = Path(quant.__file__).parent
    target = tmp_path_factory.mktemp(request.param) / "quant.so"
    sources = [str(here / name) for name in ("quant.c", "quant_i8.c", "pool.c")]
    flags = ["-O3", "-march=native", *_NARROWER[request.param], "-pthread", "-shared", "-fPIC", "-std=gnu11"]
    subprocess.run([compiler, *flags, *sources, "-o", str(target), "-lm"], check=True, capture_output=True)
    lib = ctypes.CDLL(str(target))
    lib.flags = flags
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.kvlab_quant_matmul.argtypes = [i32, p, i64, p, p, i64, i64, i64, i64, i32]
    lib.kvlab_quant_gated.argtypes = [p, p, i64, p, p, i64, i64, i32, i32]
    return lib


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_narrower_builds_give_this_machines_bits(portable, fmt):
    """The same integers and the same float operations per output, in the same order: equal bits
    (AMX tiles, VNNI, AVX2 and the plain loop alike), at 5 rows and at 40 (two tiles of 16 and 8 more)."""
    out, n = shapes(fmt)[1]
    part, _ = interleaved(fmt, out, n, seed=2)
    fid = quant._format_ids()[part.fmt]
    for rows in (5, 40):
        x = torch.randn(rows, n, generator=torch.Generator().manual_seed(rows))
        y = torch.empty(rows, out)
        assert portable.kvlab_quant_matmul(fid, part.data.data_ptr(), 0, x.data_ptr(), y.data_ptr(), rows, n, out, out, 2) == 0
        assert torch.equal(y, quant.packed_linear(x, [part], out)), rows


@needs_kernel
@pytest.mark.parametrize("fmts", [("Q4_0", "Q4_1"), ("Q5_0", "Q5_0"), ("Q8_0", "Q6_K"), ("Q5_K", "Q4_K")])
def test_the_narrower_builds_gated_passes_give_the_two_products_bits(portable, fmts):
    """A gated MLP's pass of a prompt's rows (kvlab_quant_gated) on a narrower build: AVX2's pairs of items
    (5-bit codes split once) give act(gate) · up with the bits of this machine's two products then
    gated_act; the plain C build has no such pass (−1: the MLP multiplies, then activates)."""
    from kvlab.kernels import gemv

    n, intermediate, rows = 256, 48, 70  # 70 rows: whole blocks of rows and a part-filled one
    gate, _ = interleaved(fmts[0], intermediate, n, seed=5)
    up, _ = interleaved(fmts[1], intermediate, n, seed=6)
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(7)) * 2
    # this machine's int8 bits, in passes of fewer rows than its bfloat16 tiles' (where it has them)
    both = torch.cat([quant.packed_linear(x[i : i + 35], [gate, up], 2 * intermediate) for i in (0, 35)])
    expected = gemv.gated_act(both[:, :intermediate], both[:, intermediate:], 0)
    ids = quant._format_ids()
    fmt = (ctypes.c_int * 2)(ids[gate.fmt], ids[up.fmt])
    data = (ctypes.c_void_p * 2)(gate.data.data_ptr(), up.data.data_ptr())
    y = torch.full((rows, intermediate), float("nan"))
    status = portable.kvlab_quant_gated(fmt, data, intermediate, x.data_ptr(), y.data_ptr(), rows, n, 0, 2)
    if "-mno-avx2" in portable.flags:
        assert status == -1
    else:
        assert status == 0 and torch.equal(y, expected), fmts


BF16_ROWS = quant.bf16_prompt_rows()
needs_bf16_tiles = pytest.mark.skipif(not BF16_ROWS, reason="no AMX tiles for bfloat16 here: every pass is int8")


def bf16(a: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (to nearest, ties to even), as float64."""
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).bfloat16().double().numpy()


@needs_kernel
@needs_bf16_tiles
@pytest.mark.parametrize("fmt", FORMATS)
def test_prompt_sized_passes_multiply_in_bfloat16_and_a_rows_bits_stand_alone(fmt):
    """From BF16_ROWS rows (AMX tiles for bfloat16): the weights and the activations rounded to bfloat16,
    summed in float32; 40, 200 and 584 outputs leave an item alone in its pair and part-filled ones, and
    584 (37 items) makes runs of 2 pairs on 2 threads, of 4 on one; a row's bits are the same in any pass
    of that size and on any threads, and not the int8 rows' numbers. Inputs of one chunk of K (256, see
    BF16_K_CHUNK) and of several (768: three; 544: two and a part), whose sums wait in memory between them."""
    for n, out in [(256, 40), (256, 200), (256, 584), (768 if fmt.endswith("K") else 544, 200)]:
        part, w = interleaved(fmt, out, n, seed=out)
        x = torch.randn(BF16_ROWS + 150, n, generator=torch.Generator().manual_seed(out)) * 3
        y = quant.packed_linear(x, [part], out, threads=2)
        ref = bf16(x.numpy()) @ bf16(w).T
        err = np.abs(y.double().numpy() - ref).max() / np.abs(ref).max()
        assert err <= 1e-5, (fmt, out, err)
        assert torch.equal(quant.packed_linear(x, [part], out, threads=1), y)
        assert torch.equal(quant.packed_linear(x[7 : 7 + BF16_ROWS], [part], out), y[7 : 7 + BF16_ROWS])
        int8_rows = quant.packed_linear(x[: BF16_ROWS - 1], [part], out)  # one row fewer: the int8 road
        assert not torch.equal(int8_rows, y[: BF16_ROWS - 1])
        exact = x.double().numpy() @ w.astype(np.float64).T
        assert np.abs(y.double().numpy() - exact).max() / np.abs(exact).max() < 0.02, (fmt, out)


GATED_ROWS = quant.gated_prompt_rows()


@needs_kernel
@pytest.mark.skipif(not GATED_ROWS, reason="no AMX tiles for bfloat16, vpdpbusd or AVX2 here: no gated pass")
@pytest.mark.parametrize("fmts", [("Q8_0", "Q8_0"), ("Q4_0", "Q4_1"), ("Q5_0", "Q5_0"), ("Q4_K", "Q6_K"), ("Q5_K", "Q4_K"),
                                  ("Q8_0", "Q6_K")])  # fmt: skip
@pytest.mark.parametrize("act", [0, 1])  # SiLU, GELU (tanh)
def test_a_gated_mlps_pass_takes_its_activation_as_the_sums_leave_with_the_two_products_bits(fmts, act):
    """gate and up in one pass (the bfloat16 tiles, vpdpbusd or AVX2), act(gate) · up as the sums leave the tiles
    or registers: bit for bit the two parts' product followed by gated_act, on any threads (208 outputs: 13
    pairs, runs of several; Q8_0 with Q6_K: x quantized apart for each); a row's bits are the same in any
    pass; passes of fewer rows and outputs in no whole items are left to the MLP (None)."""
    from kvlab.kernels import gemv

    for n, intermediate in [(256, 48), (256, 208), (768, 208)]:  # 768: three chunks of K
        gate, _ = interleaved(fmts[0], intermediate, n, seed=intermediate)
        up, _ = interleaved(fmts[1], intermediate, n, seed=intermediate + 1)
        x = torch.randn(GATED_ROWS + 50, n, generator=torch.Generator().manual_seed(intermediate)) * 2
        both = quant.packed_linear(x, [gate, up], 2 * intermediate, threads=2)  # one job, x rounded once
        apart = [quant.packed_linear(x, [p], intermediate, threads=2) for p in (gate, up)]
        assert torch.equal(both, torch.cat(apart, dim=1))
        expected = gemv.gated_act(both[:, :intermediate], both[:, intermediate:], act)
        fused = quant.gated_product(x, gate, up, act, threads=2)
        assert torch.equal(fused, expected), (fmts, act, intermediate)
        assert torch.equal(quant.gated_product(x, gate, up, act, threads=1), fused)
        assert torch.equal(quant.gated_product(x[5 : 5 + GATED_ROWS], gate, up, act), fused[5 : 5 + GATED_ROWS])
        assert quant.gated_product(x[: GATED_ROWS - 1], gate, up, act) is None
    odd, _ = interleaved(fmts[0], 40, n, seed=3)  # 2.5 items
    assert quant.gated_product(x, odd, odd, act) is None
