"""Rotary position embeddings (RoPE) with the context-extension variants of config.json.

Each pair of channels (i, i + head_dim/2) of a query or key is rotated by an angle
position × inv_freq[i]. Scaling variants only change inv_freq (and, for YaRN, scale cos/sin).
"""

from __future__ import annotations

import math

import torch

from kvlab.config import RopeConfig
from kvlab.backends.ops import current_ops
from kvlab.kernels.gemv import rope_in_place


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """Return (inv_freq [head_dim/2] float32, attention scaling applied to cos and sin)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.type == "default":
        return inv_freq, 1.0
    if rope.type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.type == "llama3":
        return _llama3(inv_freq, rope), 1.0
    if rope.type == "yarn":
        return _yarn(rope, head_dim)
    raise ValueError(f"unknown rope type {rope.type}")


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by factor, short ones kept, a smooth blend between."""
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, blended, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, a linear ramp in between."""
    base, factor = rope.theta, rope.factor
    if rope.attention_factor is not None:
        attention_factor = float(rope.attention_factor)
    elif rope.mscale and rope.mscale_all_dim:
        attention_factor = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
    else:
        attention_factor = _yarn_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(rope.original_max_position_embeddings / (num_rotations * 2 * math.pi)) / (
            2 * math.log(base)
        )

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp

    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv_extrapolation = 1.0 / pos_freqs
    inv_interpolation = 1.0 / (factor * pos_freqs)
    inv_freq = inv_interpolation * (1 - extrapolation_weight) + inv_extrapolation * extrapolation_weight
    return inv_freq, attention_factor


class RotaryEmbedding(torch.nn.Module):
    """Precomputed tables [max_positions, head_dim], looked up by position.

    `sin` is stored with the first half negated, so that the rotation needs no concatenation:
    rotate_half(x) · sin == roll(x, D/2) · [−sin, sin].
    """

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int):
        super().__init__()
        # The tables are computed on the CPU even when the model is built under torch.device("meta"):
        # meta arithmetic runs through torch._refs, whose first use imports torch._dynamo (2 s at start-up).
        head_dim = int(head_dim * rope.partial_rotary_factor)  # partial rotary: the first channels of each head
        with torch.device("cpu"):
            inv_freq, scaling = inverse_frequencies(rope, head_dim)
            positions = torch.arange(max_positions, dtype=torch.float32)
            freqs = torch.outer(positions, inv_freq)  # [P, D/2]
            angles = torch.cat([freqs, freqs], dim=-1)  # [P, D]: both halves of a pair share an angle
            sign = torch.cat([-torch.ones(head_dim // 2), torch.ones(head_dim // 2)])
        self.register_buffer("cos", angles.cos() * scaling, persistent=False)
        self.register_buffer("sin", angles.sin() * scaling * sign, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] → cos, signed sin [B, T, 1, D] (broadcast over heads) in the activations' dtype."""
        return self.cos[positions].unsqueeze(2).to(dtype), self.sin[positions].unsqueeze(2).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, T, heads, D]: (x1, x2) → (x1·cos − x2·sin, x2·cos + x1·sin) per channel pair.

    A decode step's float32 rows on a CPU are rotated in place by one C call (the same arithmetic);
    otherwise a new tensor is returned. Tables narrower than x (partial rotary) rotate its first channels only.
    """
    if cos.shape[-1] < x.shape[-1]:
        rotated = apply_rotary(x[..., : cos.shape[-1]].contiguous(), cos, signed_sin)
        return torch.cat([rotated, x[..., cos.shape[-1] :]], dim=-1)
    if current_ops().small_ops(x, x.shape[0] * x.shape[1]) and rope_in_place(x, cos, signed_sin):
        return x
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)
