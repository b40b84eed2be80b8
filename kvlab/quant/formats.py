"""Block formats of GGUF weights, as stored, and their reference dequantization in PyTorch.

A quantized matrix [out, in] is kept as its file's bytes, uint8 [out, in / block_values × block_bytes]:
each row a run of blocks, each block `block_values` weights and their scales. The C kernels read
these bytes directly (kvlab/kernels/quant.c); the functions here turn them into float32 with plain
tensor ops on any device. They follow ggml's arithmetic in float32, operation for operation, so that
they agree with the `gguf` package's numpy dequantization (the tests' oracle) bit for bit.

    Q8_0   32 values, 34 B: fp16 d, int8 q[32]                           w = d·q
    Q4_0   32 values, 18 B: fp16 d, 16 B of nibbles                      w = d·(q − 8)
    Q4_1   32 values, 20 B: fp16 d, fp16 m, 16 B of nibbles              w = d·q + m
    Q5_0   32 values, 22 B: fp16 d, 4 B of fifth bits, 16 B of nibbles   w = d·(q − 16)
    Q4_K  256 values, 144 B: fp16 d, dmin, 12 B of 6-bit scales and mins for 8 groups of 32, nibbles
                                                                         w = (d·sc)·q − dmin·m
    Q5_K  256 values, 176 B: as Q4_K plus 32 B of fifth bits
    Q6_K  256 values, 210 B: 128 B low nibbles, 64 B high 2-bit pairs, int8 scales for 16 groups
                             of 16, fp16 d                               w = (d·sc)·(q − 32)
    MXFP4  32 values, 17 B: E8M0 exponent e, 16 B of FP4 (E2M1) nibbles  w = 2^(e − 127) · fp4(q)
                             (gpt-oss's experts; its C kernel is kernels/mxfp4.c)

In the 32-value formats byte j holds weight j in its low nibble and weight j + 16 in its high one.
Plain F32, F16 and BF16 matrices are formats of one value per "block", so every stored matrix goes
through the same packed linear layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

QK_K = 256  # values in a K-quant super-block


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 number at byte `at` of every block, as float32 [n, 1]."""
    return blocks[:, at : at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """uint8 [n, k] → [n, 2k]: the k low nibbles, then the k high ones."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _bits(packed: torch.Tensor, count: int) -> torch.Tensor:
    """uint8 [n, count / 8] little-endian bit fields → uint8 [n, count] of 0 and 1."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed[:, :, None] >> shifts) & 1).reshape(packed.shape[0], count)


def dequantize_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    q = blocks[:, 2:].contiguous().view(torch.int8).float()
    return q * d


def dequantize_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    q = _nibbles(blocks[:, 2:]).to(torch.int8) - 8
    return d * q.float()


def dequantize_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    return d * _nibbles(blocks[:, 4:]).float() + m


def dequantize_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    high = _bits(blocks[:, 2:6], 32)  # bit j of the little-endian uint32 is weight j's fifth bit
    q = (_nibbles(blocks[:, 6:]) | (high << 4)).to(torch.int8) - 16
    return d * q.float()


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 bytes per super-block → 6-bit scale and min of each of its 8 groups, uint8 [n, 8] each.

    Bytes 0-3 hold scales 0-3 (low 6 bits), 4-7 mins 0-3; groups 4-7 take their low 4 bits from
    bytes 8-11 (scale low nibble, min high nibble) and their top 2 bits from the top of bytes 0-7."""
    lo, hi, mixed = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([lo & 0x3F, (mixed & 0x0F) | ((lo >> 2) & 0x30)], dim=1)
    mn = torch.cat([hi & 0x3F, (mixed >> 4) | ((hi >> 2) & 0x30)], dim=1)
    return sc, mn


def _k_groups(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(d·sc)·q − dmin·m over the 8 groups of 32 of each super-block; q [n, 256] codes."""
    n = blocks.shape[0]
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _k_scales(blocks[:, 4:16])
    scale = (d * sc.float())[:, :, None]  # [n, 8, 1]
    offset = (dmin * mn.float())[:, :, None]
    return (scale * q.view(n, 8, 32).float() - offset).reshape(n, QK_K)


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """128 B → 256 codes: each 32-byte chunk holds group 2i in its low nibbles, group 2i + 1 in the high."""
    n = qs.shape[0]
    chunks = qs.view(n, 4, 1, 32)
    return torch.cat([chunks & 0x0F, chunks >> 4], dim=2).reshape(n, QK_K)


def dequantize_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    return _k_groups(blocks, _k_nibbles(blocks[:, 16:144]))


def dequantize_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    qh = blocks[:, 16:48]  # bit i of byte l is the fifth bit of weight l of group i
    shifts = torch.arange(8, dtype=torch.uint8, device=blocks.device)
    high = ((qh[:, None, :] >> shifts[None, :, None]) & 1).reshape(n, QK_K)
    return _k_groups(blocks, _k_nibbles(blocks[:, 48:176]) | (high << 4))


def dequantize_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    ql, qh = blocks[:, 0:128], blocks[:, 128:192]
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()  # one per group of 16
    d = _f16(blocks, 208)
    # weight 128h + 32t + l: low nibble t // 2 of ql[64h + 32(t % 2) + l], high bits t of qh[32h + l]
    low = ql.view(n, 2, 1, 64)
    low = torch.cat([low & 0x0F, low >> 4], dim=2).reshape(n, 2, 4, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=blocks.device)
    high = (qh.view(n, 2, 1, 32) >> shifts[None, None, :, None]) & 0x03
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    return ((d * scales)[:, :, None] * q).reshape(n, QK_K)


# FP4 (E2M1) codes doubled, as ggml keeps them (kvalues_mxfp4): the scale is then halved, 2^(e − 128)
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def mxfp4_half_scale(e: torch.Tensor) -> torch.Tensor:
    """E8M0 exponents (uint8) → 2^(e − 128) as float32, built from its bits as ggml does (e < 2: subnormal)."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, torch.tensor(0x00200000, dtype=torch.int32) << e, (e - 1) << 23)
    return bits.view(torch.float32)


def dequantize_mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    d = mxfp4_half_scale(blocks[:, 0:1])  # [n, 1]
    table = torch.tensor(MXFP4_VALUES, dtype=torch.float32, device=blocks.device)
    return d * table[_nibbles(blocks[:, 1:17]).long()]


@dataclass(frozen=True)
class BlockFormat:
    """One GGUF block type: its size and its reference dequantization."""

    name: str  # the GGML type name: Q4_K, Q8_0, ...
    block_values: int
    block_bytes: int
    dequantize_blocks: Callable[[torch.Tensor], torch.Tensor]  # uint8 [n, block_bytes] → float32 [n, values]

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.block_bytes / self.block_values

    def row_bytes(self, in_features: int) -> int:
        if in_features % self.block_values:
            raise ValueError(f"{self.name} rows hold whole blocks of {self.block_values}; {in_features} is not one")
        return in_features // self.block_values * self.block_bytes

    @property
    def is_plain(self) -> bool:
        """One number per block: a float matrix (F32, F16, BF16), not a quantized one."""
        return self.block_values == 1

    def dequantize(self, packed: torch.Tensor, in_features: int) -> torch.Tensor:
        """uint8 [rows, row bytes] → float32 [rows, in_features]."""
        rows = packed.shape[0]
        blocks = packed.reshape(-1, self.block_bytes)
        return self.dequantize_blocks(blocks).reshape(rows, in_features)


def _plain(dtype: torch.dtype):
    return lambda blocks: blocks.contiguous().view(dtype).float()


FORMATS: dict[str, BlockFormat] = {
    f.name: f
    for f in (
        BlockFormat("F32", 1, 4, _plain(torch.float32)),
        BlockFormat("F16", 1, 2, _plain(torch.float16)),
        BlockFormat("BF16", 1, 2, _plain(torch.bfloat16)),
        BlockFormat("Q8_0", 32, 34, dequantize_q8_0),
        BlockFormat("Q4_0", 32, 18, dequantize_q4_0),
        BlockFormat("Q4_1", 32, 20, dequantize_q4_1),
        BlockFormat("Q5_0", 32, 22, dequantize_q5_0),
        BlockFormat("Q4_K", QK_K, 144, dequantize_q4_k),
        BlockFormat("Q5_K", QK_K, 176, dequantize_q5_k),
        BlockFormat("Q6_K", QK_K, 210, dequantize_q6_k),
        BlockFormat("MXFP4", 32, 17, dequantize_mxfp4),
    )
}
