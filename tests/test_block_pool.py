"""BlockPool and KVCacheManager: exact block ids, ref counts, eviction order, prefix hits, the ledger."""

from __future__ import annotations

import pytest

from kvlab.kv.block_pool import BlockPool
from kvlab.kv.manager import BlockCopy, BlockZero, KVCacheManager
from kvlab.kv.prefix_cache import ROOT, hash_block, hash_blocks
from kvlab.request import Request
from kvlab.sampling import SamplingParams

P = SamplingParams(max_tokens=8, temperature=0)


def request(rid: str, tokens: list[int], computed: int = 0) -> Request:
    r = Request(rid, list(tokens), P, max_tokens=8)
    r.num_computed_tokens = computed
    return r


# ---- BlockPool ----------------------------------------------------------------------------------


def test_allocate_and_free_in_order():
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.ref_counts == [1, 1, 1, 0] and pool.num_free_blocks == 1
    pool.free([2, 1, 0])
    assert pool.check_integrity() == pool.counts()
    assert pool.counts().free == 4 and pool.num_used_blocks == 0
    # plain free blocks go to the front, each in turn: the last released is reused first
    assert pool.allocate(4) == [0, 1, 2, 3]


def test_too_many_blocks_and_double_free_are_refused():
    pool = BlockPool(2)
    with pytest.raises(ValueError):
        pool.allocate(3)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(ValueError):
        pool.free(blocks)
    pool.check_integrity()


def test_cached_blocks_are_evicted_last_and_least_recently_used_first():
    pool = BlockPool(5)
    a, b, c, d, e = pool.allocate(5)
    pool.register(a, ROOT, [1, 2], hash_block(ROOT, [1, 2]))
    pool.register(b, ROOT, [3, 4], hash_block(ROOT, [3, 4]))
    pool.free([b])  # released first: least recently used
    pool.free([c])  # holds nothing: reused before any cached block
    pool.free([a])
    counts = pool.check_integrity()
    assert (counts.used, counts.cached, counts.free) == (2, 2, 1)
    assert list(pool.free_queue) == [c, b, a]
    assert pool.allocate(2) == [c, b]  # b evicted, a kept
    assert pool.num_evictions == 1
    assert pool.lookup(hash_block(ROOT, [3, 4])) is None and pool.lookup(hash_block(ROOT, [1, 2])) == a
    pool.check_integrity()


def test_touch_shares_a_cached_block_and_takes_it_off_the_free_queue():
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    pool.register(a, ROOT, [9] * 4, hash_block(ROOT, [9] * 4))
    pool.free([a])
    assert a in pool.free_queue
    pool.touch([a])
    pool.touch([a])
    assert pool.ref_count(a) == 2 and a not in pool.free_queue
    pool.free([a, a])
    assert pool.counts().cached == 1
    pool.check_integrity()


def test_a_hash_is_registered_once_and_partial_blocks_match_by_tokens():
    pool = BlockPool(4)
    a, b, c, _ = pool.allocate(4)
    h = hash_block(ROOT, [1, 2, 3, 4])
    assert pool.register(a, ROOT, [1, 2, 3, 4], h)
    assert not pool.register(b, ROOT, [1, 2, 3, 4], h)  # same tokens computed twice: keep the first
    assert pool.register(c, h, [5, 6], None)  # a partial block after a
    assert pool.longest_match(h, [5, 6, 7]) == (c, 2)
    assert pool.longest_match(h, [5, 8]) == (c, 1)
    assert pool.longest_match(h, [8]) == (None, 0)
    assert pool.longest_match(ROOT, [1, 2, 9]) == (a, 2)  # a full block can also give a run of tokens
    pool.check_integrity()


# ---- KVCacheManager ---------------------------------------------------------------------------------


def test_block_hashes_chain():
    tokens = list(range(10))
    hashes = hash_blocks(tokens, 4, [])
    assert len(hashes) == 2  # the partial third block has no hash
    assert hashes[1] == hash_block(hash_block(ROOT, [0, 1, 2, 3]), [4, 5, 6, 7])
    assert hash_blocks(tokens[:4] + [9, 9, 9, 9], 4, [])[1] != hashes[1]


def test_prefix_hit_shares_full_blocks_and_copies_the_partial_run():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    first = request("a", list(range(10)))
    assert kv.allocate_slots(first, 10) == [BlockZero((0, 1, 2))]  # new blocks are zeroed before use
    assert kv.block_tables["a"] == [[0, 1, 2]]
    first.num_computed_tokens = 10
    kv.register_full_blocks(first)
    kv.free(first)  # blocks 0, 1 full and cached; block 2 holds tokens 8, 9 (partial, copy only)
    counts = kv.pool.check_integrity()
    assert (counts.used, counts.cached) == (0, 3)

    second = request("b", list(range(9)) + [42, 43])  # agrees with the first on 9 tokens
    hit = kv.find_prefix(second)
    assert (hit.block_ids, hit.num_tokens, hit.copy_srcs, hit.copy_len) == ([[0, 1]], 9, [2], 1)
    ops = kv.allocate_slots(second, second.num_tokens - hit.num_tokens, hit)
    assert kv.block_tables["b"] == [[0, 1, 3]]  # a plain free block first; cached block 2 survives
    assert ops == [BlockZero((3,)), BlockCopy(src=2, dst=3, num_tokens=1)]
    assert [kv.pool.ref_count(b) for b in (0, 1, 2, 3)] == [1, 1, 0, 1]
    second.num_computed_tokens = 11
    kv.free(second)
    kv.pool.check_integrity()
    assert kv.pool.num_used_blocks == 0


def test_a_hit_always_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = request("a", list(range(8)))
    kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    kv.register_full_blocks(a)
    same = request("b", list(range(8)))
    hit = kv.find_prefix(same)
    assert hit.num_tokens == 7 and hit.block_ids == [[0]]  # block 1 is copied (3 tokens), its last recomputed
    assert (hit.copy_srcs, hit.copy_len) == ([1], 3)
    kv.free(a)


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = request("a", list(range(8)))
    assert kv.allocate_slots(a, 8) == [BlockZero((0, 1))]
    b = request("b", list(range(100, 108)))
    assert kv.allocate_slots(b, 8) is None
    assert "b" not in kv.block_tables and kv.pool.num_free_blocks == 1
    kv.pool.check_integrity()


def test_ledger_counts_shared_blocks_once_and_equals_the_pool():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = request("a", list(range(10)))
    kv.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    kv.register_full_blocks(a)
    b = request("b", list(range(8)) + [50, 51, 52])
    hit = kv.find_prefix(b)
    kv.allocate_slots(b, b.num_tokens - hit.num_tokens, hit)
    b.num_computed_tokens = 11
    ledger = kv.ledger()
    assert ledger.requests["a"].blocks == 3 and ledger.requests["a"].shared_blocks == 2
    assert ledger.requests["b"].blocks == 3 and ledger.requests["b"].unused_slots == 1
    assert ledger.held_blocks == 4 == ledger.pool.used and ledger.is_balanced
    kv.free(a)
    kv.free(b)
    assert kv.ledger().held_blocks == 0 == kv.pool.check_integrity().used


def test_prefix_caching_off_finds_nothing_and_keeps_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    a = request("a", list(range(8)))
    kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    kv.register_full_blocks(a)
    kv.free(a)
    assert kv.pool.counts().cached == 0
    assert kv.find_prefix(request("b", list(range(8)))).num_tokens == 0


def test_a_copy_source_reallocated_in_the_same_call_is_read_before_it_is_zeroed():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = request("a", [1, 2, 3, 4, 5, 6])
    kv.allocate_slots(a, 6)
    a.num_computed_tokens = 6
    kv.register_full_blocks(a)
    kv.free(a)  # block 0 full and cached, block 1 partial ([5, 6]), block 2 never used
    b = request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11])
    hit = kv.find_prefix(b)
    assert (hit.block_ids, hit.copy_srcs, hit.copy_len) == ([[0]], [1], 2)
    ops = kv.allocate_slots(b, b.num_tokens - hit.num_tokens, hit)
    assert kv.block_tables["b"] == [[0, 2, 1]]  # the source (evicted last) became b's third block
    assert ops == [BlockZero((2,)), BlockCopy(src=1, dst=2, num_tokens=2), BlockZero((1,))]
    kv.pool.check_integrity()


def test_a_copy_source_that_becomes_the_destination_is_neither_zeroed_nor_copied():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    a = request("a", [1, 2, 3, 4, 5, 6])
    kv.allocate_slots(a, 6)
    a.num_computed_tokens = 6
    kv.register_full_blocks(a)
    kv.free(a)
    b = request("b", [1, 2, 3, 4, 5, 6, 9])
    hit = kv.find_prefix(b)
    assert kv.allocate_slots(b, b.num_tokens - hit.num_tokens, hit) == []
    assert kv.block_tables["b"] == [[0, 1]] and hit.num_tokens == 6


# ---- truncation: a request's tail forgotten (drafted tokens a verifier rejected) -------------------


def test_truncate_frees_whole_blocks_past_the_cut_and_keeps_the_block_it_falls_in():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = request("a", list(range(14)))
    kv.allocate_slots(a, 14)
    assert kv.block_tables["a"] == [[0, 1, 2, 3]]
    a.num_computed_tokens = 14
    kv.register_full_blocks(a)  # blocks 0, 1, 2 full and findable
    kv.truncate(a, 6)
    assert kv.block_tables["a"] == [[0, 1]] and a.num_computed_tokens == 6
    assert [kv.pool.ref_count(b) for b in range(4)] == [1, 1, 0, 0]
    # block 2 is cached (its K/V still match its tokens); block 1, where the cut falls, is no longer findable
    assert kv.pool.lookup(hash_blocks(list(range(12)), 4, [])[2]) == 2
    assert kv.pool.lookup(hash_blocks(list(range(8)), 4, [])[1]) is None
    assert kv._num_registered["a"] == 1 and len(kv._hashes["a"]) == 1
    assert kv.take_pending_ops() == []  # nothing shared: no copy
    counts = kv.pool.check_integrity()
    assert (counts.used, counts.cached, counts.free) == (2, 1, 5)
    assert kv.ledger().is_balanced


def test_truncate_into_a_shared_block_copies_it_first():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = request("a", list(range(8)))
    kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    kv.register_full_blocks(a)  # blocks 0, 1 findable; b will share both
    b = request("b", list(range(8)) + [50, 51])
    hit = kv.find_prefix(b)
    kv.allocate_slots(b, b.num_tokens - hit.num_tokens, hit)
    assert kv.block_tables["b"] == [[0, 1, 2]] and kv.pool.ref_count(1) == 2
    b.num_computed_tokens = 10
    kv.truncate(b, 6)  # the cut falls in block 1, which a still holds; block 2, just freed, is reused for it
    assert kv.block_tables["b"] == [[0, 2]] and kv.block_tables["a"] == [[0, 1]]
    assert kv.take_pending_ops() == [BlockZero((2,)), BlockCopy(src=1, dst=2, num_tokens=2)]
    assert kv.take_pending_ops() == []  # handed over once
    assert [kv.pool.ref_count(x) for x in range(4)] == [2, 1, 1, 0]
    kv.pool.check_integrity()
    ledger = kv.ledger()
    assert ledger.is_balanced and ledger.requests["b"].tokens == 6 and ledger.requests["b"].shared_blocks == 1
    kv.free(b)
    kv.free(a)
    assert kv.pool.check_integrity().used == 0


def test_truncate_on_a_block_boundary_and_out_of_range():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = request("a", list(range(7)))
    kv.allocate_slots(a, 7)
    a.num_computed_tokens = 7
    kv.truncate(a, 4)
    assert kv.block_tables["a"] == [[0]] and kv.take_pending_ops() == []
    with pytest.raises(ValueError):
        kv.truncate(a, 5)  # past what its table holds
    kv.truncate(a, 0)
    assert kv.block_tables["a"] == [[]] and kv.pool.check_integrity().used == 0


def test_a_paged_cache_applies_zeroings_and_copies_in_their_order():
    """Zeroings in a row are gathered into runs of adjacent blocks; a copy between them still sees the
    blocks as the earlier operations left them, and blocks no operation names keep their values."""
    import torch

    from kvlab.kv.paged import PagedKVCache

    cache = PagedKVCache(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=1, head_dim=2)
    for t in cache.tensors():
        t.copy_(torch.arange(t.numel(), dtype=t.dtype).view_as(t) + 1)  # every value nonzero
    before = [t.clone() for t in cache.tensors()]
    cache.apply([BlockZero((2,)), BlockCopy(src=1, dst=2, num_tokens=2), BlockZero((1,)), BlockZero((6, 4)),
                 BlockZero((5,))])  # fmt: skip
    for t, old in zip(cache.tensors(), before):
        assert torch.equal(t[2, :2], old[1, :2]) and not t[2, 2:].any()  # zeroed, then the copy's 2 tokens
        assert not t[1].any() and not t[4:7].any()
        for b in (0, 3, 7):
            assert torch.equal(t[b], old[b])
