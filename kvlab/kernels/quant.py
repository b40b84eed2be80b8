"""Products with weights in GGUF block formats: the C kernels' Python side, with PyTorch fallbacks.

    applies(x, formats)              whether the C kernels take this call (decode-sized rows on a CPU)
    packed_linear(x, parts, out)     y [rows, out] float32 = x [rows, in] times every part's blocks
    dequantize(part)                 float32 [rows, in]: for prompt-sized products (then BLAS)

Until the C kernels are built (kvlab/kernels/quant.c), `applies` is False and `dequantize` is the
reference dequantization of kvlab.quant.formats.
"""

from __future__ import annotations

import torch


def available() -> bool:
    """Whether the C kernels for block formats are built and enabled on this machine."""
    return False


def applies(x: torch.Tensor, formats: list[str]) -> bool:
    return False


def packed_linear(x: torch.Tensor, parts, out_features: int) -> torch.Tensor:
    raise NotImplementedError("the C kernels for block formats are not built")


def dequantize(part) -> torch.Tensor:
    return part.dequantize()
