"""BlockPool: the KV cache's blocks as numbers — who holds each one, and which can be reused.

Pure Python; the tensors live in `kv/paged.py` and are indexed by the same block ids.

Every block is in exactly one of three states:

    used     ref_count > 0: held by one request, or shared by several (a common prefix)
    cached   ref_count == 0 but registered: its K/V are still valid and findable by the prefix cache
    free     ref_count == 0, holds nothing anyone can find

`check_integrity()` asserts used + cached + free == total, and that the indexes agree.

Reuse order (the free queue, front first): plain free blocks before cached ones, and among cached
blocks the least recently released first (LRU). A request releases its blocks last-to-first, so a
prefix outlives the tail that hung off it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvlab.kv.prefix_cache import BlockHash


@dataclass(frozen=True)
class CachedBlock:
    """What a registered block holds: its tokens, after the block whose hash is `parent`.

    A full block also has its own `block_hash` and can be shared; a partial one (the last block of
    a finished or preempted sequence) can only be copied from.
    """

    parent: BlockHash
    token_ids: tuple[int, ...]
    block_hash: BlockHash | None


@dataclass(frozen=True)
class PoolCounts:
    total: int
    used: int
    cached: int
    free: int


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # front: next reused
        self.entries: dict[int, CachedBlock] = {}  # registered blocks
        self.by_hash: dict[BlockHash, int] = {}  # full registered blocks
        self.children: dict[BlockHash, dict[int, None]] = {}  # parent hash → registered blocks after it
        self.num_evictions = 0

    # ---- counts ------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now (free, or cached and evictable)."""
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def ref_count(self, block_id: int) -> int:
        return self.ref_counts[block_id]

    # ---- allocate, share, release ----------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """Take n blocks from the front of the free queue (evicting cached ones); each gets ref_count 1."""
        if n > len(self.free_queue):
            raise ValueError(f"{n} blocks asked for, {len(self.free_queue)} free")
        blocks = []
        for _ in range(n):
            block_id, _ = self.free_queue.popitem(last=False)
            if block_id in self.entries:
                self.unregister(block_id)
                self.num_evictions += 1
            self.ref_counts[block_id] = 1
            blocks.append(block_id)
        return blocks

    def touch(self, block_ids: Iterable[int]) -> None:
        """Share registered blocks with one more request (a prefix-cache hit)."""
        for b in block_ids:
            if self.ref_counts[b] == 0:
                del self.free_queue[b]
            self.ref_counts[b] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block, in the order given; a block nobody holds joins the free queue."""
        for b in block_ids:
            if self.ref_counts[b] <= 0:
                raise ValueError(f"block {b} freed more often than allocated")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_queue[b] = None  # cached: the back (evicted last, LRU)
                if b not in self.entries:
                    self.free_queue.move_to_end(b, last=False)  # holds nothing: reused first

    # ---- the prefix cache's index ------------------------------------------------------------------

    def register(self, block_id: int, parent: BlockHash, token_ids: Sequence[int], block_hash: BlockHash | None) -> bool:
        """Make a block findable. False (and nothing changes) if it already is, or another block has its hash."""
        if block_id in self.entries or (block_hash is not None and block_hash in self.by_hash):
            return False
        self.entries[block_id] = CachedBlock(parent, tuple(token_ids), block_hash)
        if block_hash is not None:
            self.by_hash[block_hash] = block_id
        self.children.setdefault(parent, {})[block_id] = None
        if self.ref_counts[block_id] == 0 and block_id in self.free_queue:
            self.free_queue.move_to_end(block_id)  # now worth keeping: evict it after the plain free blocks
        return True

    def unregister(self, block_id: int) -> None:
        entry = self.entries.pop(block_id)
        if entry.block_hash is not None:
            del self.by_hash[entry.block_hash]
        siblings = self.children[entry.parent]
        del siblings[block_id]
        if not siblings:
            del self.children[entry.parent]

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self.by_hash.get(block_hash)

    def longest_match(self, parent: BlockHash, token_ids: Sequence[int]) -> tuple[int | None, int]:
        """The registered block after `parent` whose tokens share the longest start with `token_ids`.

        Returns (block id, number of leading tokens in common), or (None, 0).
        """
        best, best_len = None, 0
        for b in self.children.get(parent, ()):
            cached = self.entries[b].token_ids
            n = 0
            for a, t in zip(cached, token_ids):
                if a != t:
                    break
                n += 1
            if n > best_len:
                best, best_len = b, n
        return best, best_len

    # ---- invariants ---------------------------------------------------------------------------

    def counts(self) -> PoolCounts:
        cached = sum(1 for b in self.free_queue if b in self.entries)
        return PoolCounts(self.num_blocks, self.num_used_blocks, cached, len(self.free_queue) - cached)

    def check_integrity(self) -> PoolCounts:
        """Assert the pool's bookkeeping is consistent; return its counts (used + cached + free == total)."""
        assert all(r >= 0 for r in self.ref_counts), "negative ref count"
        zero = {b for b, r in enumerate(self.ref_counts) if r == 0}
        assert set(self.free_queue) == zero, "free queue != blocks nobody holds"
        assert len(self.free_queue) == len(zero)
        for h, b in self.by_hash.items():
            assert self.entries[b].block_hash == h, f"block {b} indexed under a hash it does not have"
        for parent, kids in self.children.items():
            assert kids, "empty child set kept"
            for b in kids:
                assert self.entries[b].parent == parent
        for b, entry in self.entries.items():
            assert b in self.children[entry.parent]
            assert entry.block_hash is None or self.by_hash[entry.block_hash] == b
        c = self.counts()
        assert c.used + c.cached + c.free == c.total
        return c
