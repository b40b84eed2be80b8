"""The hand-written decoder: embeddings → N × (attention + MLP) → final norm → LM head.

One forward serves prefill (many new tokens), decode (one new token per sequence) and
no-cache recomputation: the difference is only in the cache and metadata it is handed.
Each block is built from its own `Layer` of the ModelConfig: Llama/Qwen layers normalise before
attention and before the MLP; Gemma's "sandwich" layers also normalise each one's output (four norms).
Shapes: B sequences, T new tokens, H query heads, Hkv key/value heads, D head dim, E hidden size.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from kvlab.config import Attention as AttentionConfig
from kvlab.config import MLA as MLAConfig
from kvlab.config import GatedDeltaNet as DeltaNetConfig
from kvlab.config import ModelConfig, MoE, RopeConfig
from kvlab.kv.cache import AttentionMetadata, KVCache
from kvlab.model.attention import ATTENTION_BACKENDS, Softmax, sdpa_attention, sink_attention
from kvlab.model.deltanet import GatedDeltaNet
from kvlab.model.layers import GATED_MLPS, Embedding, Linear, OffsetRMSNorm, RMSNorm, Vector
from kvlab.model.mla import MLAttention, rotary_dim
from kvlab.model.moe import MoEBlock
from kvlab.model.rope import RotaryEmbedding, apply_rotary


def make_norm(config: ModelConfig, dim: int) -> RMSNorm:
    """Llama's RMSNorm, or Gemma's x̂ · (offset + w) where the config gives an offset."""
    if config.norm_offset is None:
        return RMSNorm(dim, config.rms_norm_eps)
    return OffsetRMSNorm(dim, config.rms_norm_eps, config.norm_offset)


class Attention(nn.Module):
    """Grouped-query attention; K/V heads are shared by H/Hkv query heads without being copied."""

    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        mixer: AttentionConfig = config.layers[layer_index].mixer
        # its index among the layers the KV cache holds (a hybrid's Gated DeltaNet layers hold none)
        self.layer_index = sum(not isinstance(layer.mixer, DeltaNetConfig) for layer in config.layers[:layer_index])
        self.num_heads, self.num_kv_heads, self.head_dim = mixer.num_heads, mixer.kv_heads, mixer.head_dim
        self.window = mixer.window  # the cache applies it (it knows which keys each query sees)
        self.scale = mixer.scale  # None: SDPA's 1/√D
        self.rope = mixer.rope  # None: the model's rotary table
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, q_size + 2 * kv_size, bias=mixer.qkv_bias,
                               parts=(q_size, kv_size, kv_size))  # fmt: skip
        self.o_proj = Linear(q_size, config.hidden_size, bias=mixer.o_bias)
        # Qwen3.5, Qwen3-Next: q_proj also emits a sigmoid gate per head and channel (split out at load)
        self.gate_proj = Linear(config.hidden_size, q_size) if mixer.output_gate else None
        # q/k norms per head (Qwen3, Gemma 3), or over the whole projections (OLMoE: `qk_norm_whole`)
        self.qk_norm_whole, self.clip_qkv = mixer.qk_norm_whole, mixer.clip_qkv
        q_norm_size, k_norm_size = (q_size, kv_size) if mixer.qk_norm_whole else (self.head_dim, self.head_dim)
        self.q_norm = make_norm(config, q_norm_size) if mixer.qk_norm else None
        self.k_norm = make_norm(config, k_norm_size) if mixer.qk_norm else None
        # gpt-oss: one learned sink logit per query head in every softmax [H]
        self.sinks = Vector(self.num_heads) if mixer.sinks else None  # gpt-oss's sink logit per head
        self.attend = sdpa_attention  # see kvlab.model.attention; Transformer.set_attention swaps it
        self.prompt_bf16 = False  # prompt passes' attention in bfloat16 (the int8 setting's: quant/activations.py)

    def forward(self, x, cos, sin, cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        B, T, _ = x.shape
        H, Hkv = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x)  # [B, T, (H + 2·Hkv)·D]
        if self.qk_norm_whole or self.clip_qkv is not None:
            qkv = self._whole_norm_and_clip(qkv)
        qkv = qkv.view(B, T, H + 2 * Hkv, self.head_dim)  # q heads, then k, then v
        qk, v = qkv[:, :, : H + Hkv], qkv[:, :, H + Hkv :]
        if self.q_norm is not None and not self.qk_norm_whole:  # Qwen3, Gemma 3: each head of q and k
            qk = torch.cat([self.q_norm(qk[:, :, :H]), self.k_norm(qk[:, :, H:])], dim=2)
        qk = apply_rotary(qk, cos, sin)  # q and k rotated together: [B, T, H + Hkv, D]
        q = qk[:, :, :H].transpose(1, 2)  # [B, H, T, D]
        k = qk[:, :, H:].transpose(1, 2)  # [B, Hkv, T, D]
        v = v.transpose(1, 2)  # [B, Hkv, T, D]

        # the cache stores k, v and runs the attention over every key each query may see
        attention = self.attend if self.scale is None else functools.partial(self.attend, scale=self.scale)
        if self.prompt_bf16 and self.attend is sdpa_attention:
            attention = functools.partial(sdpa_attention, scale=self.scale, bf16=True)
        if self.sinks is not None:
            attention = functools.partial(sink_attention, sinks=self.sinks.weight, scale=self.scale)
        # what it computes, where the cache may read its keys itself (not the lab's materialized attention)
        softmax = None
        if self.attend is sdpa_attention:
            scale = 1 / math.sqrt(self.head_dim) if self.scale is None else self.scale
            softmax = Softmax(scale, self.sinks.weight if self.sinks is not None else None)
        out = cache.attend(self.layer_index, q, k, v, meta, attention, softmax)  # [B, H, T, D]
        out = out.transpose(1, 2).reshape(B, T, -1)  # [B, T, H·D]
        if self.gate_proj is not None:
            out = out * torch.sigmoid(self.gate_proj(x))
        return self.o_proj(out)

    def _whole_norm_and_clip(self, qkv: torch.Tensor) -> torch.Tensor:
        """OLMoE: q and k normalised over their whole projections, then q, k, v clamped to ±clip_qkv."""
        q, k, v = qkv.split(self.qkv_proj.parts, dim=-1)
        if self.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        return torch.cat([q, k, v], dim=-1)


class DecoderLayer(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(·)): Llama, Qwen."""

    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        self.input_norm = make_norm(config, config.hidden_size)
        self.attn = make_mixer(config, layer_index)
        self.post_attn_norm = make_norm(config, config.hidden_size)
        self.mlp = make_mlp(config, layer_index)

    def forward(self, x, cos, sin, cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x), cos, sin, cache, meta)
        return x + self.mlp(self.post_attn_norm(x))


class SandwichDecoderLayer(DecoderLayer):
    """Gemma 2/3: each of attention and MLP normalised on the way in and on the way out (four norms).

    `post_attn_norm` normalises the attention's output here (transformers' post_attention_layernorm).
    """

    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__(config, layer_index)
        self.pre_mlp_norm = make_norm(config, config.hidden_size)
        self.post_mlp_norm = make_norm(config, config.hidden_size)

    def forward(self, x, cos, sin, cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.post_attn_norm(self.attn(self.input_norm(x), cos, sin, cache, meta))
        return x + self.post_mlp_norm(self.mlp(self.pre_mlp_norm(x)))


def make_mixer(config: ModelConfig, layer_index: int) -> nn.Module:
    """The layer's token mixer: softmax attention, or multi-head latent attention (kvlab.model.mla)."""
    if isinstance(config.layers[layer_index].mixer, MLAConfig):
        return MLAttention(config, layer_index)
    if isinstance(config.layers[layer_index].mixer, DeltaNetConfig):
        return GatedDeltaNet(config, layer_index)
    return Attention(config, layer_index)


def make_mlp(config: ModelConfig, layer_index: int) -> nn.Module:
    """The layer's MLP: a gated MLP, or a mixture of experts (kvlab.model.moe)."""
    mlp = config.layers[layer_index].mlp
    if isinstance(mlp, MoE):
        return MoEBlock(config, mlp)
    return GATED_MLPS[mlp.activation](config.hidden_size, mlp.intermediate_size)


def make_layer(config: ModelConfig, layer_index: int) -> DecoderLayer:
    cls = SandwichDecoderLayer if config.layers[layer_index].norms == 4 else DecoderLayer
    return cls(config, layer_index)


class Transformer(nn.Module):
    """A decoder-only language model (Llama / Qwen2 / Qwen3 / Gemma 3 families)."""

    def __init__(self, config: ModelConfig, max_positions: int | None = None):
        super().__init__()
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.embed_scale = config.embedding_scale  # Gemma: √E
        self.layers = nn.ModuleList(make_layer(config, i) for i in range(config.num_layers))
        self.norm = make_norm(config, config.hidden_size)
        # tied models reuse the embedding matrix as the LM head (set when weights load)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        self.logit_softcap = config.final_logit_softcap
        self.build_rotary(max_positions or config.max_position_embeddings)

    def build_rotary(self, max_positions: int, device: torch.device | str | None = None) -> None:
        """(Re)build the cos/sin tables for `max_positions` positions: `rotary` for every layer without
        rotary settings of its own, `layer_rotary` for the others (Gemma 3's sliding layers)."""
        c = self.config
        dim = rotary_dim(c)  # the head, or MLA's decoupled rope part
        self.rotary = RotaryEmbedding(c.rope, dim, max_positions).to(device or "cpu")
        ropes = dict.fromkeys(layer.attn.rope for layer in self.layers if layer.attn.rope is not None)
        self._rope_names = {rope: f"rope{i}" for i, rope in enumerate(ropes)}  # ModuleDict keys are strings
        self.layer_rotary = nn.ModuleDict({
            name: RotaryEmbedding(rope, dim, max_positions).to(device or "cpu")
            for rope, name in self._rope_names.items()
        })  # fmt: skip

    def _rotary_of(self, rope: RopeConfig | None) -> RotaryEmbedding:
        return self.rotary if rope is None else self.layer_rotary[self._rope_names[rope]]

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
        if self.embed_scale is not None:  # in the activations' dtype, as transformers rounds it
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype, device=x.device)
        tables = {}  # one cos/sin lookup per rotary table: [B, T, 1, D] each
        for layer in self.layers:
            rope = layer.attn.rope
            if rope not in tables:
                tables[rope] = self._rotary_of(rope)(meta.positions, x.dtype)
            x = layer(x, *tables[rope], cache, meta)
        x = x[:, -1] if logits_index is None else x[:, logits_index]  # [B, E] or [B, N, E]
        logits = self.lm_head(self.norm(x)).float()
        if self.logit_softcap is not None:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits
