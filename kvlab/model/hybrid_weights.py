"""Qwen3.5's and Qwen3-Next's checkpoint layouts → the names and shapes kvlab.model.weights maps.

    self_attn.q_proj [H·2D, E]     per head: D query rows, then D gate rows → q_proj [H·D, E] + gate_proj [H·D, E]
    linear_attn.conv1d [C, 1, K]   → [C, K]
    Qwen3-Next's fused projections, grouped per key head g (r = Hv / Hk value heads each):
      in_proj_qkvz [Hk·(2Dk + 2rDv), E]   [q_g | k_g | v_g | z_g] → in_proj_qkv (all q, all k, all v) + in_proj_z
      in_proj_ba   [Hk·2r, E]             [b_g | a_g]             → in_proj_b + in_proj_a
    (Qwen3.5 stores in_proj_qkv, in_proj_z, in_proj_b and in_proj_a apart already.)

From GGUF (llama.cpp's converter; names already translated by kvlab.model.weights): ssm_a holds
A = −exp(A_log) (→ A_log = log(−A)), norms hold 1 + w (the GGUF config has no norm offset), conv taps are
[C, K]; qwen35 / qwen35moe files store the value heads tiled by key head (head j·Hk + g is value head j of
key head g), which the layer reads as is (kvlab.model.deltanet: `tiled`) — no matrix is reordered, so
stored blocks stay blocks.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

from kvlab.config import Attention, GatedDeltaNet, ModelConfig
from kvlab.quant.linear import PackedTensor

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def from_qwen_hybrid(tensors: Iterator[tuple[str, torch.Tensor]], config: ModelConfig) -> Iterator[tuple[str, object]]:
    for name, t in tensors:
        match = _LAYER.fullmatch(name)
        if match is None or int(match.group(1)) >= config.num_layers:
            yield name, t
            continue
        prefix, rest = f"model.layers.{match.group(1)}.", match.group(2)
        mixer = config.layers[int(match.group(1))].mixer
        if rest == "self_attn.q_proj.weight" and isinstance(mixer, Attention) and mixer.output_gate:
            q, gate = split_gated_q(t, mixer.num_heads, mixer.head_dim)
            yield prefix + "self_attn.q_proj.weight", q
            yield prefix + "self_attn.gate_proj.weight", gate
        elif rest == "linear_attn.conv1d.weight":
            yield name, _floats(t).reshape(t.shape[0], -1)
        elif rest == "linear_attn.A":  # GGUF
            yield prefix + "linear_attn.A_log", torch.log(-_floats(t))
        elif rest == "linear_attn.in_proj_qkvz.weight" and isinstance(mixer, GatedDeltaNet):
            qkv, z = split_qkvz(t, mixer)
            yield prefix + "linear_attn.in_proj_qkv.weight", qkv
            yield prefix + "linear_attn.in_proj_z.weight", z
        elif rest == "linear_attn.in_proj_ba.weight" and isinstance(mixer, GatedDeltaNet):
            r = mixer.num_value_heads // mixer.num_key_heads
            ba = _floats(t).reshape(mixer.num_key_heads, 2 * r, -1)
            yield prefix + "linear_attn.in_proj_b.weight", ba[:, :r].reshape(mixer.num_value_heads, -1)
            yield prefix + "linear_attn.in_proj_a.weight", ba[:, r:].reshape(mixer.num_value_heads, -1)
        else:
            yield name, t


def split_gated_q(w, num_heads: int, head_dim: int):
    """q_proj rows [H·2D, ...] (per head: query, then gate) → (query rows [H·D, ...], gate rows [H·D, ...]);
    a matrix kept in its stored blocks is split by rows the same way (blocks never span rows)."""
    rows = torch.arange(num_heads * 2 * head_dim).view(num_heads, 2, head_dim)
    return tuple(_take_rows(w, rows[:, i].reshape(-1)) for i in (0, 1))


def _take_rows(w, index: torch.Tensor):
    if isinstance(w, PackedTensor):
        return PackedTensor(w.fmt, (index.numel(), w.shape[1]), w.data.index_select(0, index).contiguous())
    return w.index_select(0, index)


def _floats(t) -> torch.Tensor:
    return t.dequantize() if isinstance(t, PackedTensor) else t


def split_qkvz(w: torch.Tensor, m: GatedDeltaNet) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-Next's in_proj_qkvz, grouped per key head → (in_proj_qkv rows, in_proj_z rows)."""
    Dk, rDv = m.key_head_dim, m.num_value_heads // m.num_key_heads * m.value_head_dim
    groups = w.reshape(m.num_key_heads, 2 * Dk + 2 * rDv, -1)
    q, k, v, z = groups.split((Dk, Dk, rDv, rDv), dim=1)
    flat = lambda x: x.reshape(-1, w.shape[-1])  # noqa: E731
    return torch.cat([flat(q), flat(k), flat(v)]), flat(z)
