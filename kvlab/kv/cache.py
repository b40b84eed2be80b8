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
`PagedMetadata`), shared by all layers, then `cache.commit(meta)` once the pass is done. A layer with
a sliding window of W tokens sees the pass through `meta.for_window(W)`: the same tokens, a mask that
also hides every key more than W − 1 positions before its query (transformers' kv_idx > q_idx − W).
The caches here keep every token of every layer (the paged cache frees what windows no longer reach).

A cache class owns its storage facts: `bytes_per_token_for(config, dtype, formats)` says what one
token costs in its layout before anything is allocated (the KV pool is planned from it), and an
allocated cache answers `bytes_per_token()`, `nbytes()` and lists the tensors it holds (`tensors()`).
Keys and values are stored in a format each (`kv/formats.py`: floats, or q8_0 / q4_0 / fp8_e4m3 codes
with their scales): quantized on write, dequantized on read, inside the cache; the model never knows.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from kvlab.config.layers import MLA
from kvlab.kv.formats import KVFormat, KVFormats


@dataclass
class AttentionMetadata:
    """How the new tokens of one forward pass sit in the cache.

    positions:  [B, T] absolute position of each new token (RoPE angle, causal order)
    start:      tokens already cached for every sequence before this pass
    attn_mask:  [1 or B, 1, T, L] bool, True where a query may look at a key; None when plain
                causal attention over the new tokens is enough (start == 0), or when T == 1 and every
                sequence sees all L keys
    windowed:   window W → this pass as a layer with a sliding window of W tokens sees it (one entry
                for each window of the model's layers; the entry is this same object where W hides nothing)
    """

    positions: torch.Tensor
    start: int
    attn_mask: torch.Tensor | None = None
    windowed: dict[int, AttentionMetadata] = field(default_factory=dict)

    @property
    def num_new_tokens(self) -> int:
        return self.positions.shape[1]

    @property
    def is_causal(self) -> bool:
        """SDPA's own causal mask is right when nothing is cached yet, several tokens come in and no
        mask says more (a window)."""
        return self.attn_mask is None and self.start == 0 and self.num_new_tokens > 1

    def for_window(self, window: int | None) -> AttentionMetadata:
        """The pass as a layer with a sliding window of `window` tokens sees it (None: the whole context)."""
        return self if window is None else self.windowed[window]


def window_mask(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int | None) -> torch.Tensor:
    """[..., T, L] bool: key position k is visible from query position q when k ≤ q and, with a window
    W, k > q − W (the query itself and the W − 1 keys before it). Broadcasts [..., T] against [..., L]."""
    q, k = query_positions[..., :, None], key_positions[..., None, :]
    visible = k <= q
    return visible & (k > q - window) if window is not None else visible


def build_metadata(
    start: int, num_new: int, batch_size: int, device: torch.device, windows: Iterable[int] = ()
) -> AttentionMetadata:
    """Metadata for `num_new` tokens appended after `start` cached tokens in every sequence, with one
    windowed view for each sliding window in `windows`."""
    positions = torch.arange(start, start + num_new, device=device).expand(batch_size, num_new)
    keys = torch.arange(start + num_new, device=device)
    mask = None
    if start > 0 and num_new > 1:  # query i (at position start+i) may see keys 0 .. start+i
        mask = window_mask(positions[0], keys, None)[None, None]  # [1, 1, T, start+T]
    meta = AttentionMetadata(positions=positions, start=start, attn_mask=mask)
    for w in set(windows):
        hides = start + num_new > w  # the last query's window starts after key 0
        meta.windowed[w] = meta if not hides else AttentionMetadata(
            positions=positions, start=start, attn_mask=window_mask(positions[0], keys, w)[None, None]
        )  # fmt: skip
    return meta


def kv_geometry(config) -> tuple[int, int, int]:
    """(KV heads, K width, V width) every layer stores per token: softmax attention's K and V per KV head, or
    multi-head latent attention's latent as one "K" head of kv_lora_rank + qk_rope_head_dim numbers and no V
    (its attention reads the first kv_lora_rank numbers of that head as the values: kvlab.model.mla)."""
    latent = next((layer.mixer for layer in config.layers if isinstance(layer.mixer, MLA)), None)
    if latent is not None:
        return 1, latent.kv_lora_rank + latent.qk_rope_head_dim, 0
    return config.num_kv_heads, config.head_dim, config.attention.v_head_dim


def kv_bytes_per_token(config, dtype: torch.dtype, formats: KVFormats | None = None) -> int:
    """K and V of every layer for one token: layers × kv heads × (a K vector's bytes + a V vector's), each
    vector stored in its format (plain `dtype` by default: 2 × ... × size; MLA: the latent as K, no V)."""
    formats = formats or KVFormats.plain(dtype)
    heads, k_dim, v_dim = kv_geometry(config)
    v_bytes = formats.v.bytes_per_vector(v_dim) if v_dim else 0
    return config.num_layers * heads * (formats.k.bytes_per_vector(k_dim) + v_bytes)


def allocate(fmt: KVFormat, leading: tuple[int, ...], head_dim: int, device, fill_zeros: bool) -> list[torch.Tensor]:
    """The storage tensors of `fmt` for vectors laid out as `leading` [..., head_dim] (none when head_dim is 0:
    MLA's absent V)."""
    if head_dim == 0:
        return []
    make = torch.zeros if fill_zeros else torch.empty
    return [make((*leading, *trailing), dtype=dtype, device=device) for trailing, dtype in fmt.storage(head_dim)]


def layer_windows(config) -> tuple[int | None, ...]:
    """Each layer's sliding window in tokens (None: it sees the whole context)."""
    return tuple(getattr(layer.mixer, "window", None) for layer in config.layers)


class KVCache(ABC):
    """Where attention layers keep the keys and values of tokens already processed."""

    num_layers: int
    windows: tuple[int | None, ...] = ()  # each layer's sliding window (empty: none has one)
    states = None  # a hybrid model's StatePool (kv/state_pool.py): its recurrent layers' per-sequence states

    def window(self, layer: int) -> int | None:
        return self.windows[layer] if self.windows else None

    @classmethod
    def bytes_per_token_for(cls, config, dtype: torch.dtype, formats: KVFormats | None = None) -> int:
        """Bytes one token of one sequence takes in this cache's layout (all layers, K and V, any scales)."""
        return kv_bytes_per_token(config, dtype, formats)

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

    def attend(self, layer: int, q, k, v, meta: AttentionMetadata, attention, softmax=None) -> torch.Tensor:
        """Store k, v [B, Hkv, T, D]; return attention(q, keys, values, meta) [B, H, T, D] over what q may see.
        `softmax` (model/attention.py's Softmax, or None): what `attention` computes, for a cache that can read
        its keys itself (the paged cache's decode rows)."""
        k_all, v_all = self.update(layer, k, v, meta)
        return attention(q, k_all, v_all, meta.for_window(self.window(layer)))


class SingleBatchKVCache(KVCache):
    """A cache whose B sequences advance together: `plan` a pass, run the model, `commit` it."""

    def _window_set(self) -> set[int]:
        return {w for w in self.windows if w is not None}

    @abstractmethod
    def plan(self, num_new_tokens: int) -> AttentionMetadata:
        """Metadata for a pass that appends `num_new_tokens` to every sequence."""

    @abstractmethod
    def commit(self, meta: AttentionMetadata) -> None:
        """Record that the pass described by `meta` has been written."""


class ContiguousKVCache(SingleBatchKVCache):
    """Preallocated K and V storage per layer: [B, Hkv, max_len, D] (plus scales when quantized). No
    copies per step.

    `length` tokens of every sequence are valid; `truncate(n)` rewinds (the slots are reused). A
    sliding-window layer keeps every token too (its window is a mask): this is the simple oracle.
    `k[layer]` / `v[layer]` are the float tensors of a float format (the codes of a quantized one).
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
        windows: tuple[int | None, ...] = (),
        formats: KVFormats | None = None,
        v_head_dim: int | None = None,  # None: head_dim; 0: no V (MLA's latent, see kv_geometry)
    ):
        self.num_layers = num_layers
        self.windows = windows
        self.max_len = max_len
        self.batch_size = batch_size
        self.length = 0
        self.dtype, self.head_dim = dtype, head_dim  # what attention reads: the format's vectors, decoded
        self.formats = formats or KVFormats.plain(dtype)
        leading = (batch_size, num_kv_heads, max_len)
        self._k = [allocate(self.formats.k, leading, head_dim, device, True) for _ in range(num_layers)]
        v_dim = head_dim if v_head_dim is None else v_head_dim
        self._v = [allocate(self.formats.v, leading, v_dim, device, True) for _ in range(num_layers)]
        self.k, self.v = [parts[0] for parts in self._k], [parts[0] if parts else None for parts in self._v]

    @classmethod
    def for_model(cls, config, max_len: int, batch_size: int = 1, dtype=torch.float32, device="cpu",
                  formats: KVFormats | None = None):  # fmt: skip
        from kvlab.kv.state_pool import attach_states, kv_config

        full, config = config, kv_config(config)  # a hybrid's K/V: its attention layers only
        heads, k_dim, v_dim = kv_geometry(config)
        cache = cls(config.num_layers, heads, k_dim, max_len, batch_size, dtype, device,
                    windows=layer_windows(config), formats=formats, v_head_dim=v_dim)  # fmt: skip
        return attach_states(cache, full, batch_size, dtype, device)

    @property
    def device(self) -> torch.device:
        return self.k[0].device

    def tensors(self) -> list[torch.Tensor]:
        return [t for parts in self._k + self._v for t in parts]

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
        return build_metadata(self.length, num_new_tokens, self.batch_size, self.device, self._window_set())

    def commit(self, meta: AttentionMetadata) -> None:
        self.length = meta.start + meta.num_new_tokens

    def reserve(self, num_tokens: int) -> None:
        """Make room for `num_tokens` tokens per sequence, keeping what is cached.

        Grows by at least doubling, so a conversation reallocates a handful of times, never per step.
        """
        if num_tokens <= self.max_len:
            return
        new_len = max(num_tokens, 2 * self.max_len)
        for layers in (self._k, self._v):
            for parts in layers:
                for i, old in enumerate(parts):
                    new = old.new_zeros(old.shape[0], old.shape[1], new_len, *old.shape[3:])
                    new[:, :, : self.length] = old[:, :, : self.length]
                    parts[i] = new
        self.k, self.v = [parts[0] for parts in self._k], [parts[0] if parts else None for parts in self._v]
        self.max_len = new_len

    def truncate(self, length: int) -> None:
        """Forget every token from `length` on (their slots are overwritten later)."""
        self.length = min(self.length, length)

    def write(self, layer, k, v, meta):
        end = meta.start + k.shape[2]
        for parts, fmt, x in ((self._k[layer], self.formats.k, k), (self._v[layer], self.formats.v, v)):
            for t, value in zip(parts, fmt.encode(x) if parts else ()):  # no parts: MLA's absent V
                t[:, :, meta.start : end] = value

    def read(self, layer, meta):
        end = meta.start + meta.num_new_tokens
        k = self.formats.k.decode([t[:, :, :end] for t in self._k[layer]], self.dtype)
        if not self._v[layer]:  # MLA: no V stored (the latent's first numbers serve as values)
            return k, k[..., :0]
        v = self.formats.v.decode([t[:, :, :end] for t in self._v[layer]], self.dtype)
        return k, v


class NoCache(SingleBatchKVCache):
    """Keeps nothing: every pass must carry the whole sequence (the lab's recomputation mode)."""

    def __init__(self, num_layers: int, batch_size: int = 1, device: torch.device | str = "cpu",
                 windows: tuple[int | None, ...] = ()):  # fmt: skip
        self.num_layers = num_layers
        self.batch_size = batch_size
        self.device = torch.device(device)
        self.windows = windows
        self._current: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def for_model(cls, config, batch_size: int = 1, device="cpu") -> NoCache:
        from kvlab.kv.state_pool import attach_states, kv_config

        full, config = config, kv_config(config)
        return attach_states(cls(config.num_layers, batch_size, device, windows=layer_windows(config)), full,
                             batch_size, torch.float32, device)  # fmt: skip

    def plan(self, num_new_tokens: int) -> AttentionMetadata:
        return build_metadata(0, num_new_tokens, self.batch_size, self.device, self._window_set())

    def commit(self, meta: AttentionMetadata) -> None:
        self._current.clear()

    def write(self, layer, k, v, meta):
        self._current[layer] = (k, v)

    def read(self, layer, meta):
        return self._current[layer]
