"""Products with weights in GGUF block formats: the C kernels' Python side, with PyTorch fallbacks.

    applies(x, formats)              whether the C kernels take this call (a CPU pass, see ThreadPolicy)
    packed_linear(x, parts, out)     y [rows, out] float32 = x [rows, in] times every part's blocks
    dequantize(part)                 float32 [rows, in]: for products off the kernels (then BLAS)
    interleave(part, form)           the part's rows repacked 16 at a time: for 8-bit activations (form
                                     "x16": format "<fmt>x16") or for exact products on AMX bfloat16 tiles
                                     ("t16"), quant_i8.c; opt-in, see kvlab/quant/activations.py
    exact_tiles()                    whether this machine and build have those tiles

The kernels (`quant.c`) are compiled into the GEMV's library (`kernels/gemv.py` builds both at first
use) and share its thread pool. `packed_linear` reads each block once for all rows and writes every
part of a fused matrix into its own columns of one output. Both kernels compute with exactly the
reference's weight values (`kvlab.quant.formats`): `dequantize` returns its bits, and a product
differs from float32 math on the dequantized matrix only in the order of its sums. Where the library
is not built (no compiler), or for a format it lacks, `dequantize` is the reference and `applies` is
False. Only the CPU's ops call these (kvlab/backends/ops.py): the blocks and x are CPU tensors.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kvlab.kernels import gemv
from kvlab.kernels.policy import ThreadPolicy, current
from kvlab.quant.formats import FORMATS


def _library() -> dict[str, object]:
    """quant.c's bound functions, {} where the library could not be built."""
    gemv._ensure_loaded()
    return gemv._quant


@functools.cache
def _format_ids() -> dict[str, int]:
    """Format name → the C kernels' id, for every format whose block size both sides agree on."""
    lib = _library()
    if not lib:
        return {}
    ids, values, size = {}, ctypes.c_int(), ctypes.c_int()
    for i in range(64):
        name = lib["format"](i, ctypes.byref(values), ctypes.byref(size))
        if name is None:
            break
        fmt = FORMATS.get(name.decode())
        if fmt is not None and (fmt.block_values, fmt.block_bytes) == (values.value, size.value):
            ids[fmt.name] = i
        elif is_interleaved(name.decode()) and source_format(name.decode()) in ids:
            ids[name.decode()] = i  # its layout is the C side's alone: sized by kvlab_quant_interleave
    return ids


INTERLEAVED = "x16"  # the suffix of a format's interleaved form for int8 activations: "Q4_1x16"
TILED = "t16"  # the same bytes multiplied exactly on AMX bfloat16 tiles: "Q4_1t16"


def is_interleaved(fmt: str) -> bool:
    return fmt.endswith((INTERLEAVED, TILED))


def source_format(fmt: str) -> str:
    """The GGUF format an interleaved one was repacked from: "Q4_1x16" → "Q4_1"."""
    for suffix in (INTERLEAVED, TILED):
        if fmt.endswith(suffix):
            return fmt[: -len(suffix)]
    return fmt


def exact_tiles() -> bool:
    """Whether this build and machine multiply the "t16" forms: AMX tiles for bfloat16, granted by the OS."""
    lib = _library()
    return bool(lib) and bool(lib["t16_available"]())


def available() -> bool:
    """Whether the C kernels for block formats are built and loaded on this machine."""
    return bool(_format_ids())


def _intel_cpu() -> bool:
    """Whether this is an Intel CPU (/proc/cpuinfo's vendor_id), where PyTorch's BLAS (MKL) runs its own
    AVX-512 GEMM."""
    try:
        with open("/proc/cpuinfo", errors="ignore") as f:
            return any(line.startswith("vendor_id") and "GenuineIntel" in line for line in f)
    except OSError:
        return False


# Prompt-sized passes the tiles take, by the build's exact path: above this many rows, dequantizing the
# matrix for BLAS wins. AVX2 tiles (4 × 2 registers) win at 64 rows (1.2-2.6×) but not at 256-512
# (0.6-0.9×: 8960 × 1536 Q4_K, 1536 × 8960 Q6_K, 1536 × 576 Q4_1, 2 threads, side by side). AVX-512
# tiles beat BLAS at every chunk measured (64-512 rows) on the machine of 2026-12-02, but not on an
# Intel Xeon with MKL's AVX-512 GEMM (2026-12-03): a 1,024-token prefill through BLAS was 1.56× the
# tiles' on SmolLM2, 1.20× on Qwen2.5-Coder-0.5B, 1.15× on the 1.5B, 1.57× on Gemma 3 270M (the tiles
# still won at 32-64 rows of the 1.5B's matrices). So on Intel the AVX-512 build stops at 128 too.
PROMPT_TILE_ROWS = {"avx2": 128, **({"avx512": 128} if _intel_cpu() else {})}


@functools.cache
def isa() -> str:
    """The exact product this build has: "avx512", "avx2" or "portable" ("" without the library)."""
    lib = _library()
    return lib["isa"]().decode() if lib else ""


@functools.cache
def bf16_prompt_rows() -> int:
    """The rows from which the interleaved (`--activation-quant int8`) products go in bfloat16 on AMX
    tiles rather than int8 (kernels/quant_i8.c's BF16_ROWS); 0 where this machine or build has no such
    tiles."""
    lib = _library()
    return int(lib["bf16_rows"]()) if lib else 0


@functools.cache
def gated_prompt_rows() -> int:
    """The rows from which a gated MLP's interleaved gate and up and its activation go as one pass
    (`gated_product`): bf16_prompt_rows() on AMX tiles for bfloat16, else a prompt's passes on vpdpbusd or
    AVX2 (kernels/quant_i8.c's GATED_ROWS); 0 where this machine or build has none of them."""
    lib = _library()
    return int(lib["gated_rows"]()) if lib else 0


def applies(x: torch.Tensor, formats: list[str], whole: bool = True) -> bool:
    """Whether packed_linear takes x [rows, in] with parts in `formats`: a pass the thread policy in
    force gives the block kernels (any size by default: see ThreadPolicy.packed_prompts, up to
    PROMPT_TILE_ROWS where the build's tiles lose to BLAS), every format one the C kernels know.
    whole=False: x's rows are not one product's (a mixture's prompt, shared out among its experts)."""
    if x.dim() != 2:
        return False
    ids = _format_ids()
    if any(is_interleaved(f) for f in formats):  # no float copy to fall back on: every pass, any size
        return all(f in ids for f in formats)
    return tiles_take(x.shape[0], whole=whole) and bool(ids) and all(f in ids for f in formats)


def tiles_take(num_rows: int, policy: ThreadPolicy | None = None, whole: bool = True) -> bool:
    """Whether a pass of `num_rows` rows over GGUF blocks runs its products on the block kernels (their
    pool's threads) under `policy` (by default the one in force), rather than dequantizing for BLAS."""
    fits = not whole or num_rows <= PROMPT_TILE_ROWS.get(isa(), num_rows)
    return fits and (policy or current()).packed_sized(num_rows)


def pool_takes(num_rows: int, formats, policy: ThreadPolicy | None = None) -> bool:
    """Whether every product of a pass of `num_rows` rows over matrices in `formats` runs on the block
    kernels (their pool's threads): the interleaved forms take every pass (`applies`); the exact blocks
    as `tiles_take` says."""
    return all(is_interleaved(f) for f in formats) or tiles_take(num_rows, policy)


def packed_linear(x: torch.Tensor, parts, out_features: int, threads: int | None = None) -> torch.Tensor:
    """y [rows, out_features] float32 = x [rows, in] · Wᵀ, W the parts (PackedTensor) stacked by rows.

    Each part is written into its own columns of y. threads: the kernels' pool threads (None: the
    thread policy in force). No bias: the caller adds it.
    """
    ids, lib = _format_ids(), _library()
    rows, in_features = x.shape
    threads = _threads(threads)
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = x.float().contiguous()
    if sum(p.shape[0] for p in parts) != out_features:
        raise ValueError(f"packed_linear: parts of {[p.shape[0] for p in parts]} rows do not make {out_features}")
    y = torch.empty(rows, out_features)
    if len(parts) > 1 and rows:  # a fused matrix's parts as one dispatch of the pool
        _matmul_parts(lib, [ids[p.fmt] for p in parts], [_checked_blocks(p, in_features) for p in parts], parts,
                      x, y, threads)  # fmt: skip
        return y
    column = 0
    for part in parts:
        data = _checked_blocks(part, in_features)
        if rows and part.shape[0]:
            status = lib["matmul"](ids[part.fmt], data.data_ptr(), data.stride(0), x.data_ptr(),
                                   y.data_ptr() + 4 * column, rows, in_features, out_features, part.shape[0],
                                   threads)  # fmt: skip
            if status != 0:
                raise ValueError(f"packed_linear: the C kernel refused a {part.fmt} matrix {list(part.shape)}")
        column += part.shape[0]
    return y


def _matmul_parts(lib, fmts: list[int], data: list[torch.Tensor], parts, x: torch.Tensor, y: torch.Tensor,
                  threads: int) -> None:
    """y [rows, Σ part rows] ← x · the parts stacked (kvlab_quant_matmul_parts: one pool job for all)."""
    n = len(parts)
    status = lib["matmul_parts"](n, (ctypes.c_int * n)(*fmts), (ctypes.c_void_p * n)(*[d.data_ptr() for d in data]),
                                 (ctypes.c_int64 * n)(*[d.stride(0) for d in data]),
                                 (ctypes.c_int64 * n)(*[p.shape[0] for p in parts]), x.data_ptr(), y.data_ptr(),
                                 x.shape[0], x.shape[1], y.shape[1], threads)  # fmt: skip
    if status != 0:
        raise ValueError(f"packed_linear: the C kernel refused {[p.fmt for p in parts]} matrices of "
                         f"{[list(p.shape) for p in parts]}")  # fmt: skip


def gated_product(x: torch.Tensor, gate, up, activation_id: int, threads: int | None = None) -> torch.Tensor | None:
    """A gated MLP's act(x · gateᵀ) · (x · upᵀ) [rows, I] float32, gate and up (PackedTensor) in interleaved
    formats, in one pass where it takes the call (gated_prompt_rows() rows or more, I in whole items of 16):
    on AMX tiles for bfloat16, or on vpdpbusd or AVX2 with only the activation written out; the bits of
    packed_linear over both parts, then gemv.gated_act. None where it does not: the caller multiplies,
    then activates."""
    ids, lib, least = _format_ids(), _library(), gated_prompt_rows()
    rows, in_features = x.shape
    I = gate.shape[0]
    if not lib or not least or rows < least or up.shape[0] != I:
        return None
    if any(not is_interleaved(p.fmt) or p.fmt not in ids for p in (gate, up)):
        return None
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = x.float().contiguous()
    fmts = (ctypes.c_int * 2)(ids[gate.fmt], ids[up.fmt])
    data = [_checked_blocks(p, in_features) for p in (gate, up)]
    y = torch.empty(rows, I)
    status = lib["gated"](fmts, (ctypes.c_void_p * 2)(*[d.data_ptr() for d in data]), I, x.data_ptr(), y.data_ptr(),
                          rows, in_features, activation_id, _threads(threads))  # fmt: skip
    return y if status == 0 else None  # −2, no memory: None as well, and the two products then say it themselves


def dequantize(part, threads: int | None = None) -> torch.Tensor:
    """The part's weights as float32 [rows, in], bit for bit the reference dequantization's."""
    ids = _format_ids()
    if part.fmt not in ids:
        return part.dequantize()
    rows, in_features = part.shape
    data = _checked_blocks(part, in_features)
    y = torch.empty(rows, in_features)
    if rows and in_features:
        status = _library()["dequantize"](ids[part.fmt], data.data_ptr(), data.stride(0), y.data_ptr(),
                                          in_features, rows, in_features, _threads(threads))  # fmt: skip
        if status != 0:
            raise ValueError(f"dequantize: the C kernel refused a {part.fmt} matrix {list(part.shape)}")
    return y


def interleave(part, form: str = INTERLEAVED, empty=torch.empty) -> tuple[str, torch.Tensor] | None:
    """The part (a PackedTensor of a GGUF block format) repacked 16 rows at a time: its format "<fmt>x16"
    (8-bit activations) or "<fmt>t16" (exact, on bfloat16 tiles: the same bytes) and bytes, uint8 [items,
    item bytes] (quant_i8.c), in memory from `empty(shape, dtype=)` (model/huge_pages.py's HugeArena at
    load). None where its format has no interleaved form or the kernels are not built."""
    ids, lib = _format_ids(), _library()
    target = part.fmt + form
    if part.fmt not in ids or target not in ids:
        return None
    rows, in_features = part.shape
    data = _checked_blocks(part, in_features)
    size = lib["interleave"](ids[part.fmt], data.data_ptr(), data.stride(0), rows, in_features, None)
    items = -(-rows // 16)
    if size < 0 or items == 0:
        return None
    out = empty((items, size // items), dtype=torch.uint8)
    if lib["interleave"](ids[part.fmt], data.data_ptr(), data.stride(0), rows, in_features, out.data_ptr()) != size:
        return None
    return target, out


def _threads(threads: int | None) -> int:
    threads = threads or current().threads
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    return threads


def _checked_blocks(part, in_features: int) -> torch.Tensor:
    """The part's bytes as the C kernel reads them: uint8 [rows, row bytes], each row contiguous.

    The kernels trust these sizes, so every mismatch is an error here rather than a read out of bounds."""
    rows, cols = part.shape
    data = part.data
    if cols != in_features:
        raise ValueError(f"a {part.fmt} part of {cols} inputs cannot take x of {in_features}")
    if is_interleaved(part.fmt):  # items of 16 rows, sized by the C side
        size = _library()["interleave"](_format_ids()[source_format(part.fmt)], 0, 0, rows, cols, None)
        if data.dtype != torch.uint8 or not data.is_contiguous() or data.numel() != size:
            raise ValueError(f"a {part.fmt} part {list(part.shape)} needs {size} contiguous bytes, got "
                             f"{data.dtype} {list(data.shape)}")  # fmt: skip
        return data
    row_bytes = part.format.row_bytes(cols)  # raises unless rows hold whole blocks
    if data.dtype != torch.uint8 or data.dim() != 2 or tuple(data.shape) != (rows, row_bytes):
        raise ValueError(f"a {part.fmt} part {list(part.shape)} needs uint8 [{rows}, {row_bytes}], got "
                         f"{data.dtype} {list(data.shape)}")  # fmt: skip
    if data.stride(1) != 1:
        data = data.contiguous()
    return data
