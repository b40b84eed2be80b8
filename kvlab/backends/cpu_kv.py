"""How decode.c reads the paged KV cache (kernels/step.h's KVStore and views), shared by the decode step
(backends/cpu.py) and a mixed pass's decode rows (backends/cpu_attention.py): whether a cache can be read
at all, one layer's K or V storage, and one attention group's block tables, key counts and windows.
Nothing here knows the model: the modules' path imports it without the decode step's layer descriptions."""

from __future__ import annotations

import torch

from kvlab.kernels.decode import MAX_HEAD_DIM, KVStore, kv_format_ids
from kvlab.kv.formats import unrotated
from kvlab.kv.layout import window_start


class GroupView:
    """One KV group's share of a decode step as decode.c reads it: slots, block tables (from the first
    block its window reaches), the keys each sequence's table holds, and where each window starts. Also a
    mixed pass's decode rows (cpu_attention.py)."""

    def __init__(self, cache, g: int, group, positions: torch.Tensor, slot_mapping: torch.Tensor | None = None):
        """`group`: the step's attention group in KV group g (one new token a sequence); `slot_mapping`: where
        the step writes each new token's K/V (None: already written, as a mixed pass's decode rows are)."""
        self.slot_mapping = slot_mapping
        self.slots = slot_mapping.data_ptr() if slot_mapping is not None else None
        bs, window = cache.block_size, cache.layout.groups[g].window
        self.positions = positions
        if window is None:  # the tables start at key 0
            self.table_start = torch.zeros_like(positions)  # [B]: the position of each table's first key
        else:
            self.table_start = torch.tensor([window_start(window, p) // bs * bs for p in positions.tolist()])
        self.num_keys = (positions + 1 - self.table_start).contiguous()  # [B]
        self.tables = group.block_tables.contiguous()
        self.tables_ptr = self.tables.data_ptr()
        self.stride, self.num_keys_ptr = self.tables.shape[1], self.num_keys.data_ptr()
        self.max_keys = int(group.num_keys)
        self._first: dict[int | None, torch.Tensor] = {}

    def first_key(self, window: int | None) -> int:
        """A pointer to [B]: each sequence's first key (in its table) that a layer with `window` sees."""
        if window not in self._first:
            if window is None:
                first = torch.zeros_like(self.num_keys)
            else:
                first = (self.positions - window + 1 - self.table_start).clamp(min=0).contiguous()
            self._first[window] = first
        return self._first[window].data_ptr()


def store(fmt: int, parts: list[torch.Tensor]) -> KVStore:
    """A layer's storage tensors (codes, then scales where the format has them) as decode.c reads them."""
    return KVStore(fmt, parts[0].data_ptr(), parts[1].data_ptr() if len(parts) > 1 else None)


def unreadable_reason(cache) -> str | None:
    """Why decode.c cannot read this paged cache (None: it can): its dtype, head size, formats, layout."""
    ids, D = kv_format_ids(), cache.head_dim
    if cache.dtype != torch.float32:
        return f"the KV cache is read as {str(cache.dtype).removeprefix('torch.')} (the C step reads float32)"
    if D > MAX_HEAD_DIM or D % 8:
        return f"head_dim {D} (the C step takes multiples of 8 up to {MAX_HEAD_DIM})"
    for side, fmt in (("keys", cache.formats.k), ("values", cache.formats.v)):
        if unrotated(fmt).name not in ids:
            return f"{side} stored as {fmt.name}, a format decode.c does not read"
    if not all(t.is_contiguous() and t.device.type == "cpu" for t in cache.tensors()):
        return "the KV cache's tensors are not contiguous CPU tensors"
    states = getattr(cache, "states", None)
    if states is not None and not all(t.dtype == torch.float32 and t.is_contiguous() for t in states.tensors()):
        return "the recurrent states are not float32 (the C step updates float32 states)"
    return None
