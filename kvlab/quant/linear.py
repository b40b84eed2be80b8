"""Linear and embedding layers whose weights stay in the file's block formats.

    PackedLinear     y = x Wᵀ (+ b), W kept as uint8 blocks, one part per fused matrix (q, k, v may
                     each have their own format: a Q4_K_M file mixes Q5_0, Q6_K and Q8_0)
    PackedEmbedding  the token table in blocks; a lookup dequantizes only the rows it reads

They implement the linear layer's seam (`forward`, `forward_parts`, `nbytes`,
`bytes_read_per_token`, `macs_per_token`), so the model, the roofline and the memory plan use them
as they use `kvlab.model.layers.Linear`. Which code multiplies is the device's ops' say
(kvlab/backends/ops.py). On a CPU a pass goes to the C kernels, which read the blocks directly (`kvlab.kernels.quant`: one block decoded once for up to 32 rows), up to the build's
`quant.PROMPT_TILE_ROWS` (AVX2, and AVX-512 on Intel where MKL's GEMM wins: 128 rows) past which the
matrix is dequantized for BLAS; `ThreadPolicy.packed_prompts=False` sends every prompt-sized pass to
BLAS; anywhere the C kernels are not (CUDA, no compiler) the reference
dequantization in `kvlab.quant.formats` serves every call. With `--activation-quant int8` the parts
are held interleaved (format "<fmt>x16", kvlab/quant/activations.py) and every pass takes the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvlab.backends.ops import current_ops
from kvlab.quant.formats import FORMATS, BlockFormat


@dataclass
class PackedTensor:
    """A stored matrix as it comes from a checkpoint: its format, shape and bytes."""

    fmt: str  # a kvlab.quant.formats name: Q4_K, Q8_0, F16, ...
    shape: tuple[int, int]  # [rows, in_features] in weights
    data: torch.Tensor  # uint8 [rows, row bytes]

    @property
    def format(self) -> BlockFormat:
        return FORMATS[self.fmt]

    def dequantize(self) -> torch.Tensor:
        return self.format.dequantize(self.data, self.shape[1])


def packed_product(x: torch.Tensor, parts: list[PackedTensor]) -> torch.Tensor:
    """x [rows, in] times the parts stacked by rows → float32 [rows, Σ part rows]: the device's block
    kernels when they take the call (on a CPU: quant.c's, for decode-sized rows in their formats), else
    part by part (`part_product`)."""
    ops = current_ops()
    if ops.packed_applies(x, [p.fmt for p in parts]):
        return ops.packed_linear(x, parts, sum(p.shape[0] for p in parts))
    return torch.cat([part_product(x, p) for p in parts], dim=-1)


def part_product(x: torch.Tensor, part: PackedTensor) -> torch.Tensor:
    """x [rows, in] · Wᵀ for one stored matrix, float32: MXFP4 by its own kernel (kernels/mxfp4.c) when
    decode-sized; otherwise the matrix dequantized to float32 (C, or the reference), then one BLAS product."""
    ops = current_ops()
    if part.fmt == "MXFP4" and ops.mxfp4_applies(x):
        return ops.mxfp4_matmul(x, part)
    return F.linear(x.float(), ops.dequantize(part))


class PackedLinear(nn.Module):
    """y = x Wᵀ (+ b) with W [out, in] in stored blocks; `parts` stacks the matrices a fused layer holds."""

    def __init__(self, parts: list[PackedTensor], bias: torch.Tensor | None = None):
        super().__init__()
        in_features = {p.shape[1] for p in parts}
        if len(in_features) != 1:
            raise ValueError(f"the parts of a fused matrix must share their input size, got {sorted(in_features)}")
        self.in_features = in_features.pop()
        self.formats = [p.fmt for p in parts]
        self.parts = tuple(p.shape[0] for p in parts)  # output sizes, as Linear.parts
        self.out_features = sum(self.parts)
        for i, p in enumerate(parts):
            self.register_buffer(f"packed_{i}", p.data, persistent=False)
        self.bias = bias if bias is None or isinstance(bias, nn.Parameter) else nn.Parameter(bias, requires_grad=False)

    def packed(self) -> list[PackedTensor]:
        return [
            PackedTensor(fmt, (rows, self.in_features), getattr(self, f"packed_{i}"))
            for i, (fmt, rows) in enumerate(zip(self.formats, self.parts))
        ]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, parts={list(zip(self.formats, self.parts))}, bias={self.bias is not None}"

    # ---- the product ------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, rows = x.shape[:-1], x.numel() // self.in_features
        x2 = x.reshape(rows, self.in_features)
        ops = current_ops()
        if ops.packed_applies(x2, self.formats):
            y = ops.packed_linear(x2, self.packed(), self.out_features)
        else:
            y = torch.cat([self._dense_product(x2, p) for p in self.packed()], dim=-1)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(x.dtype).view(*lead, self.out_features)

    def _dense_product(self, x: torch.Tensor, part: PackedTensor) -> torch.Tensor:
        """A prompt-sized pass (or no C kernel for the whole call): one part's product (`part_product`)."""
        return part_product(x, part)

    def forward_parts(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self(x).split(self.parts, dim=-1)

    def gated(self, x: torch.Tensor, activation_id: int) -> torch.Tensor | None:
        """act(gate) · up of this fused [gate; up] layer in one pass where the device has one (a GatedMLP's;
        `activation_id` kernels.decode's), the bits of forward_parts then the MLP's activation; else None."""
        if self.bias is not None or len(self.parts) != 2:
            return None
        return current_ops().gated_product(x, self.packed(), activation_id)

    # ---- what it costs ----------------------------------------------------------------------------

    def weight_tensors(self) -> list[torch.Tensor]:
        return [p.data for p in self.packed()] + ([self.bias] if self.bias is not None else [])

    def nbytes(self) -> int:
        """Bytes held: the blocks as stored (scales included) and the bias."""
        return sum(t.numel() * t.element_size() for t in self.weight_tensors())

    def bytes_read_per_token(self) -> int:
        return self.nbytes()

    @property
    def macs_per_token(self) -> int:
        return self.in_features * self.out_features


class PackedEmbedding(nn.Module):
    """The token table [vocab, hidden] in stored blocks; a lookup reads and dequantizes its rows only."""

    def __init__(self, table: PackedTensor, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.fmt, self.shape, self.out_dtype = table.fmt, table.shape, dtype
        self.register_buffer("packed_0", table.data, persistent=False)

    def table(self) -> PackedTensor:
        return PackedTensor(self.fmt, self.shape, self.packed_0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.packed_0.index_select(0, ids.reshape(-1))  # [n, row bytes]
        # the device's dequantization, bit for bit the reference's (on a CPU the C kernels': a decode step's
        # row in 48 us inside a step against the reference's 88; SmolLM2, a Zen 3 VM)
        values = current_ops().dequantize(PackedTensor(self.fmt, (rows.shape[0], self.shape[1]), rows))
        return values.to(self.out_dtype).view(*ids.shape, self.shape[1])

    def weight_tensors(self) -> list[torch.Tensor]:
        return [self.packed_0]

    def nbytes(self) -> int:
        return self.packed_0.numel()

    def bytes_read_per_token(self) -> int:
        return self.packed_0.shape[1]

    def as_linear(self) -> PackedLinear:
        """The same blocks as an LM head (tied embeddings: one table serves both)."""
        return PackedLinear([self.table()])
