"""KVCacheManager: block tables per request, on top of the BlockPool, with prefix caching.

Pure Python. The scheduler asks it three things:

    find_prefix(request)            which of the request's leading tokens are already cached?
    allocate_slots(request, n, hit) room for n more tokens (False-y when the pool is out of blocks)
    free(request)                   give every block back (the last, partial one stays findable)

and after each step `register_full_blocks(request)` makes newly filled blocks findable, and
`truncate(request, n)` forgets a request's K/V from token n on (tokens a verifier rejected).

A prefix hit has two parts: whole blocks found by their chained hash (shared: ref_count + 1), then,
in the block after them, the longest run of equal tokens in any registered block that follows the
same prefix (a partial block left by a finished request, or a full block that differs further on).
Those tokens cannot be shared — the new request will write after them — so they are copied into
a block of its own: a `BlockCopy` the runner performs before the step's forward. A chat turn that
repeats the previous turn's tokens therefore prefills only what is new, to the token.

Every chain starts at the request's root: `salted_root(request.cache_salt)` (ROOT when unsalted), so
requests with different salts find none of each other's blocks, whole or partial.

With sliding-window layers (`kv/layout.py`) a request holds one table per KV group, and
`slide_windows(request)` gives back, after each step, the blocks of sliding groups that no later query
can see (their entries become NULL_BLOCK; full groups keep everything). A prefix hit must then hold in
every group: a full group needs every block before the cut, a sliding group only the blocks the window
of the first computed token reaches — a cached prefix whose window blocks were evicted is not a hit
there, and the hit shrinks until every group has what it needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvlab.kv.block_pool import BlockPool, PoolCounts
from kvlab.kv.layout import NULL_BLOCK, KVLayout
from kvlab.kv.prefix_cache import BlockHash, PrefixCacheStats, hash_blocks, salted_root
from kvlab.request import Request


@dataclass(frozen=True)
class BlockCopy:
    """Copy the first `num_tokens` slots of block `src` into block `dst` (all layers, K and V)."""

    src: int
    dst: int
    num_tokens: int


@dataclass(frozen=True)
class BlockZero:
    """Zero newly allocated blocks: the pool's memory starts uninitialised (its pages are only touched
    when blocks are first used), and a decode batch reads, masked, past a sequence's last token — a NaN
    there would leak through the mask (0 × NaN)."""

    block_ids: tuple[int, ...]


BlockOp = BlockCopy | BlockZero


@dataclass
class PrefixHit:
    """Leading tokens of a request whose K/V are in the cache, in every KV group."""

    block_ids: list[list[int]] = field(default_factory=list)  # per KV group, whole blocks shared (NULL_BLOCK:
    # a block before a sliding window, not needed); empty: nothing shared
    num_tokens: int = 0  # tokens served from the cache: whole blocks plus the copied run
    copy_srcs: list[int] | None = None  # per KV group, the block whose first `copy_len` slots are copied
    copy_len: int = 0


@dataclass(frozen=True)
class RequestKV:
    """One request's share of the pool, between steps."""

    blocks: int  # blocks in its tables (every KV group)
    shared_blocks: int  # of those, blocks other requests hold too
    tokens: int  # token slots holding its K/V (summed over KV groups; one group: its computed tokens)
    unused_slots: int  # slots allocated but empty: the last block's free room, in each group


@dataclass(frozen=True)
class KVLedger:
    """Who holds what in the KV cache. `held_blocks` (shared blocks counted once) equals `pool.used`."""

    block_size: int
    requests: dict[str, RequestKV]
    held_blocks: int
    pool: PoolCounts

    @property
    def is_balanced(self) -> bool:
        return self.held_blocks == self.pool.used

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.requests.values())

    @property
    def unused_slots(self) -> int:
        return sum(r.unused_slots for r in self.requests.values())


class KVCacheManager:
    """Block tables per request and KV group (`kv/layout.py`; one group unless the model has sliding
    windows), prefix hits, sliding windows' released blocks, truncation, the ledger."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 layout: KVLayout | None = None):  # fmt: skip
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.layout = layout or KVLayout.uniform((None,))
        self.groups = self.layout.groups
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[list[int]]] = {}  # request → one table per KV group
        self.stats = PrefixCacheStats()
        self._requests: dict[str, Request] = {}
        self._hashes: dict[str, list[BlockHash]] = {}  # chained hashes of each request's full blocks so far
        self._num_registered: dict[str, int] = {}  # leading blocks of each table already findable
        self._released: dict[str, list[int]] = {}  # per KV group: blocks before this one are NULL (window)
        self._pending_ops: list[BlockOp] = []  # copy-on-write after a truncation: done before the next forward
        # full blocks registered since the last take_new_blocks() (key, block id), kept only for a second
        # tier that copies them out (kv/prompt_cache.py: the disk)
        self.track_new_blocks = False
        self._new_blocks: list[tuple[BlockHash, int]] = []
        # a block's key in the pool's index is its chained hash, prefixed by its KV group (none for group 0):
        # the groups' blocks for the same tokens are different blocks, found and evicted independently
        self._prefixes = [b""] + [f"kv{g}/".encode() for g in range(1, len(self.groups))]

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_tokens_capacity(self) -> int:
        return self.pool.num_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def max_concurrency(self, context: int) -> float:
        """Sequences of `context` tokens the pool holds at once (between steps, nothing shared)."""
        return self.pool.num_blocks / self.layout.blocks_for_sequence(context, self.block_size)

    def _key(self, g: int, block_hash: BlockHash) -> BlockHash:
        return self._prefixes[g] + block_hash

    def _block_hashes(self, request: Request) -> list[BlockHash]:
        known = self._hashes.setdefault(request.request_id, [])
        return hash_blocks(request.all_token_ids, self.block_size, known, salted_root(request.cache_salt))

    def _parent(self, g: int, request: Request, hashes: list[BlockHash], i: int) -> BlockHash:
        """The key block i of group g chains from: block i − 1's, or the request's (salted) root."""
        return self._key(g, hashes[i - 1] if i else salted_root(request.cache_salt))

    # ---- admission -------------------------------------------------------------------------------

    def find_prefix(self, request: Request) -> PrefixHit:
        """The longest cached start of the request's tokens, leaving at least one token to compute.

        Every KV group must hold it: a full group every block before the cut, a sliding group the
        blocks its window reaches from the first computed token back (earlier ones are not needed).
        """
        if not self.enable_prefix_caching or request.num_tokens < 2:
            return PrefixHit()
        bs, tokens = self.block_size, request.all_token_ids
        limit = request.num_tokens - 1  # the last token must go through the model: its logits are sampled
        hashes = self._block_hashes(request)[: limit // bs]
        found = [self._lookups(g, group, hashes) for g, group in enumerate(self.groups)]
        whole = self._common_hit(found, len(hashes))
        # a sliding group takes only its window's blocks: the ones before it are not needed (NULL_BLOCK)
        firsts = [group.first_needed_block(whole * bs, bs) for group in self.groups]
        blocks = [[NULL_BLOCK] * first + ids[first:whole] for ids, first in zip(found, firsts)]
        start = whole * bs
        tail = tokens[start : min(start + bs, limit)]
        parents = [self._parent(g, request, hashes, whole) for g in range(len(self.groups))]
        matches = [self.pool.longest_match(parent, tail) for parent in parents]
        run = min(n for _, n in matches)
        srcs = [src for src, _ in matches] if run else None
        return PrefixHit(blocks, start + run, srcs, run)

    def _lookups(self, g: int, group, hashes: list[BlockHash]) -> list[int | None]:
        """Group g's cached block for each hash (a full group stops at its first miss)."""
        found = []
        for h in hashes:
            found.append(self.pool.lookup(self._key(g, h)))
            if found[-1] is None and group.window is None:
                break
        return found + [None] * (len(hashes) - len(found))

    def _common_hit(self, found: list[list[int | None]], limit: int) -> int:
        """The most whole blocks every group can serve: full groups all of them, sliding groups the
        blocks the window of the first computed token reaches."""
        bs, whole = self.block_size, limit
        for ids, group in zip(found, self.groups):
            if group.window is None:
                whole = min(whole, next((i for i, b in enumerate(ids) if b is None), len(ids)))
        while whole > 0:
            if all(all(b is not None for b in ids[group.first_needed_block(whole * bs, bs) : whole])
                   for ids, group in zip(found, self.groups) if group.window is not None):  # fmt: skip
                return whole
            whole -= 1
        return 0

    def allocate_slots(
        self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None
    ) -> list[BlockOp] | None:
        """Make room for `num_new_tokens` more tokens (after the prefix `hit`, on admission).

        Returns the block operations the runner must do, in order, before the step's forward (zero
        the new blocks, copy a partial prefix run), or None when the pool has too few blocks — and
        then nothing has changed.
        """
        rid, num_groups = request.request_id, len(self.groups)
        tables = self.block_tables.get(rid) or [[] for _ in range(num_groups)]
        computed = hit.num_tokens if hit is not None else request.num_computed_tokens
        shared = hit.block_ids if hit is not None and hit.block_ids else [[] for _ in range(num_groups)]
        end = self.blocks_for(computed + num_new_tokens)
        needed = [max(end - len(t) - len(s), 0) for t, s in zip(tables, shared)]
        held_shared = [b for blocks in shared for b in blocks if b != NULL_BLOCK]
        # with several groups a copy source is held while blocks are allocated: no group's new block is
        # another group's source (one group: the source may become the request's own block, see below)
        srcs = hit.copy_srcs if hit is not None and hit.copy_srcs else []
        protect = list(dict.fromkeys(srcs)) if num_groups > 1 else []
        reclaimed = sum(1 for b in held_shared + protect if self.pool.ref_count(b) == 0)  # leave the free queue
        if sum(needed) > self.pool.num_free_blocks - reclaimed:
            return None
        self.pool.touch(held_shared + protect)
        self.block_tables[rid] = tables
        self._requests[rid] = request
        self._released.setdefault(rid, [0] * num_groups)
        if hit is not None and hit.block_ids:
            self._num_registered[rid] = len(shared[0])
        ops: list[BlockOp] = []
        for g, (table, blocks, n) in enumerate(zip(tables, shared, needed)):
            table.extend(blocks)
            new = self.pool.allocate(n)
            table.extend(new)
            ops += self._first_ops(new, table[len(blocks)] if srcs else None, srcs[g] if srcs else None,
                                   hit.copy_len if hit is not None else 0)  # fmt: skip
        self.pool.free(protect)
        return [op for op in ops if not isinstance(op, BlockZero) or op.block_ids]

    @staticmethod
    def _first_ops(new: list[int], dst: int | None, src: int | None, copy_len: int) -> list[BlockOp]:
        """Zero a group's new blocks and copy its partial prefix run into the first of them."""
        if src is None:
            return [BlockZero(tuple(new))]
        rest = tuple(b for b in new if b != dst)
        if src == dst:  # the source itself became the request's block: its first slots are already right
            return [BlockZero(rest)]
        # the copy's source may be a cached block just reallocated here: read it before zeroing it
        return [BlockZero((dst,)), BlockCopy(src, dst, copy_len), BlockZero(rest)]

    # ---- after a step ----------------------------------------------------------------------------

    def register_full_blocks(self, request: Request) -> None:
        """Make every block the request has filled findable by later requests."""
        if not self.enable_prefix_caching:
            return
        rid, bs = request.request_id, self.block_size
        done, full = self._num_registered.get(rid, 0), request.num_computed_tokens // bs
        if full <= done:
            return
        hashes, tokens = self._block_hashes(request), request.all_token_ids
        # a request salted by its own id (prompt log-probabilities: kvlab/engine.py) is never found again
        track = self.track_new_blocks and getattr(request.params, "prompt_logprobs", None) is None
        for g, table in enumerate(self.block_tables[rid]):
            for i in range(done, full):
                if table[i] != NULL_BLOCK:  # not a block before a sliding window the request never held
                    key = self._key(g, hashes[i])
                    if (self.pool.register(table[i], self._parent(g, request, hashes, i), tokens[i * bs : (i + 1) * bs],
                                           key) and track):  # fmt: skip
                        self._new_blocks.append((key, table[i]))
        self._num_registered[rid] = full

    def take_new_blocks(self) -> list[tuple[BlockHash, int]]:
        """(key, block id) of every full block registered since the last call (with `track_new_blocks`).
        Their K/V are final; the blocks can be reused from the next step's allocations on."""
        blocks, self._new_blocks = self._new_blocks, []
        return blocks

    # ---- a second tier (kv/prompt_cache.py): blocks loaded back from elsewhere ------------------

    def prompt_hashes(self, request: Request) -> list[BlockHash]:
        """Chained hashes of the whole blocks before the request's last token (not memoised: the request
        may never reach the scheduler, and `free` would not forget it)."""
        limit = (request.num_tokens - 1) // self.block_size
        return hash_blocks(request.all_token_ids[: limit * self.block_size], self.block_size, [],
                           salted_root(request.cache_salt))  # fmt: skip

    def group_keys(self, block_hash: BlockHash) -> list[BlockHash]:
        """The key of each KV group's block for the tokens of `block_hash`."""
        return [self._key(g, block_hash) for g in range(len(self.groups))]

    def adopt(self, request: Request, hashes: list[BlockHash], i: int, g: int, block_id: int) -> bool:
        """Make `block_id` (allocated by the caller, its K/V loaded) findable as block i of KV group g of
        the request's tokens (`hashes`: `prompt_hashes(request)`). False when that block is already
        findable (the caller frees its copy)."""
        tokens = request.all_token_ids[i * self.block_size : (i + 1) * self.block_size]
        return self.pool.register(block_id, self._parent(g, request, hashes, i), tokens, self._key(g, hashes[i]))

    def slide_windows(self, request: Request) -> None:
        """Give back every block of a sliding group that no later query of the request can see (the
        next query, at position num_computed_tokens, sees the window's W − 1 keys before it). Call it
        after `register_full_blocks`: released full blocks stay cached for prefix hits."""
        rid = request.request_id
        released = self._released.get(rid)
        if released is None:
            return
        for g, (group, table) in enumerate(zip(self.groups, self.block_tables[rid])):
            if group.window is None:
                continue
            first = min(group.first_needed_block(request.num_computed_tokens, self.block_size), len(table))
            dropped = [table[i] for i in range(released[g], first) if table[i] != NULL_BLOCK]
            table[released[g] : first] = [NULL_BLOCK] * (first - released[g])
            released[g] = max(released[g], first)
            self.pool.free(dropped)

    def free(self, request: Request) -> None:
        """Release the request's blocks, last first; its partial last block stays findable (copy only)."""
        rid, bs = request.request_id, self.block_size
        tables = self.block_tables.pop(rid, None)
        if tables is None:
            return
        n = request.num_computed_tokens
        if self.enable_prefix_caching and n % bs:
            i = n // bs
            hashes, tail = self._block_hashes(request), request.all_token_ids[i * bs : n]
            for g, table in enumerate(tables):
                parent = self._parent(g, request, hashes, i)
                # identical requests end with identical tails: keep one findable copy, not one per request
                if i < len(table) and table[i] != NULL_BLOCK and self.pool.longest_match(parent, tail)[1] < len(tail):
                    self.pool.register(table[i], parent, tail, None)
        # last block first, each block in every group in turn: a group's copy of a prefix block is
        # evicted about when the others' are
        blocks = [t[i] for i in reversed(range(max(map(len, tables)))) for t in tables if i < len(t)]
        self.pool.free(b for b in blocks if b != NULL_BLOCK)
        for d in (self._requests, self._hashes, self._num_registered, self._released):
            d.pop(rid, None)

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Forget the request's K/V from token `num_tokens` on: whole blocks past it go back to the pool,
        and the block the cut falls in becomes the request's own before it is written again.

        That block may be shared through the prefix cache (another request holds it: it is copied, up
        to the cut, into a new block — a BlockCopy done before the next forward) or only findable (it is
        made unfindable). Memoised hashes of the blocks the request will rewrite are forgotten.
        Blocks past the cut that are registered stay cached: their K/V are still right for their tokens.
        A sliding group must still hold the blocks the window of token `num_tokens` reaches.
        """
        rid, bs = request.request_id, self.block_size
        tables = self.block_tables[rid]
        keep, full = self.blocks_for(num_tokens), num_tokens // bs
        for group, table in zip(self.groups, tables):
            if not 0 <= num_tokens <= len(table) * bs:
                raise ValueError(f"cannot truncate {rid} to {num_tokens} tokens: its table holds {len(table) * bs}")
            if NULL_BLOCK in table[group.first_needed_block(num_tokens, bs) : keep]:
                raise ValueError(f"cannot truncate {rid} to {num_tokens} tokens: its sliding window's blocks are gone")
        for table in tables:
            dropped = table[keep:]
            del table[keep:]
            self.pool.free(reversed([b for b in dropped if b != NULL_BLOCK]))
        del self._hashes.setdefault(rid, [])[full:]
        self._num_registered[rid] = min(self._num_registered.get(rid, 0), full)
        request.num_computed_tokens = min(request.num_computed_tokens, num_tokens)
        if num_tokens % bs == 0:
            return
        for table in tables:
            self._own_cut_block(rid, table, full, num_tokens % bs)

    def _own_cut_block(self, rid: str, table: list[int], i: int, num_kept: int) -> None:
        """Make block i of a table (where a truncation cut falls) the request's own."""
        block = table[i]
        if self.pool.ref_count(block) > 1:  # shared: copy what stays into a block of its own
            if self.pool.num_free_blocks == 0:
                raise RuntimeError(f"no free block to copy {rid}'s shared block {block} into")
            (own,) = self.pool.allocate(1)
            self._pending_ops += [BlockZero((own,)), BlockCopy(block, own, num_kept)]
            table[i] = own
            self.pool.free([block])
        elif block in self.pool.entries:  # findable, but held only here: stop offering it
            self.pool.unregister(block)

    def fork_state(self, parent: Request, child: Request) -> None:
        """A choice forked from `parent` after its prompt: nothing beyond the shared blocks here (a hybrid's
        recurrent state is copied by kv/state_slots.py's HybridKVCacheManager)."""

    def take_pending_ops(self) -> list[BlockOp]:
        """Block operations owed since the last step (copy-on-write after truncation); the scheduler
        puts them first in the next step's plan."""
        ops, self._pending_ops = self._pending_ops, []
        return ops

    # ---- accounting ------------------------------------------------------------------------------

    def ledger(self) -> KVLedger:
        """Blocks held per request and in all; call it between steps."""
        held: set[int] = set()
        requests = {}
        for rid, tables in self.block_tables.items():
            requests[rid] = self._request_kv(self._requests[rid].num_computed_tokens, tables)
            held.update(b for t in tables for b in t if b != NULL_BLOCK)
        return KVLedger(self.block_size, requests, len(held), self.pool.counts())

    def _request_kv(self, num_tokens: int, tables: list[list[int]]) -> RequestKV:
        bs = self.block_size
        blocks = [(i, b) for t in tables for i, b in enumerate(t) if b != NULL_BLOCK]
        tokens = sum(min(bs, max(0, num_tokens - i * bs)) for i, _ in blocks)
        shared = sum(1 for _, b in blocks if self.pool.ref_count(b) > 1)
        return RequestKV(len(blocks), shared, tokens, len(blocks) * bs - tokens)
