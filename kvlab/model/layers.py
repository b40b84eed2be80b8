"""Building blocks of the decoder: RMSNorm, a linear layer with a fast small-batch path, SwiGLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvlab.kernels import linear
from kvlab.kernels.gemv import MAX_ROWS, rms_norm, small_ops_apply


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) · weight, computed in float32 whatever the activations' dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if small_ops_apply(x, x.numel() // x.shape[-1]) and self.weight.dtype == torch.float32:  # decode: one C call
            return rms_norm(x, self.weight, self.eps)
        # written out: 5 small kernels, where F.rms_norm's CPU path dispatches about 15
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)  # 16-bit: round, then scale (transformers' order)


class Linear(nn.Module):
    """y = x Wᵀ (+ b). W [out, in] as in the checkpoints.

    Goes through `kvlab.kernels.linear`, which streams the weights with a GEMV kernel when only a few
    rows come in on a CPU (decode) and uses the BLAS matmul otherwise (prefill, CUDA).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) · up(x)), with gate and up fused into one [2·I, hidden] matrix."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size)
        self.down_proj = Linear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        I = self.intermediate_size
        if x.device.type == "cpu" and x.numel() // x.shape[-1] > MAX_ROWS:
            # a prompt on a CPU: two BLAS products over the halves of the matrix ran 4-7% faster than
            # one twice as wide (SmolLM2, 256 and 1,024 tokens, measured side by side)
            w = self.gate_up_proj.weight
            gate, up = F.linear(x, w[:I]), F.linear(x, w[I:])
        else:  # decode: one streaming pass over the whole matrix
            gate, up = self.gate_up_proj(x).split(I, dim=-1)  # [B, T, I] each
        return self.down_proj(F.silu(gate) * up)
