"""The paged KV cache: one pool of fixed-size blocks, read through block tables.

    k[layer]: [num_blocks, block_size, Hkv, D]   (v alike)      slot = block * block_size + offset

Each is stored in its format (`kv/formats.py`): a float tensor, or codes plus scale tensors shaped
[num_blocks, block_size, Hkv, ...]; new tokens are quantized as they are written, gathered blocks
dequantized as they are read, and block copies and zeroing touch every storage tensor.

With sliding-window layers the layers form KV groups (`kv/layout.py`): each group has its own block
table per request and its layers share the pool's tensors — layer `group.layers[j]` is slot j, so
`k[layer]` is the same tensor for the j-th layer of every group, and a block id means "these
block_size tokens of one group's layers". `tensors()` lists each tensor once.

A step packs every scheduled token into one row ([1, N]: decodes first, then each prompt chunk), so
linear layers see all of them at once. Attention cannot be packed that way — each sequence has its
own keys — so `attend` splits the step into groups (`PagedMetadata.groups`):

    decodes      B sequences × 1 new token: their keys gathered through the block tables into
                 [B, Hkv, L, D] (L = the longest), a key mask for the shorter ones, one attention call
    prompt chunk 1 sequence × T new tokens after `start` cached ones: keys [1, Hkv, start + T, D],
                 causal mask offset by start
    fresh chunks B sequences × T new tokens each, nothing cached before them (a burst of new
                 prompts of one length): keys [B, Hkv, T, D], causal, one call for all

New keys and values are written first, through the slot mapping, so a group reads its own tokens.
A sliding group's tables start at the first block its window reaches; each attention group's mask,
`meta.for_window(W)`, hides what lies before a query's window.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from kvlab.backends.ops import current_ops
from kvlab.kv.cache import AttentionMetadata, KVCache, allocate, kv_geometry
from kvlab.kv.formats import KVFormats
from kvlab.kv.layout import KVLayout
from kvlab.kv.manager import BlockZero


@dataclass
class AttentionGroup:
    """Sequences of one step that attend in one call, T tokens each: every decode (T = 1), one prompt chunk
    (B = 1), or fresh prompt chunks of one length (nothing cached before them)."""

    lo: int  # first token of the group in the step's packed order
    hi: int  # one past its last
    block_tables: torch.Tensor  # [B, num_table_blocks] long; short tables padded (the padding is masked)
    num_keys: int  # L: keys gathered for the longest sequence, this step's tokens included
    meta: AttentionMetadata  # positions [B, T]; attn_mask None, causal-after-start, key padding, window

    @property
    def batch_size(self) -> int:
        return self.block_tables.shape[0]


@dataclass
class KVGroupMetadata:
    """One KV group's share of a step: where its layers write each token, and what each attention group reads."""

    slot_mapping: torch.Tensor  # [N] long: the slot each new token's K/V is written to
    groups: list[AttentionGroup]  # in packed order, covering tokens 0..N-1 once


@dataclass
class PagedMetadata:
    """A step's packed tokens: where each one sits, where its K/V is written, and who attends to what."""

    positions: torch.Tensor  # [1, N] long: absolute position of each packed token (its RoPE angle)
    kv_groups: list[KVGroupMetadata]  # one per KV group of the cache's layout
    states: object = None  # a hybrid's StateMetadata (kv/state_slots.py): which state slot each token continues

    @property
    def slot_mapping(self) -> torch.Tensor:
        """The slot mapping of a cache with one KV group (every layer shares one table)."""
        return self._only().slot_mapping

    @property
    def groups(self) -> list[AttentionGroup]:
        """The attention groups of a cache with one KV group."""
        return self._only().groups

    def _only(self) -> KVGroupMetadata:
        if len(self.kv_groups) != 1:
            raise ValueError("this step spans several KV groups: read it group by group (kv_groups)")
        return self.kv_groups[0]


class PagedKVCache(KVCache):
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        layout: KVLayout | None = None,
        formats: KVFormats | None = None,
        v_head_dim: int | None = None,  # None: head_dim; 0: no V (MLA's latent, kv.cache.kv_geometry)
    ):
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.dtype = dtype  # what attention reads: the stored vectors, decoded
        self.formats = formats or KVFormats.plain(dtype)
        self.states = None  # a hybrid model's StatePool (kv/state_pool.py), set by runner/pipeline.py
        self.layout = layout or KVLayout.uniform((None,) * num_layers)
        self.windows = self.layout.layer_windows
        self.placement = self.layout.placement()  # (KV group, slot) of each layer
        leading = (num_blocks, block_size, num_kv_heads)
        # uninitialised: on a CPU the pages stay untouched (not resident) until a block is first used;
        # every block is zeroed when allocated (kv.manager.BlockZero)
        slots = self.layout.layers_per_block
        self._k = [allocate(self.formats.k, leading, head_dim, device, False) for _ in range(slots)]
        v_dim = head_dim if v_head_dim is None else v_head_dim
        self._v = [allocate(self.formats.v, leading, v_dim, device, False) for _ in range(slots)]
        self.k_parts = [self._k[slot] for _, slot in self.placement]  # per layer (layers of different groups alias)
        self.v_parts = [self._v[slot] for _, slot in self.placement]
        self.k = [parts[0] for parts in self.k_parts]  # the floats of a float format, the codes of a quantized one
        self.v = [parts[0] if parts else None for parts in self.v_parts]

    @classmethod
    def for_model(cls, config, num_blocks: int, block_size: int = 16, dtype=torch.float32, device="cpu",
                  layout: KVLayout | None = None, formats: KVFormats | None = None):  # fmt: skip
        heads, k_dim, v_dim = kv_geometry(config)
        return cls(config.num_layers, num_blocks, block_size, heads, k_dim, dtype, device,
                   layout or KVLayout.for_model(config), formats, v_head_dim=v_dim)  # fmt: skip

    @classmethod
    def bytes_per_block_for(cls, config, dtype: torch.dtype, block_size: int, layout: KVLayout,
                            formats: KVFormats | None = None) -> int:  # fmt: skip
        """Bytes of one block: block_size tokens of the layout's layers per block (K, V and any scales)."""
        per_token = cls.bytes_per_token_for(config, dtype, formats)
        return per_token * layout.layers_per_block // config.num_layers * block_size

    @property
    def device(self) -> torch.device:
        return self.k[0].device

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the pool, once (codes and scales); each is indexed by block first, so a block
        operation touches all of them."""
        return [t for parts in self._k + self._v for t in parts]

    def bytes_per_token(self) -> int:
        """Bytes one token slot of a block takes: K and V of the layers a block holds (every layer
        with one KV group)."""
        return self.bytes_per_block() // self.block_size

    def bytes_per_block(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.tensors())

    # ---- writes and reads -------------------------------------------------------------------------

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: KVGroupMetadata) -> None:
        """k, v [1, Hkv, N, D] of the step's packed tokens → their slots (the layer's KV group's mapping):
        by the device's ops where they take it (the CPU kernels' encoder), else encoded here and copied in."""
        ops = current_ops()
        for parts, fmt, x in ((self.k_parts[layer], self.formats.k, k), (self.v_parts[layer], self.formats.v, v)):
            rows = x[0].transpose(0, 1)  # [N, Hkv, D]
            if not parts or ops.kv_write(fmt, rows, meta.slot_mapping, parts):
                continue
            for t, value in zip(parts, fmt.encode(rows)):  # [N, Hkv, ...] each
                t.view(-1, *t.shape[2:]).index_copy_(0, meta.slot_mapping, value)

    def gather(self, layer: int, group: AttentionGroup) -> tuple[torch.Tensor, torch.Tensor]:
        """Every key and value of the group's sequences: [B, Hkv, L, D] each (padding past short ones)."""
        B, L = group.batch_size, group.num_keys
        blocks = group.block_tables.view(-1)
        out = []
        for parts, fmt in ((self.k_parts[layer], self.formats.k), (self.v_parts[layer], self.formats.v)):
            if not parts:  # MLA: no V stored (the latent's first numbers serve as values)
                out.append(out[0][..., :0])
                continue
            x = current_ops().kv_read(fmt, parts, blocks, self.dtype)  # the kernels' decode, or None
            if x is None:  # whole blocks as rows: index_select copies rows, several times faster than k[tables]
                rows = [t.view(self.num_blocks, -1).index_select(0, blocks).view(B, -1, *t.shape[2:]) for t in parts]
                x = fmt.decode(rows, self.dtype)  # [B, blocks·bs, Hkv, D]
            else:
                x = x.view(B, -1, *x.shape[1:])
            out.append(x[:, :L].transpose(1, 2))
        return out[0], out[1]

    def read(self, layer: int, meta: PagedMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of a step with a single group (see `attend` for the general case)."""
        view = meta.kv_groups[self.placement[layer][0]]
        if len(view.groups) != 1:
            raise ValueError("a paged step with several attention groups is read group by group (attend)")
        return self.gather(layer, view.groups[0])

    def attend(self, layer: int, q, k, v, meta: PagedMetadata, attention, softmax=None) -> torch.Tensor:
        """q [1, H, N, D], k, v [1, Hkv, N, D] packed → [1, H, N, D]: each group attends to its own keys.
        A group of one-token rows (a mixed pass's decodes) reads the stored codes in place where the
        device's ops take it (`softmax`: what `attention` computes; backends/cpu_attention.py)."""
        g = self.placement[layer][0]
        view = meta.kv_groups[g]  # the layer's KV group: its slots and tables
        window = self.window(layer)
        self.write(layer, k, v, view)
        outs = []
        ops = current_ops()
        for group in view.groups:
            if softmax is not None and group.hi - group.lo == group.batch_size:  # one token a sequence
                out = ops.paged_attention(self, layer, q[0, :, group.lo : group.hi], group, g,
                                          meta.positions[0, group.lo : group.hi], softmax)  # fmt: skip
                if out is not None:
                    outs.append(out.unsqueeze(0))  # [1, H, B, D]
                    continue
            k_all, v_all = self.gather(layer, group)
            B = group.batch_size  # B sequences of T tokens each, packed one after another
            q_batch = q[0, :, group.lo : group.hi].unflatten(1, (B, -1)).transpose(0, 1)  # [B, H, T, D]
            out = attention(q_batch, k_all, v_all, group.meta.for_window(window))  # [B, H, T, D]
            outs.append(out.transpose(0, 1).flatten(1, 2).unsqueeze(0))  # back to [1, H, B·T, D]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    def apply(self, ops: Iterable) -> None:
        """Do the KV manager's block operations (kv.manager.BlockZero, BlockCopy), in order, in every layer.
        Consecutive zeroings are gathered into runs of adjacent blocks, one fill per run and tensor."""
        zero: list[int] = []
        for op in [*ops, None]:
            if isinstance(op, BlockZero):
                zero.extend(op.block_ids)
                continue
            if zero:  # runs of consecutive blocks, each zeroed as one slice (a fill of many ids was ~5x slower)
                for lo, hi in _runs(sorted(set(zero))):
                    for t in self.tensors():
                        t[lo:hi].zero_()
                zero = []
            if op is not None:
                for t in self.tensors():
                    t[op.dst, : op.num_tokens] = t[op.src, : op.num_tokens]


def _runs(ids: list[int]) -> list[tuple[int, int]]:
    """Sorted distinct ids as [lo, hi) runs of consecutive ones: [3, 4, 5, 9] → [(3, 6), (9, 10)]."""
    runs: list[tuple[int, int]] = []
    for i in ids:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs
