"""KVLayout: which layers share a block table, and which blocks a sliding window still needs.

Without sliding windows every layer shares one block table: a block holds `block_size` tokens of every
layer (the classic paged cache). With them (Gemma 3: 5 sliding layers of window W to 1 global), the
layers split into **KV groups** of equal size, each group one window (vLLM's hybrid allocator):

    gemma3-270m: 15 sliding + 3 full layers → groups of gcd(15, 3) = 3 layers
                 full {5, 11, 17}, sliding {0, 1, 2}, {3, 4, 6}, {7, 8, 9}, {10, 12, 13}, {14, 15, 16}

Every block of the one pool is then `block_size` tokens of the 3 layers of some group (layer
`group.layers[j]` reads and writes slot j of its group's blocks), and each request holds one block
table per group. A full group keeps every block; a sliding group frees a block as soon as no later
query can see it. The query at position p sees keys p − W + 1 … p, so after n computed tokens the next
query (position n) needs keys from n − W + 1 on: blocks before `(n − W + 1) // block_size` go back to the
pool (their table entries become NULL_BLOCK), and a sequence holds W − 1 tokens of each sliding layer
between steps, rounded out to whole blocks; the step's new token makes W, which is the figure
`kvlab mem` counts (equal block for block whenever n − W is a multiple of the block size).

`windowed=False` (llama.cpp's --swa-full) keeps the classic one-table layout: every layer keeps every
token and the window is only a mask (the baseline the benchmark compares against).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

NULL_BLOCK = -1  # a table entry whose block a sliding window no longer needs (never read)


def window_start(window: int | None, position: int) -> int:
    """The first key position a query at `position` sees (0 without a window)."""
    return 0 if window is None else max(0, position - window + 1)


@dataclass(frozen=True)
class KVGroup:
    """Layers sharing one block table: `layers[j]` uses slot j of each block; all of one window."""

    window: int | None  # sliding window in tokens; None: the group keeps every token
    layers: tuple[int, ...]

    def first_needed_block(self, num_computed: int, block_size: int) -> int:
        """The first block the next query (at position `num_computed`) still reads."""
        return window_start(self.window, num_computed) // block_size


@dataclass(frozen=True)
class KVLayout:
    groups: tuple[KVGroup, ...]
    layer_windows: tuple[int | None, ...]  # each layer's window: its attention mask, whatever its group keeps

    @classmethod
    def uniform(cls, layer_windows: tuple[int | None, ...]) -> KVLayout:
        """One table for every layer; windows are masks only."""
        return cls((KVGroup(None, tuple(range(len(layer_windows)))),), tuple(layer_windows))

    @classmethod
    def for_model(cls, config, windowed: bool = True) -> KVLayout:
        """The layout of `config`'s layers: KV groups by window when `windowed`, else one group."""
        windows = tuple(getattr(layer.mixer, "window", None) for layer in config.layers)
        return cls.for_windows(windows) if windowed else cls.uniform(windows)

    @classmethod
    def for_windows(cls, windows: tuple[int | None, ...]) -> KVLayout:
        """Groups of gcd(layers per window) layers, each of one window, ordered by their first layer."""
        if all(w is None for w in windows):
            return cls.uniform(windows)
        by_window: dict[int | None, list[int]] = {}
        for i, w in enumerate(windows):
            by_window.setdefault(w, []).append(i)
        size = math.gcd(*(len(layers) for layers in by_window.values()))
        groups = [KVGroup(w, tuple(layers[i : i + size])) for w, layers in by_window.items()
                  for i in range(0, len(layers), size)]  # fmt: skip
        return cls(tuple(sorted(groups, key=lambda g: g.layers[0])), tuple(windows))

    @property
    def num_layers(self) -> int:
        return len(self.layer_windows)

    @property
    def layers_per_block(self) -> int:
        return len(self.groups[0].layers)

    @property
    def is_windowed(self) -> bool:
        """Whether some group frees the blocks its window left behind."""
        return any(g.window is not None for g in self.groups)

    def placement(self) -> tuple[tuple[int, int], ...]:
        """(group, slot) of each layer."""
        place = {layer: (gi, j) for gi, g in enumerate(self.groups) for j, layer in enumerate(g.layers)}
        return tuple(place[i] for i in range(self.num_layers))

    # ---- what a sequence holds ---------------------------------------------------------------------

    def blocks_for_sequence(self, num_tokens: int, block_size: int) -> int:
        """Blocks a sequence of `num_tokens` computed tokens holds between steps, all groups."""
        end = -(-num_tokens // block_size)
        return sum(end - g.first_needed_block(num_tokens, block_size) for g in self.groups)

    def slots_for_sequence(self, num_tokens: int, block_size: int) -> int:
        """Token slots holding K/V in those blocks (a slot is one token of a group's layers)."""
        return sum(num_tokens - g.first_needed_block(num_tokens, block_size) * block_size for g in self.groups)

    def peak_blocks(self, num_tokens: int, block_size: int, chunk: int) -> int:
        """Most blocks one sequence of up to `num_tokens` holds inside a step of up to `chunk` new
        tokens: a sliding group's window before the chunk (W − 1 tokens), the chunk, one block of
        misalignment (vLLM's bound), never more than the whole sequence."""
        end = -(-num_tokens // block_size)
        total = 0
        for g in self.groups:
            span = end if g.window is None else min(end, -(-(g.window - 1 + chunk) // block_size) + 1)
            total += span
        return total
