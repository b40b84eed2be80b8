"""MXFP4 blocks (gpt-oss's experts): mxfp4.c's Python side, with the reference as the fallback.

    applies(x)                 whether matmul takes x [rows, in] (decode-sized rows, library built: the CPU's ops ask)
    matmul(x, part)            y [rows, out] float32 = x · Wᵀ, W a PackedTensor in MXFP4, every block read once
    dequantize(part)           float32 [out, in], bit for bit kvlab.quant.formats' (for prompt-sized products)

mxfp4.c is compiled into the kernels' one library (kernels/gemv.py) and runs on its thread pool.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kvlab.kernels import gemv
from kvlab.kernels.policy import current
from kvlab.quant.formats import FORMATS

MAX_ROWS = 64  # mxfp4.c's MXFP4_MAX_ROWS


@functools.cache
def _library() -> dict[str, object] | None:
    """mxfp4.c's bound functions, or None where the library is not built or its block disagrees with ours."""
    gemv._ensure_loaded()
    lib = gemv._state.get("lib")
    if lib is None:
        return None
    int64, pointer = ctypes.c_int64, ctypes.c_void_p
    fns = {
        "block": gemv._bind(lib, "kvlab_mxfp4_block", [ctypes.POINTER(ctypes.c_int)] * 2),
        "dequantize": gemv._bind(lib, "kvlab_mxfp4_dequantize", [pointer, int64, pointer, int64, int64, int64, ctypes.c_int],
                                 ctypes.c_int),
        "matmul": gemv._bind(lib, "kvlab_mxfp4_matmul", [pointer, int64, pointer, int64, pointer, int64] + [int64] * 3
                             + [ctypes.c_int], ctypes.c_int),
    }  # fmt: skip
    values, size = ctypes.c_int(), ctypes.c_int()
    fns["block"](ctypes.byref(values), ctypes.byref(size))
    fmt = FORMATS["MXFP4"]
    return fns if (values.value, size.value) == (fmt.block_values, fmt.block_bytes) else None


def available() -> bool:
    return _library() is not None


def applies(x: torch.Tensor) -> bool:
    rows = x.shape[0] if x.dim() == 2 else 0
    return x.dim() == 2 and rows <= MAX_ROWS and current().kernel_sized(rows) and available()


def _blocks(part) -> torch.Tensor:
    data = part.data
    if data.dtype != torch.uint8 or data.device.type != "cpu" or data.stride(-1) != 1:
        raise ValueError("mxfp4: the blocks must be uint8 rows on the CPU")
    if data.shape[1] != FORMATS["MXFP4"].row_bytes(part.shape[1]):
        raise ValueError(f"mxfp4: rows of {data.shape[1]} bytes do not hold {part.shape[1]} weights")
    return data


def matmul(x: torch.Tensor, part, threads: int | None = None) -> torch.Tensor:
    """y [rows, out] float32 = x [rows, in] · Wᵀ (W: `part`, a PackedTensor in MXFP4 [out, in])."""
    out_features, in_features = part.shape
    data = _blocks(part)
    x = x.float().contiguous()
    y = torch.empty(x.shape[0], out_features)
    status = _library()["matmul"](data.data_ptr(), data.stride(0), x.data_ptr(), in_features, y.data_ptr(),
                                  out_features, x.shape[0], out_features, in_features, threads or current().threads)  # fmt: skip
    if status:
        raise ValueError(f"mxfp4: the C kernel refused x {list(x.shape)} times a {list(part.shape)} matrix")
    return y


def dequantize(part, threads: int | None = None) -> torch.Tensor:
    """The part's weights as float32 [out, in], the reference's bits (the reference itself without the library)."""
    if not available():
        return part.dequantize()
    out_features, in_features = part.shape
    data = _blocks(part)
    y = torch.empty(out_features, in_features)
    status = _library()["dequantize"](data.data_ptr(), data.stride(0), y.data_ptr(), in_features, out_features,
                                      in_features, threads or current().threads)  # fmt: skip
    if status:
        raise ValueError(f"mxfp4: the C kernel refused a {list(part.shape)} matrix")
    return y
