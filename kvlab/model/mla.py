"""Multi-head latent attention (MLA, DeepSeek-V2/V3): the cache holds one latent per token, not K and V per head.

    q        = q_b(norm(q_a(x)))  or  q_proj(x)              [B, T, H, dn + dr]   (dn: nope part, dr: rope part)
    c, k_r   = kv_a(x) split                                 [B, T, r], [B, T, dr] (r: kv_lora_rank)
    c        = norm(c);  q_r, k_r rotated (one k_r shared by every head)
    cached   = [c, k_r]                                      one "K" head of r + dr numbers, no V (kv_geometry)
    k_h, v_h = kv_b(c) split per head                        [B, H, L, dn], [B, H, L, dv]

Attention of head h is softmax(q_h · [k_h, k_r] · scale) · v_h. Two ways to compute it from the latent:

    absorbed  k_h = W_UK_h c, so q_nope_h · k_h = (W_UK_hᵀ q_nope_h) · c: the key up-projection folds into the
              query ([B, H, T, r] + q_r = r + dr numbers per head), attention runs over the cached latent
              itself as one shared K head, its first r numbers as the values, and W_UV_h is applied to the
              [B, H, T, r] result afterwards. A step reads only the latent; per-head K/V are never built.
    rebuilt   kv_b runs on every gathered latent to rebuild k_h, v_h (the textbook form; the oracle).

Both run through the one cache call; `_attention` picks per attention group: decode rows (T = 1, speculative
rows included) absorb, so a step reads the latent and never builds per-head K/V; prompt chunks rebuild, whose
attention products are 3.4× fewer for long chunks (benchmarks/bench_mla_prefill.py, DeepSeek-V3's latent widths,
16 heads, one thread: rebuilt 1.1× as fast at 128 tokens, 1.5× at 512, 1.7× at 1,024; outputs within 1e-8).
`absorb` True or False forces one way (the tests compare them). DeepSeek's rotary channels pair as (0, 1),
(2, 3), ...: they are de-interleaved before the rotation (q and k alike, so q·k is unchanged and the cache
keeps the de-interleaved key). The softmax scale is (dn + dr)^-1/2, times mscale² under DeepSeek's YaRN
(`softmax_scale`). The decode backends (kvlab.backends) do not compute this mixer: the modules run every step.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kvlab.config import MLA, ModelConfig, RopeConfig
from kvlab.kv.cache import AttentionMetadata, KVCache
from kvlab.model.attention import sdpa_attention
from kvlab.model.layers import Linear, RMSNorm
from kvlab.model.rope import apply_rotary

LATENT_NORM_EPS = 1e-6  # transformers' q_a_layernorm and kv_a_layernorm keep RMSNorm's default eps


def softmax_scale(mixer: MLA, rope: RopeConfig) -> float:
    """(dn + dr)^-1/2, times mscale(factor, mscale_all_dim)² when YaRN stretches the context (DeepSeek)."""
    scale = (mixer.qk_nope_head_dim + mixer.qk_rope_head_dim) ** -0.5
    if rope.type == "yarn" and rope.mscale_all_dim and rope.factor > 1:
        mscale = 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0
        scale *= mscale * mscale
    return scale


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., d] pairs (0, 1), (2, 3), ... → [even channels, odd channels]: rotate-half's layout of the same pairs."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


def rotary_dim(config: ModelConfig) -> int:
    """Channels the rotary tables cover: MLA's decoupled rope part, or the attention head."""
    latent = next((layer.mixer for layer in config.layers if isinstance(layer.mixer, MLA)), None)
    return latent.qk_rope_head_dim if latent is not None else config.head_dim


class MLAttention(nn.Module):
    """One layer's latent attention; the cache stores [c, k_r] [B, 1, T, r + dr] and no V."""

    window = None  # MLA sees the whole context
    rope = None  # the model's rotary table, built for qk_rope_head_dim channels
    attend = sdpa_attention  # unused here; decode backends see a module they do not compute (kvlab.backends)

    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        m: MLA = config.layers[layer_index].mixer
        E, H = config.hidden_size, m.num_heads
        self.layer_index, self.num_heads = layer_index, H
        self.rank, self.rope_dim = m.kv_lora_rank, m.qk_rope_head_dim  # r, dr: the cached latent's parts
        self.nope_dim, self.v_dim = m.qk_nope_head_dim, m.v_head_dim  # dn, dv: per head, rebuilt from the latent
        self.interleaved = m.rope_interleaved
        q_size = H * (self.nope_dim + self.rope_dim)
        if m.q_lora_rank is None:
            self.q_proj = Linear(E, q_size)
        else:
            self.q_a_proj = Linear(E, m.q_lora_rank)
            self.q_a_norm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(m.q_lora_rank, q_size)
        self.kv_a_proj = Linear(E, self.rank + self.rope_dim)  # the latent and the shared rope key
        self.kv_a_norm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(self.rank, H * (self.nope_dim + self.v_dim))  # per head: K's nope part, then V
        self.o_proj = Linear(H * self.v_dim, E)
        self.scale = softmax_scale(m, config.rope)
        self._kv_b_floats: torch.Tensor | None = None  # a packed kv_b expanded for absorption, at first use
        self.absorb: bool | None = None  # None: decode rows absorb, prompt chunks rebuild (measured: faster)

    def forward(self, x, cos, sin, cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        B, T, _ = x.shape
        H = self.num_heads
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(B, T, H, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        c, k_rope = self.kv_a_proj(x).split([self.rank, self.rope_dim], dim=-1)  # [B, T, r], [B, T, dr]
        rope = torch.cat([q_rope, k_rope.unsqueeze(2)], dim=2)  # [B, T, H + 1, dr]: q heads, then the shared key
        if self.interleaved:
            rope = deinterleave(rope)
        rope = apply_rotary(rope.contiguous(), cos, sin)
        latent = torch.cat([self.kv_a_norm(c), rope[:, :, H]], dim=-1).unsqueeze(1)  # [B, 1, T, r + dr]
        q = torch.cat([q_nope, rope[:, :, :H]], dim=-1).transpose(1, 2)  # [B, H, T, dn + dr]
        # the cache stores the latent (and no V), then runs `_attention` per group over the latents it may see
        out = cache.attend(self.layer_index, q, latent, latent[..., :0], meta, self._attention)  # [B, H, T, dv]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, H * self.v_dim))

    def _attention(self, q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        """q [B, H, T, dn + dr] over the latents k [B, 1, L, r + dr] → [B, H, T, dv]: absorbed for decode rows
        (T = 1), rebuilt for prompt chunks (`absorb` None); or always one way (True / False)."""
        absorb = q.shape[2] == 1 if self.absorb is None else self.absorb
        return self._absorbed_attention(q, k, meta) if absorb else self._rebuilt_attention(q, k, meta)

    def _up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b's matrix [H·(dn + dv), r] as W_UK [H, dn, r] and W_UV [H, dv, r] (views, or dequantized blocks)."""
        w = getattr(self.kv_b_proj, "weight", None)
        if w is None:  # kept in blocks: expanded once, since the absorbed products need its two halves apart
            if self._kv_b_floats is None:
                parts = [p.dequantize() for p in self.kv_b_proj.packed()]
                self._kv_b_floats = torch.cat(parts).to(self.kv_a_norm.weight.dtype)
            w = self._kv_b_floats
        w = w.view(self.num_heads, self.nope_dim + self.v_dim, self.rank)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    def _absorbed_attention(self, q, k, meta: AttentionMetadata) -> torch.Tensor:
        """W_UK folded into the query: [B, H, T, r + dr] over the latent k [B, 1, L, r + dr] itself, its first r
        numbers as the values; W_UV applied to the [B, H, T, r] result → [B, H, T, dv]."""
        B, H, T, _ = q.shape
        w_uk, w_uv = self._up_projections()  # [H, dn, r], [H, dv, r]
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q = torch.cat([torch.einsum("bhtn,hnr->bhtr", q_nope, w_uk), q_rope], dim=-1)  # [B, H, T, r + dr]
        values = k[..., : self.rank]  # [B, 1, L, r]
        if T == 1:  # decode: the H heads stand as rows of the one latent head; a key mask broadcasts over them
            out = F.scaled_dot_product_attention(q.reshape(B, 1, H, -1), k, values, attn_mask=meta.attn_mask,
                                                 scale=self.scale).reshape(B, H, 1, self.rank)  # fmt: skip
        else:
            out = F.scaled_dot_product_attention(q, k, values, attn_mask=meta.attn_mask, is_causal=meta.is_causal,
                                                 enable_gqa=True, scale=self.scale)  # fmt: skip
        return torch.einsum("bhtr,hvr->bhtv", out, w_uv)

    def _rebuilt_attention(self, q, k, meta: AttentionMetadata) -> torch.Tensor:
        """q [B, H, T, dn + dr]; the latent k [B, 1, L, r + dr] up-projected to per-head K and V → [B, H, T, dv]."""
        B, H, L = q.shape[0], self.num_heads, k.shape[2]
        c, k_rope = k[:, 0].split([self.rank, self.rope_dim], dim=-1)  # [B, L, r], [B, L, dr]
        kv = self.kv_b_proj(c).view(B, L, H, -1).transpose(1, 2)  # [B, H, L, dn + dv]
        k_nope, values = kv.split([self.nope_dim, self.v_dim], dim=-1)
        keys = torch.cat([k_nope, k_rope.unsqueeze(1).expand(B, H, L, self.rope_dim)], dim=-1)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=meta.attn_mask, is_causal=meta.is_causal,
                                              scale=self.scale)  # fmt: skip


def join_kv_b(tensors):
    """(HF name, tensor) pairs of a deepseek2 GGUF with kv_b as floats: llama.cpp's converter splits kv_b_proj
    [H·(dn + dv), r] into k_b [H, r, dn] (transposed) and v_b [H, dv, r] for its own absorption; they are joined
    back here, and a kv_b kept in blocks is expanded (the absorbed attention multiplies by its halves itself)."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors:
        stem, _, which = name.rpartition(".self_attn.")
        if which not in ("k_b_proj.weight", "v_b_proj.weight", "kv_b_proj.weight"):
            yield name, t
            continue
        t = _as_float(t)
        if which == "kv_b_proj.weight":
            yield name, t
            continue
        pair = halves.setdefault(stem, {})
        pair[which] = t
        if len(pair) == 2:
            k_b, v_b = pair["k_b_proj.weight"].transpose(1, 2), pair["v_b_proj.weight"]  # [H, dn, r], [H, dv, r]
            yield f"{stem}.self_attn.kv_b_proj.weight", torch.cat([k_b, v_b], dim=1).reshape(-1, k_b.shape[-1])
            del halves[stem]


def _as_float(t) -> torch.Tensor:
    """A float tensor, or a PackedTensor's blocks (any number of leading dimensions) as float32."""
    if isinstance(t, torch.Tensor):
        return t
    rows = t.data.reshape(-1, t.data.shape[-1])
    return t.format.dequantize(rows, t.shape[-1]).reshape(t.shape).float()
