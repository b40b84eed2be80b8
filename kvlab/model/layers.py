"""Building blocks of the decoder: RMSNorm (Llama's, Gemma's), the embedding table, the linear layer,
the gated MLPs (SwiGLU, GeGLU).

The linear layer is a seam: every product with a weight matrix goes through one (never a slice of its
weight taken from outside), and each weight-holding layer lists its tensors (`weight_tensors`) and
reports the bytes it holds and the bytes a token's pass reads from it, so the model's weight bytes,
the roofline and the memory plan ask the layers, not `parameters()`. Weights kept in their stored
block formats are other implementations of the same methods (`kvlab.quant.linear`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvlab.backends.ops import current_ops
from kvlab.kernels.decode import activation_ids
from kvlab.kernels.gemv import gated_act, rms_norm


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) · weight, computed in float32 whatever the activations' dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if current_ops().small_ops(x, x.numel() // x.shape[-1]) and self.weight.dtype == torch.float32:  # decode: C
            return rms_norm(x, self.weight, self.eps)
        # written out: 5 small kernels, where F.rms_norm's CPU path dispatches about 15
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)  # 16-bit: round, then scale (transformers' order)

    def weight_tensors(self) -> list[torch.Tensor]:
        return [self.weight]

    def nbytes(self) -> int:
        return tensor_bytes(self.weight)

    def bytes_read_per_token(self) -> int:
        return self.nbytes()


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: x̂ · (offset + w), all in float32, rounded to the activations' dtype once.

    Gemma's own checkpoints store w − 1 (offset 1.0); llama.cpp's converter already added the 1 to the
    GGUF's norm weights (offset 0.0: x̂ · w).
    """

    def __init__(self, dim: int, eps: float, offset: float):
        super().__init__(dim, eps)
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.offset == 0.0 and x.dtype == torch.float32:  # x̂ · w in float32: Llama's arithmetic exactly
            return super().forward(x)
        if current_ops().small_ops(x, x.numel() // x.shape[-1]) and self.weight.dtype == torch.float32:
            # decode: one C call with the weights offset + w (rounded once, as below), the decode backend's bits
            return rms_norm(x, self.offset + self.weight, self.eps)
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (self.offset + self.weight.float())).to(x.dtype)


def tensor_bytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class Vector(nn.Module):
    """A small learned parameter read whole by every pass: gpt-oss's sink logits [H], DeepSeek-V3's routing
    bias [E], a Gated DeltaNet's A_log, dt_bias and conv taps."""

    def __init__(self, *shape: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape), requires_grad=False)

    def weight_tensors(self) -> list[torch.Tensor]:
        return [self.weight]

    def nbytes(self) -> int:
        return tensor_bytes(self.weight)

    def bytes_read_per_token(self) -> int:
        return self.nbytes()


class Embedding(nn.Module):
    """The token embedding table [vocab, hidden]: a pass reads one row per token."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def weight_tensors(self) -> list[torch.Tensor]:
        return [self.weight]

    def nbytes(self) -> int:
        """Bytes held."""
        return tensor_bytes(self.weight)

    def bytes_read_per_token(self) -> int:
        return self.weight.shape[1] * self.weight.element_size()


class Linear(nn.Module):
    """y = x Wᵀ (+ b). W [out, in] as in the checkpoints; `parts` names the output sizes of a fused one.

    Goes through the device's ops (kvlab/backends/ops.py): on a CPU a GEMV kernel streams the weights when
    only a few rows come in (decode), and the BLAS matmul takes the rest (prefill); elsewhere PyTorch's.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, parts: tuple[int, ...] = ()):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.parts = parts or (out_features,)  # fused q/k/v or gate/up: the sizes of what it stacks
        assert sum(self.parts) == out_features, (self.parts, out_features)
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return current_ops().linear(x, self.weight, self.bias)

    def forward_parts(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The products of a fused matrix, one per part: [..., part] each."""
        if current_ops().products_apart(x.numel() // x.shape[-1]):  # a prompt on a CPU (see CpuOps)
            weights = self.weight.split(self.parts)
            biases = self.bias.split(self.parts) if self.bias is not None else [None] * len(self.parts)
            return tuple(F.linear(x, w, b) for w, b in zip(weights, biases))
        return self(x).split(self.parts, dim=-1)  # decode: one streaming pass over the whole matrix

    def weight_tensors(self) -> list[torch.Tensor]:
        return [self.weight] + ([self.bias] if self.bias is not None else [])

    def nbytes(self) -> int:
        """Bytes held: the weight and the bias as stored."""
        return tensor_bytes(self.weight, self.bias)

    def bytes_read_per_token(self) -> int:
        """Bytes one decode step reads from this layer: all of it."""
        return self.nbytes()

    @property
    def macs_per_token(self) -> int:
        """Multiply-adds per input row: one per weight."""
        return self.in_features * self.out_features


# Rows of a prompt pass a gated MLP of stored blocks takes at a time on the CPU, in slices of equal rows
# (at least MLP_ROWS / 2: every slice takes the int8 setting's one-pass kernel if the pass does): a slice's
# gate and up outputs stay in cache for the down product that reads them, where a 1,024-row pass of
# Qwen2.5-Coder-0.5B wrote 20-40 MB of them and read them back from memory. Its 16 × 64-token burst of
# prompts took 0.92× the time with int8 activations and exact, one 1,024-token prompt 0.90× (int8; Zen 4,
# 2 threads). Each row's numbers are its own in the C kernels, so the slices give the whole pass's bits.
MLP_ROWS = 256


class GatedMLP(nn.Module):
    """down(act(gate(x)) · up(x)), with gate and up fused into one [2·I, hidden] matrix."""

    activation = "none"  # the config's name of `act` (DenseMLP.activation)

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, parts=(intermediate_size, intermediate_size))
        self.down_proj = Linear(intermediate_size, hidden_size)

    @staticmethod
    def act(gate: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows <= MLP_ROWS or not hasattr(self.gate_up_proj, "packed") or x.device.type != "cpu":
            return self._rows(x)
        flat, slices = x.reshape(rows, x.shape[-1]), -(-rows // MLP_ROWS)
        y = [self._rows(flat[i * rows // slices : (i + 1) * rows // slices]) for i in range(slices)]
        return torch.cat(y).view(*x.shape[:-1], -1)

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        act_id = activation_ids().get(self.activation)
        gated = getattr(self.gate_up_proj, "gated", None)  # stored blocks (quant.linear.PackedLinear)
        fused = gated(x, act_id) if gated is not None and act_id is not None else None
        if fused is not None:  # gate, up and the activation in one pass (the same bits as below)
            return self.down_proj(fused)
        gate, up = self.gate_up_proj.forward_parts(x)  # [B, T, I] each
        rows = gate.numel() // gate.shape[-1]
        if act_id is not None and gate.dtype == torch.float32 and current_ops().small_ops(gate, rows):
            return self.down_proj(gated_act(gate, up, act_id))  # the C step's own activation (its bits)
        return self.down_proj(self.act(gate) * up)


class SwiGLU(GatedMLP):
    """down(silu(gate(x)) · up(x)): Llama, Qwen."""

    activation = "silu"
    act = staticmethod(F.silu)


class GeGLU(GatedMLP):
    """down(gelu_tanh(gate(x)) · up(x)): Gemma's MLP (transformers' gelu_pytorch_tanh)."""

    activation = "gelu_pytorch_tanh"

    @staticmethod
    def act(gate: torch.Tensor) -> torch.Tensor:
        return F.gelu(gate, approximate="tanh")


GATED_MLPS = {cls.activation: cls for cls in (SwiGLU, GeGLU)}  # DenseMLP.activation → the module
