"""The hand-written decoder: embeddings → N × (attention + MLP) → final norm → LM head.

One forward serves prefill (many new tokens), decode (one new token per sequence) and
no-cache recomputation: the difference is only in the cache and metadata it is handed.
Shapes: B sequences, T new tokens, H query heads, Hkv key/value heads, D head dim, E hidden size.
"""

from __future__ import annotations

import torch
from torch import nn

from kvlab.config import ModelConfig
from kvlab.kv.cache import AttentionMetadata, KVCache
from kvlab.model.attention import ATTENTION_BACKENDS, sdpa_attention
from kvlab.model.layers import Embedding, Linear, RMSNorm, SwiGLU
from kvlab.model.rope import RotaryEmbedding, apply_rotary


class Attention(nn.Module):
    """Grouped-query attention; K/V heads are shared by H/Hkv query heads without being copied."""

    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.qkv_bias,
                               parts=(q_size, kv_size, kv_size))
        self.o_proj = Linear(q_size, config.hidden_size)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.attend = sdpa_attention  # see kvlab.model.attention; Transformer.set_attention swaps it

    def forward(self, x, cos, sin, cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        B, T, _ = x.shape
        H, Hkv = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(B, T, H + 2 * Hkv, self.head_dim)  # q heads, then k, then v
        qk, v = qkv[:, :, : H + Hkv], qkv[:, :, H + Hkv :]
        if self.q_norm is not None:  # Qwen3: normalise each head of q and k before rotating it
            qk = torch.cat([self.q_norm(qk[:, :, :H]), self.k_norm(qk[:, :, H:])], dim=2)
        qk = apply_rotary(qk, cos, sin)  # q and k rotated together: [B, T, H + Hkv, D]
        q = qk[:, :, :H].transpose(1, 2)  # [B, H, T, D]
        k = qk[:, :, H:].transpose(1, 2)  # [B, Hkv, T, D]
        v = v.transpose(1, 2)  # [B, Hkv, T, D]

        # the cache stores k, v and runs self.attend over every key each query may see
        out = cache.attend(self.layer_index, q, k, v, meta, self.attend)  # [B, H, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config, layer_index)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(self, x, cos, sin, cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x), cos, sin, cache, meta)
        return x + self.mlp(self.post_attn_norm(x))


class Transformer(nn.Module):
    """A decoder-only language model (Llama / Qwen2 / Qwen3 families)."""

    def __init__(self, config: ModelConfig, max_positions: int | None = None):
        super().__init__()
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # tied models reuse the embedding matrix as the LM head (set when weights load)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        self.rotary = RotaryEmbedding(
            config.rope, config.head_dim, max_positions or config.max_position_embeddings
        )

    def set_attention(self, name: str) -> None:
        """Choose the attention implementation for every layer: "sdpa" (default) or "materialized"."""
        if name not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention '{name}': {', '.join(ATTENTION_BACKENDS)}")
        for layer in self.layers:
            layer.attn.attend = ATTENTION_BACKENDS[name]

    # ---- what the weights cost, asked of the layers ---------------------------------------------

    def weight_modules(self) -> list[nn.Module]:
        """Every module holding weights (float or packed layers alike: they list their tensors)."""
        return [m for m in self.modules() if hasattr(m, "weight_tensors")]

    def weight_bytes(self) -> int:
        """Bytes of weights held in memory, each tensor once (a tied LM head reads the embedding's)."""
        distinct = {id(t): t for m in self.weight_modules() for t in m.weight_tensors()}
        return sum(t.numel() * t.element_size() for t in distinct.values())

    def decode_read_bytes(self) -> int:
        """Weight bytes one decode step of one sequence reads: every layer whole, one embedding row, and
        the LM head whole (with tied embeddings that is the embedding matrix, read as the head)."""
        return sum(m.bytes_read_per_token() for m in self.weight_modules())  # an embedding table: one row

    def matmul_macs_per_token(self) -> tuple[int, int]:
        """(multiply-adds of every decoder layer's linear maps, of the LM head) for one token."""
        layers = sum(m.macs_per_token for m in self.layers.modules() if hasattr(m, "macs_per_token"))
        return layers, self.lm_head.macs_per_token

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype: the norms' (packed matrices keep their own storage types)."""
        return self.norm.weight.dtype

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: KVCache,
        meta: AttentionMetadata,
        logits_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids [B, T] → logits [B, V] for the last new token of each sequence.

        `meta` is the cache's description of this pass (AttentionMetadata, or the paged cache's
        PagedMetadata); the model reads only its `positions` [B, T] and hands it to the cache.

        `logits_index` [N] picks other positions instead (logits [B, N, V]); the LM head, the
        largest matrix of a small model, only ever runs on the positions that need logits.
        """
        x = self.embed_tokens(input_ids)  # [B, T, E]
        cos, sin = self.rotary(meta.positions, x.dtype)  # [B, T, 1, D]
        for layer in self.layers:
            x = layer(x, cos, sin, cache, meta)
        x = x[:, -1] if logits_index is None else x[:, logits_index]  # [B, E] or [B, N, E]
        return self.lm_head(self.norm(x)).float()
