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
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvlab.kv.block_pool import BlockPool, PoolCounts
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
    """Leading tokens of a request whose K/V are in the cache."""

    block_ids: list[int] = field(default_factory=list)  # whole blocks, shared
    num_tokens: int = 0  # tokens served from the cache: whole blocks plus the copied run
    copy_src: int | None = None  # block whose first `copy_len` slots are copied (None: no partial run)
    copy_len: int = 0


@dataclass(frozen=True)
class RequestKV:
    """One request's share of the pool, between steps."""

    blocks: int  # blocks in its table
    shared_blocks: int  # of those, blocks other requests hold too
    tokens: int  # tokens whose K/V it holds
    unused_slots: int  # slots allocated but empty: the last block's free room


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
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}
        self.stats = PrefixCacheStats()
        self._requests: dict[str, Request] = {}
        self._hashes: dict[str, list[BlockHash]] = {}  # chained hashes of each request's full blocks so far
        self._num_registered: dict[str, int] = {}  # leading blocks of each table already findable
        self._pending_ops: list[BlockOp] = []  # copy-on-write after a truncation: done before the next forward

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_tokens_capacity(self) -> int:
        return self.pool.num_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _block_hashes(self, request: Request) -> list[BlockHash]:
        known = self._hashes.setdefault(request.request_id, [])
        return hash_blocks(request.all_token_ids, self.block_size, known, salted_root(request.cache_salt))

    # ---- admission -------------------------------------------------------------------------------

    def find_prefix(self, request: Request) -> PrefixHit:
        """The longest cached start of the request's tokens, leaving at least one token to compute."""
        if not self.enable_prefix_caching or request.num_tokens < 2:
            return PrefixHit()
        bs, tokens = self.block_size, request.all_token_ids
        limit = request.num_tokens - 1  # the last token must go through the model: its logits are sampled
        hashes = self._block_hashes(request)
        blocks: list[int] = []
        for h in hashes[: limit // bs]:
            b = self.pool.lookup(h)
            if b is None:
                break
            blocks.append(b)
        start = len(blocks) * bs
        parent = hashes[len(blocks) - 1] if blocks else salted_root(request.cache_salt)
        src, run = self.pool.longest_match(parent, tokens[start : min(start + bs, limit)])
        return PrefixHit(blocks, start + run, src, run)

    def allocate_slots(self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> list[BlockOp] | None:
        """Make room for `num_new_tokens` more tokens (after the prefix `hit`, on admission).

        Returns the block operations the runner must do, in order, before the step's forward (zero
        the new blocks, copy a partial prefix run), or None when the pool has too few blocks — and
        then nothing has changed.
        """
        rid = request.request_id
        table = self.block_tables.get(rid, [])
        computed = hit.num_tokens if hit is not None else request.num_computed_tokens
        shared = hit.block_ids if hit is not None else []
        needed = max(self.blocks_for(computed + num_new_tokens) - len(table) - len(shared), 0)
        reclaimed = sum(1 for b in shared if self.pool.ref_count(b) == 0)  # cached blocks leave the free queue
        if needed > self.pool.num_free_blocks - reclaimed:
            return None
        self.pool.touch(shared)
        table = self.block_tables.setdefault(rid, table)
        self._requests[rid] = request
        if shared:
            self._num_registered[rid] = len(shared)
        table.extend(shared)
        new = self.pool.allocate(needed)
        table.extend(new)
        if hit is None or hit.copy_src is None:
            return [BlockZero(tuple(new))] if new else []
        # the copy's source may be a cached block just reallocated here: read it before zeroing it
        src, dst = hit.copy_src, table[len(shared)]
        if src == dst:  # the source itself became the request's block: its first slots are already right
            rest = tuple(b for b in new if b != dst)
            return [BlockZero(rest)] if rest else []
        rest = tuple(b for b in new if b != dst)
        return [BlockZero((dst,)), BlockCopy(src, dst, hit.copy_len)] + ([BlockZero(rest)] if rest else [])

    # ---- after a step ----------------------------------------------------------------------------

    def register_full_blocks(self, request: Request) -> None:
        """Make every block the request has filled findable by later requests."""
        if not self.enable_prefix_caching:
            return
        rid, bs = request.request_id, self.block_size
        done, full = self._num_registered.get(rid, 0), request.num_computed_tokens // bs
        if full <= done:
            return
        hashes, table, tokens = self._block_hashes(request), self.block_tables[rid], request.all_token_ids
        root = salted_root(request.cache_salt)
        for i in range(done, full):
            self.pool.register(table[i], hashes[i - 1] if i else root, tokens[i * bs : (i + 1) * bs], hashes[i])
        self._num_registered[rid] = full

    def free(self, request: Request) -> None:
        """Release the request's blocks, last first; its partial last block stays findable (copy only)."""
        rid, bs = request.request_id, self.block_size
        table = self.block_tables.pop(rid, None)
        if table is None:
            return
        n = request.num_computed_tokens
        if self.enable_prefix_caching and n % bs and n // bs < len(table):
            i = n // bs
            hashes = self._block_hashes(request)
            parent, tail = hashes[i - 1] if i else salted_root(request.cache_salt), request.all_token_ids[i * bs : n]
            # identical requests end with identical tails: keep one findable copy, not one per request
            if self.pool.longest_match(parent, tail)[1] < len(tail):
                self.pool.register(table[i], parent, tail, None)
        self.pool.free(reversed(table))
        for d in (self._requests, self._hashes, self._num_registered):
            d.pop(rid, None)

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Forget the request's K/V from token `num_tokens` on: whole blocks past it go back to the pool,
        and the block the cut falls in becomes the request's own before it is written again.

        That block may be shared through the prefix cache (another request holds it: it is copied, up
        to the cut, into a new block — a BlockCopy done before the next forward) or only findable (it is
        made unfindable). Memoised hashes of the blocks the request will rewrite are forgotten.
        Blocks past the cut that are registered stay cached: their K/V are still right for their tokens.
        """
        rid, bs = request.request_id, self.block_size
        table = self.block_tables[rid]
        if not 0 <= num_tokens <= len(table) * bs:
            raise ValueError(f"cannot truncate {rid} to {num_tokens} tokens: its table holds {len(table) * bs}")
        keep, full = self.blocks_for(num_tokens), num_tokens // bs
        dropped = table[keep:]
        del table[keep:]
        self.pool.free(reversed(dropped))
        del self._hashes.setdefault(rid, [])[full:]
        self._num_registered[rid] = min(self._num_registered.get(rid, 0), full)
        request.num_computed_tokens = min(request.num_computed_tokens, num_tokens)
        if num_tokens % bs == 0:
            return
        block = table[full]
        if self.pool.ref_count(block) > 1:  # shared: copy what stays into a block of its own
            if self.pool.num_free_blocks == 0:
                raise RuntimeError(f"no free block to copy {rid}'s shared block {block} into")
            (own,) = self.pool.allocate(1)
            self._pending_ops += [BlockZero((own,)), BlockCopy(block, own, num_tokens % bs)]
            table[full] = own
            self.pool.free([block])
        elif block in self.pool.entries:  # findable, but held only here: stop offering it
            self.pool.unregister(block)

    def take_pending_ops(self) -> list[BlockOp]:
        """Block operations owed since the last step (copy-on-write after truncation); the scheduler
        puts them first in the next step's plan."""
        ops, self._pending_ops = self._pending_ops, []
        return ops

    # ---- accounting ------------------------------------------------------------------------------

    def ledger(self) -> KVLedger:
        """Blocks held per request and in all; call it between steps."""
        bs, held = self.block_size, set()
        requests = {}
        for rid, table in self.block_tables.items():
            tokens = self._requests[rid].num_computed_tokens
            shared = sum(1 for b in table if self.pool.ref_count(b) > 1)
            requests[rid] = RequestKV(len(table), shared, tokens, len(table) * bs - tokens)
            held.update(table)
        return KVLedger(bs, requests, len(held), self.pool.counts())
