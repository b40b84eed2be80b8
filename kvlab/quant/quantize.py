"""Float weights → GGUF blocks, llama.cpp's rounding: `--quantization q8_0|q4_0` for float models.

    Q8_0: d = max|w| / 127 per 32 weights,   q = round(w / d)               (round half away from 0)
    Q4_0: d = w_m / -8 where w_m has the largest |w|,   q = min(15, trunc(w / d + 8.5))

They agree with the gguf package's numpy quantizers byte for byte (tests), in plain tensor ops on
any device.
"""

from __future__ import annotations

import torch

from kvlab.errors import KvlabError
from kvlab.quant.formats import FORMATS

QUANTIZATIONS = ("q8_0", "q4_0")  # the formats `--quantization` makes from float weights


def _fp16_bytes(d: torch.Tensor) -> torch.Tensor:
    """float32 [n, 1] → uint8 [n, 2]: the fp16 number's bytes."""
    return d.to(torch.float16).view(torch.uint8).reshape(-1, 2)


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    return torch.sign(x) * torch.floor(torch.abs(x) + 0.5)


def quantize_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """float32 [n, 32] → uint8 [n, 34]."""
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = _round_half_away(blocks * inv).to(torch.int8)
    return torch.cat([_fp16_bytes(d), q.view(torch.uint8)], dim=1)


def quantize_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    """float32 [n, 32] → uint8 [n, 18]."""
    at = blocks.abs().argmax(dim=1, keepdim=True)
    d = blocks.gather(1, at) / -8
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.trunc(blocks * inv + 8.5).clamp(0, 15).to(torch.uint8)
    packed = q[:, :16] | (q[:, 16:] << 4)
    return torch.cat([_fp16_bytes(d), packed], dim=1)


_QUANTIZERS = {"Q8_0": quantize_q8_0, "Q4_0": quantize_q4_0}


def quantize(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    """A float matrix [out, in] → its rows as blocks of `fmt`: uint8 [out, row bytes]."""
    name = fmt.upper()
    if name not in _QUANTIZERS:
        raise KvlabError(f"unknown --quantization {fmt!r}: kvlab makes {', '.join(QUANTIZATIONS)}")
    block = FORMATS[name]
    rows, cols = weight.shape
    if cols % block.block_values:
        raise KvlabError(f"{fmt} needs rows of whole blocks of {block.block_values} weights; this matrix has {cols}")
    blocks = weight.detach().float().reshape(-1, block.block_values)
    return _QUANTIZERS[name](blocks).reshape(rows, block.row_bytes(cols))
