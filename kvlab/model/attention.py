"""Attention implementations: how new queries look at the cached keys and values.

Both take q [B, H, T, D] and k, v [B, Hkv, L, D] (L = cached + new tokens) and return [B, H, T, D];
`scale` multiplies q·k (None: 1/√D; Gemma 3 sets its own).
Query head h reads key/value head h // (H / Hkv); neither copies K or V per query head. A mask in
the metadata (`attn_mask`, True = may look) covers causal order after a cached prefix and, for a
batch of sequences of different lengths, the padding keys past each one's end.

- `sdpa`: PyTorch's fused scaled_dot_product_attention, which works block by block and never holds
  the whole [T, L] score matrix (the FlashAttention idea). The default. A pass of several new tokens per
  sequence in float32 on a CPU runs the kernels' C version where the ops in force have one (CpuOps:
  kernels/gemv.py's prompt_attention, on the kernels' pool; SmolLM2, int8 activations, 2 threads, a
  pass of 8 prompts of 64 tokens: 26-33 -> 16-19 ms of attention, one prompt of 1,024: 345 -> 214 ms).
  `bf16` (a layer's `prompt_bf16`, set by the int8 setting: kvlab.quant.activations): such passes of as
  many queries as the setting's bfloat16 products take go on AMX tiles in bfloat16 instead.
- `materialized`: the textbook form, scores = q kᵀ / √D as one [B, H, T, L] tensor, masked,
  softmaxed, times v. Kept for the lab, to show what fusing saves at long prompts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvlab.backends.ops import current_ops
from kvlab.kv.cache import AttentionMetadata


@dataclass(frozen=True)
class Softmax:
    """What a layer's attention computes, for a cache that reads its keys itself (kv/paged.py's decode rows):
    softmax(q · kᵀ · scale) · v, with one more logit per query head whose value row is zero where `sinks` [H]
    is given (gpt-oss)."""

    scale: float
    sinks: torch.Tensor | None = None


def sdpa_attention(q, k, v, meta: AttentionMetadata, scale: float | None = None, bf16: bool = False) -> torch.Tensor:
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    if T == 1 and H != Hkv:
        # decode: one query per head needs no causal mask, so the H/Hkv query heads that share a K/V
        # head can stand as rows of one head: plain attention over Hkv heads, no GQA expansion at all.
        # A batch of different lengths brings a key mask [B, 1, 1, L]; it broadcasts over those rows.
        grouped = q.reshape(B, Hkv, H // Hkv, D)
        out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=meta.attn_mask, scale=scale)
        return out.reshape(B, H, 1, D)  # a GPU kernel may hand back [B, Hkv, g, D] in another layout
    if meta.attn_mask is not None or meta.is_causal:  # (the C version's queries see keys up to their own only)
        out = current_ops().prompt_attention(q, k, v, meta.attn_mask, 1 / math.sqrt(D) if scale is None else scale, bf16)
        if out is not None:
            return out
    return F.scaled_dot_product_attention(q, k, v, attn_mask=meta.attn_mask, is_causal=meta.is_causal, enable_gqa=True,
                                          scale=scale)  # fmt: skip


def materialized_attention(q, k, v, meta: AttentionMetadata, scale: float | None = None) -> torch.Tensor:
    B, H, T, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    group = H // Hkv
    qg = q.reshape(B, Hkv, group * T, D)  # the `group` query heads sharing a K/V head, stacked as rows
    scores = (qg @ k.transpose(-1, -2)).view(B, Hkv, group, T, L)  # [B, Hkv, g, T, L]
    scores = scores / math.sqrt(D) if scale is None else scores * scale
    if meta.attn_mask is not None:  # [1 or B, 1, T, L] → [1 or B, 1, 1, T, L], broadcast over heads
        allowed = meta.attn_mask.unsqueeze(2)
    else:  # query t (position start + t) may see keys 0 .. start + t
        allowed = torch.arange(L, device=q.device)[None, :] <= (L - T + torch.arange(T, device=q.device))[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    out = weights.view(B, Hkv, group * T, L) @ v  # [B, Hkv, g·T, D]
    return out.view(B, H, T, D)


def sink_attention(q, k, v, meta: AttentionMetadata, sinks: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Attention with a learned sink logit per query head (gpt-oss): each head's softmax also runs over
    one extra logit `sinks[h]` whose value row is zero, so a query may attend to nothing. sinks [H]."""
    B, H, T, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    group = H // Hkv
    qg = q.reshape(B, Hkv, group * T, D)
    scores = (qg @ k.transpose(-1, -2)).view(B, Hkv, group, T, L)  # [B, Hkv, g, T, L]
    scores = scores / math.sqrt(D) if scale is None else scores * scale
    if meta.attn_mask is not None:
        allowed = meta.attn_mask.unsqueeze(2)
    else:
        allowed = torch.arange(L, device=q.device)[None, :] <= (L - T + torch.arange(T, device=q.device))[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    sink = sinks.to(scores.dtype).view(1, Hkv, group, 1, 1).expand(B, Hkv, group, T, 1)
    logits = torch.cat([scores, sink], dim=-1)  # [B, Hkv, g, T, L + 1]
    logits = logits - logits.max(dim=-1, keepdim=True).values  # transformers' order of operations
    weights = torch.softmax(logits, dim=-1)[..., :L].to(q.dtype)
    out = weights.reshape(B, Hkv, group * T, L) @ v  # [B, Hkv, g·T, D]
    return out.view(B, H, T, D)


ATTENTION_BACKENDS = {"sdpa": sdpa_attention, "materialized": materialized_attention}


def score_matrix_bytes(num_heads: int, new_tokens: int, context: int, dtype=torch.float32, batch: int = 1) -> int:
    """Bytes of one layer's [B, H, T, L] score matrix in the materialized form."""
    return batch * num_heads * new_tokens * context * torch.finfo(dtype).bits // 8
