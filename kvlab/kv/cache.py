"""The KV cache interface and its contiguous implementation.

The model never knows which cache it talks to. Each attention layer hands the cache its queries
and the keys and values of the new tokens; the cache stores the new K/V and runs the attention
function over every key and value each query may look at:

    out = cache.attend(layer, q, k_new, v_new, meta, attention)      # [B, H, T, D]

For a contiguous cache that is `attention(q, *cache.update(layer, k_new, v_new, meta), meta)`; the
paged cache (`kv/paged.py`) splits a step's packed tokens into groups (all decodes as one batch,
each prompt chunk alone) and reads each group's keys through its block table.

A forward pass is described by `AttentionMetadata`, built once by whoever drives the model
(`cache.plan(num_new_tokens)` for the caches here; the ModelRunner builds the paged cache's own
`PagedMetadata`), shared by all layers, then `cache.commit(meta)` once the pass is done.

A cache class owns its storage facts: `bytes_per_token_for(config, dtype)` says what one token costs
in its layout before anything is allocated (the KV pool is planned from it), and an allocated cache
answers `bytes_per_token()`, `nbytes()` and lists the tensors it holds (`tensors()`), so a format
that adds scale tensors changes this file's classes, not their callers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """How the new tokens of one forward pass sit in the cache.

    positions:  [B, T] absolute position of each new token (RoPE angle, causal order)
    start:      tokens already cached for every sequence before this pass
    attn_mask:  [1 or B, 1, T, L] bool, True where a query may look at a key; None when plain
                causal attention over the new tokens is enough (start == 0), or when T == 1 and every
                sequence sees all L keys
    """

    positions: torch.Tensor
    start: int
    attn_mask: torch.Tensor | None = None

    @property
    def num_new_tokens(self) -> int:
        return self.positions.shape[1]

    @property
    def is_causal(self) -> bool:
        """SDPA's own causal mask is right when nothing is cached yet and several tokens come in."""
        return self.start == 0 and self.num_new_tokens > 1


def build_metadata(start: int, num_new: int, batch_size: int, device: torch.device) -> AttentionMetadata:
    """Metadata for `num_new` tokens appended after `start` cached tokens in every sequence."""
    positions = torch.arange(start, start + num_new, device=device).expand(batch_size, num_new)
    mask = None
    if start > 0 and num_new > 1:
        # query i (at position start+i) may see keys 0 .. start+i
        keys = torch.arange(start + num_new, device=device)
        mask = (keys[None, :] <= positions[0, :, None])[None, None]  # [1, 1, T, start+T]
    return AttentionMetadata(positions=positions, start=start, attn_mask=mask)


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """K and V of every layer for one token, stored as `dtype`: 2 × layers × kv heads × head dim × size."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype.itemsize


class KVCache(ABC):
    """Where attention layers keep the keys and values of tokens already processed."""

    num_layers: int

    @classmethod
    def bytes_per_token_for(cls, config, dtype: torch.dtype) -> int:
        """Bytes one token of one sequence takes in this cache's layout (all layers, K and V, any scales)."""
        return kv_bytes_per_token(config, dtype)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the cache holds (K, V and, for a quantized layout, their scales)."""
        return []

    def nbytes(self) -> int:
        """Bytes allocated, whether used or not."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @abstractmethod
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        """Store the new tokens' k, v [B, Hkv, T, D] at their positions."""

    @abstractmethod
    def read(self, layer: int, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Every key and value the new tokens may attend to: [B, Hkv, start+T, D] each."""

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata):
        self.write(layer, k, v, meta)
        return self.read(layer, meta)

    def attend(self, layer: int, q, k, v, meta: AttentionMetadata, attention) -> torch.Tensor:
        """Store k, v [B, Hkv, T, D]; return attention(q, keys, values, meta) [B, H, T, D] over what q may see."""
        k_all, v_all = self.update(layer, k, v, meta)
        return attention(q, k_all, v_all, meta)


class SingleBatchKVCache(KVCache):
    """A cache whose B sequences advance together: `plan` a pass, run the model, `commit` it."""

    @abstractmethod
    def plan(self, num_new_tokens: int) -> AttentionMetadata:
        """Metadata for a pass that appends `num_new_tokens` to every sequence."""

    @abstractmethod
    def commit(self, meta: AttentionMetadata) -> None:
        """Record that the pass described by `meta` has been written."""


class ContiguousKVCache(SingleBatchKVCache):
    """One preallocated K and V tensor per layer: [B, Hkv, max_len, D]. No copies per step.

    `length` tokens of every sequence are valid; `truncate(n)` rewinds (the slots are reused).
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        batch_size: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        self.num_layers = num_layers
        self.max_len = max_len
        self.batch_size = batch_size
        self.length = 0
        shape = (batch_size, num_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @classmethod
    def for_model(cls, config, max_len: int, batch_size: int = 1, dtype=torch.float32, device="cpu"):
        return cls(config.num_layers, config.num_kv_heads, config.head_dim, max_len, batch_size, dtype, device)

    @property
    def device(self) -> torch.device:
        return self.k[0].device

    def tensors(self) -> list[torch.Tensor]:
        return self.k + self.v

    def numel(self) -> int:
        """Numbers allocated (all layers, K and V)."""
        return sum(t.numel() for t in self.tensors())

    def bytes_per_token(self) -> int:
        """Bytes one token of one sequence takes across all layers (K and V)."""
        return sum(t[0, :, 0].numel() * t.element_size() for t in self.tensors())

    def used_bytes(self) -> int:
        """Bytes holding valid tokens (every sequence of the batch)."""
        return self.bytes_per_token() * self.length * self.batch_size

    def plan(self, num_new_tokens: int) -> AttentionMetadata:
        end = self.length + num_new_tokens
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} tokens; {end} needed")
        return build_metadata(self.length, num_new_tokens, self.batch_size, self.device)

    def commit(self, meta: AttentionMetadata) -> None:
        self.length = meta.start + meta.num_new_tokens

    def reserve(self, num_tokens: int) -> None:
        """Make room for `num_tokens` tokens per sequence, keeping what is cached.

        Grows by at least doubling, so a conversation reallocates a handful of times, never per step.
        """
        if num_tokens <= self.max_len:
            return
        new_len = max(num_tokens, 2 * self.max_len)
        for tensors in (self.k, self.v):
            for i, old in enumerate(tensors):
                new = old.new_zeros(old.shape[0], old.shape[1], new_len, old.shape[3])
                new[:, :, : self.length] = old[:, :, : self.length]
                tensors[i] = new
        self.max_len = new_len

    def truncate(self, length: int) -> None:
        """Forget every token from `length` on (their slots are overwritten later)."""
        self.length = min(self.length, length)

    def write(self, layer, k, v, meta):
        end = meta.start + k.shape[2]
        self.k[layer][:, :, meta.start : end] = k
        self.v[layer][:, :, meta.start : end] = v

    def read(self, layer, meta):
        end = meta.start + meta.num_new_tokens
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class NoCache(SingleBatchKVCache):
    """Keeps nothing: every pass must carry the whole sequence (the lab's recomputation mode)."""

    def __init__(self, num_layers: int, batch_size: int = 1, device: torch.device | str = "cpu"):
        self.num_layers = num_layers
        self.batch_size = batch_size
        self.device = torch.device(device)
        self._current: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def plan(self, num_new_tokens: int) -> AttentionMetadata:
        return build_metadata(0, num_new_tokens, self.batch_size, self.device)

    def commit(self, meta: AttentionMetadata) -> None:
        self._current.clear()

    def write(self, layer, k, v, meta):
        self._current[layer] = (k, v)

    def read(self, layer, meta):
        return self._current[layer]
