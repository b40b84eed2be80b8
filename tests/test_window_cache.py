"""The windowed paged cache, pure CPU: KV groups, blocks released as a window moves (exact block ids),
prefix hits that need the window's blocks, truncation, the step layout, and `kvlab mem` equal to the
bytes the engine holds (Gemma 3 27B's bundled config; gemma3-270m's in the real tests)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvlab.config import EngineConfig, load_config
from kvlab.kv.layout import NULL_BLOCK as N
from kvlab.kv.layout import KVLayout
from kvlab.kv.manager import BlockCopy, BlockZero, KVCacheManager
from kvlab.kv.paged import PagedKVCache
from kvlab.kv.pool_plan import plan_kv_pool
from kvlab.memory import kv_bytes
from kvlab.request import Request
from kvlab.runner.model_runner import ModelRunner
from kvlab.sampling.params import SamplingParams
from kvlab.scheduler import ScheduledChunk, Scheduler, SchedulerConfig, StepResult

BS = 4
WINDOWS = (6, 6, None, None)  # two sliding layers (window 6), two full ones: a KV group of each


def request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8), max_tokens=8)


def manager(num_blocks: int = 12) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, True, KVLayout.for_windows(WINDOWS))


def computed(kv: KVCacheManager, r: Request, n: int) -> None:
    """What the scheduler does after a step that computed n more tokens of r."""
    r.num_computed_tokens += n
    kv.register_full_blocks(r)
    kv.slide_windows(r)


def test_layers_form_equal_groups_of_one_window():
    layout = KVLayout.for_windows((512,) * 5 + (None,) + (512,) * 5 + (None,) + (512,) * 5 + (None,))  # gemma3-270m
    assert [(g.window, g.layers) for g in layout.groups] == [
        (512, (0, 1, 2)), (512, (3, 4, 6)), (None, (5, 11, 17)), (512, (7, 8, 9)), (512, (10, 12, 13)),
        (512, (14, 15, 16)),
    ]  # fmt: skip
    assert layout.layers_per_block == 3 and layout.placement()[6] == (1, 2)
    gemma27 = KVLayout.for_model(load_config("gemma-3-27b"))  # 52 sliding, 10 full layers: 31 groups of 2
    assert len(gemma27.groups) == 31 and gemma27.layers_per_block == 2
    assert KVLayout.for_model(load_config("gemma-3-27b"), windowed=False).groups[0].layers == tuple(range(62))
    assert len(KVLayout.for_windows((None, None, None)).groups) == 1  # no window: the classic single table


def test_sliding_blocks_are_released_as_the_window_moves():
    kv = manager()
    a = request("a", list(range(10)))
    assert kv.allocate_slots(a, 10) == [BlockZero((0, 1, 2)), BlockZero((3, 4, 5))]
    computed(kv, a, 10)  # the next query (position 10) sees 5..10: block 0 (positions 0-3) is let go
    assert kv.block_tables["a"] == [[N, 1, 2], [3, 4, 5]]
    assert kv.pool.counts().cached == 1 and kv.pool.ref_count(0) == 0  # full and registered: still findable
    for t in (10, 11):
        a.append_token(100 + t)
        assert kv.allocate_slots(a, 1) == []
        computed(kv, a, 1)
    assert kv.block_tables["a"] == [[N, 1, 2], [3, 4, 5]]
    a.append_token(112)
    assert kv.allocate_slots(a, 1) == [BlockZero((6,)), BlockZero((7,))]  # plain free blocks before cached 0
    computed(kv, a, 1)  # position 13 next: it sees 8..13, so block 1 goes too
    assert kv.block_tables["a"] == [[N, N, 2, 6], [3, 4, 5, 7]]
    ledger = kv.ledger()
    assert ledger.requests["a"].blocks == 6 and ledger.requests["a"].tokens == 5 + 13
    assert ledger.held_blocks == 6 == kv.pool.check_integrity().used and ledger.is_balanced
    kv.free(a)
    counts = kv.pool.check_integrity()
    assert counts.used == 0 and kv.ledger().held_blocks == 0


def prefilled(kv: KVCacheManager, tokens: list[int], rid: str = "a") -> Request:
    r = request(rid, tokens)
    kv.allocate_slots(r, len(tokens))
    computed(kv, r, len(tokens))
    return r


def test_a_prefix_hit_shares_only_the_window_of_a_sliding_group():
    kv = manager()
    prefilled(kv, list(range(16)))
    assert kv.block_tables["a"] == [[N, N, 2, 3], [4, 5, 6, 7]]
    b = request("b", list(range(14)) + [99])
    hit = kv.find_prefix(b)  # 3 whole blocks, then 2 tokens copied from block 3 / 7
    assert (hit.block_ids, hit.num_tokens, hit.copy_srcs, hit.copy_len) == ([[N, 1, 2], [4, 5, 6]], 14, [3, 7], 2)
    ops = kv.allocate_slots(b, 1, hit)  # the first computed token (14) sees 9..14: block 0 is not needed
    assert kv.block_tables["b"] == [[N, 1, 2, 8], [4, 5, 6, 9]]
    assert ops == [BlockZero((8,)), BlockCopy(3, 8, 2), BlockZero((9,)), BlockCopy(7, 9, 2)]
    assert kv.pool.ref_count(1) == 1 and kv.pool.ref_count(2) == 2  # cached block 1 taken back, 2 shared
    assert kv.ledger().is_balanced
    kv.pool.check_integrity()


def test_a_prefix_whose_window_blocks_were_evicted_is_not_a_hit_for_the_sliding_group():
    kv = manager()
    prefilled(kv, list(range(16)))  # sliding blocks 0, 1 released (cached); 4 blocks free
    prefilled(kv, list(range(100, 112)), rid="c")  # 6 blocks: the 4 free ones, then cached 0 and 1 evicted
    assert kv.pool.num_evictions == 2
    b = request("b", list(range(14)) + [99])
    hit = kv.find_prefix(b)  # the full group still has blocks 4, 5, 6; the sliding one lacks 1 (and 0)
    assert hit.num_tokens == 0 and hit.block_ids == [[], []]
    kv.pool.check_integrity()


def test_truncation_keeps_the_window_it_needs_or_refuses():
    kv = manager(16)
    a = prefilled(kv, list(range(16)))
    kv.truncate(a, 14)  # position 14 sees 9..14: blocks 2, 3 are still held
    assert kv.block_tables["a"] == [[N, N, 2, 3], [4, 5, 6, 7]] and a.num_computed_tokens == 14
    with pytest.raises(ValueError, match="sliding window"):
        kv.truncate(a, 6)  # position 6 would need block 0, released long ago
    assert kv.block_tables["a"] == [[N, N, 2, 3], [4, 5, 6, 7]]  # nothing changed
    assert kv.ledger().is_balanced


def test_a_windowed_step_reads_each_sliding_group_from_its_window():
    """The runner's layout: a sliding group gathers from the first block the window reaches, masked to it."""
    layout = KVLayout.for_windows(WINDOWS)
    r1, r2, r3 = request("r1", list(range(15))), request("r2", list(range(6))), request("r3", list(range(14)))
    chunks = [ScheduledChunk(r1, 14, 1, [[N, N, 2, 6], [3, 4, 5, 7]]), ScheduledChunk(r2, 5, 1, [[0, 1], [8, 9]]),
              ScheduledChunk(r3, 10, 4, [[N, 10, 11, 12], [13, 14, 15, 16]])]  # fmt: skip
    cache = SimpleNamespace(device=torch.device("cpu"), block_size=BS, layout=layout)
    sliding, full = ModelRunner(model=None, cache=cache)._build(chunks).meta.kv_groups
    assert sliding.slot_mapping.tolist() == [6 * BS + 2, 1 * BS + 1, 46, 47, 48, 49]
    assert full.slot_mapping.tolist() == [7 * BS + 2, 9 * BS + 1, 62, 63, 64, 65]
    decodes, chunk = sliding.groups
    assert decodes.block_tables.tolist() == [[2, 6], [0, 1]] and decodes.num_keys == 7  # keys 8..14 and 0..5
    mask = decodes.meta.for_window(6).attn_mask[:, 0, 0].int().tolist()
    assert mask == [[0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 0]]  # position 8 out of 14's window; padding
    assert chunk.block_tables.tolist() == [[10, 11, 12]] and chunk.num_keys == 10  # keys 4..13
    assert chunk.meta.for_window(6).attn_mask[0, 0].sum(-1).tolist() == [6, 6, 6, 6]  # each query: itself + 5
    assert full.groups[0].block_tables.tolist() == [[3, 4, 5, 7], [8, 9, 0, 0]]  # every key from 0


def run_prompt(scheduler: Scheduler, r: Request) -> None:
    """The engine's steps for a prompt, without a model: schedule chunks until every token is computed."""
    scheduler.add_request(r)
    while r.num_computed_tokens < r.num_tokens:
        out = scheduler.schedule()
        scheduler.update(out, StepResult())


@pytest.mark.parametrize("name", ["gemma-3-27b", pytest.param("gemma3-270m", marks=pytest.mark.real)])
def test_kvlab_mem_equals_the_bytes_the_engine_holds(name, real_model):
    """A sequence of 512, 2,000 and 8,000 tokens, prefilled in 512-token chunks: the blocks it holds are
    `kvlab mem`'s bytes exactly (full layers every token, sliding layers their window: W, not W − 1)."""
    config = load_config(real_model(name) if name == "gemma3-270m" else name)
    layout = KVLayout.for_model(config)
    for n in (512, 2_000, 8_000):
        kv = KVCacheManager(20_000, 16, True, layout)
        cache = PagedKVCache.for_model(config, 20_000, 16, torch.bfloat16, "meta", layout)
        scheduler = Scheduler(SchedulerConfig(max_model_len=16_384, max_num_batched_tokens=512), kv)
        run_prompt(scheduler, Request("r", list(range(n)), SamplingParams(max_tokens=1), max_tokens=1))
        held = kv.ledger().requests["r"]
        assert held.blocks * cache.bytes_per_block() == kv_bytes(config, n, kv_dtype="bfloat16"), n
        assert held.blocks == layout.blocks_for_sequence(n, 16) and held.unused_slots == 0


def test_the_memory_plan_counts_windowed_sequences_for_concurrency():
    config = load_config("gemma-3-27b")
    options = {"max_model_len": 8_192, "kv_memory_bytes": 4 << 30}
    windowed = plan_kv_pool(EngineConfig(**options), config, torch.bfloat16, torch.device("cpu"))
    full = plan_kv_pool(EngineConfig(windowed_kv=False, **options), config, torch.bfloat16, torch.device("cpu"))
    assert windowed.nbytes == 4 << 30 and (4 << 30) - full.nbytes < full.bytes_per_block  # whole blocks
    # the pool's bytes over kvlab mem's bytes per sequence: 1,024-token windows in 52 of 62 layers
    assert windowed.max_concurrency(8_192) == windowed.nbytes / kv_bytes(config, 8_192, kv_dtype="bfloat16")
    assert full.max_concurrency(8_192) == full.nbytes / (8_192 * 62 * 2 * 16 * 128 * 2)
    ratio = windowed.max_concurrency(8_192) / full.max_concurrency(8_192)
    assert ratio == pytest.approx(62 * 8 / (10 * 8 + 52), rel=1e-2)
