"""The ModelRunner's step layout on a mixed step, exactly: packed ids, positions, slots, groups, logits rows.

Pure CPU, no model: the runner's `_build` only needs the cache's block size and device.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kvlab.kv.layout import KVLayout
from kvlab.request import Request
from kvlab.runner.model_runner import ModelRunner
from kvlab.sampling.params import SamplingParams
from kvlab.scheduler import ScheduledChunk

BS = 4  # tokens per block
ONE_TABLE = KVLayout.uniform((None,))  # every layer in one KV group (no sliding windows)


def request(rid: str, n: int) -> Request:
    return Request(rid, [100 * int(rid[1:]) + i for i in range(n)], SamplingParams(max_tokens=4), max_tokens=4)


def test_a_mixed_step_is_laid_out_exactly():
    r1, r2, r3, r4 = request("r1", 10), request("r2", 6), request("r3", 7), request("r4", 10)
    chunks = [
        ScheduledChunk(r1, 9, 1, [[3, 7, 1]]),  # decode: position 9 → block 1, offset 1
        ScheduledChunk(r2, 5, 1, [[2, 5]]),  # decode: position 5 → block 5, offset 1
        ScheduledChunk(r3, 4, 3, [[0, 6]]),  # the rest of a prompt after a 4-token prefix hit
        ScheduledChunk(r4, 0, 5, [[4, 8]]),  # the first 5 of a 10-token prompt: nothing to sample yet
    ]
    runner = ModelRunner(model=None, cache=SimpleNamespace(device=torch.device("cpu"), block_size=BS, layout=ONE_TABLE))
    step = runner._build(chunks)

    assert step.input_ids.tolist() == [[109, 205, 304, 305, 306, 400, 401, 402, 403, 404]]
    assert step.meta.positions.tolist() == [[9, 5, 4, 5, 6, 0, 1, 2, 3, 4]]
    assert step.meta.slot_mapping.tolist() == [1 * BS + 1, 5 * BS + 1, 24, 25, 26, 16, 17, 18, 19, 8 * BS + 0]
    assert step.logits_index.tolist() == [0, 1, 4]  # last token of each chunk that reaches its request's end
    assert step.sampling == [r1, r2, r3]

    decodes, prompt, partial = step.meta.groups
    assert (decodes.lo, decodes.hi, decodes.num_keys) == (0, 2, 10)
    assert decodes.block_tables.tolist() == [[3, 7, 1], [2, 5, 0]]  # the shorter table padded (masked)
    assert decodes.meta.positions.tolist() == [[9], [5]]
    mask = decodes.meta.attn_mask  # [B, 1, 1, L]: r2 sees its 6 keys, r1 all 10
    assert mask.shape == (2, 1, 1, 10) and mask.sum(-1).flatten().tolist() == [10, 6]

    assert (prompt.lo, prompt.hi, prompt.num_keys) == (2, 5, 7)
    assert prompt.block_tables.tolist() == [[0, 6]]
    causal = prompt.meta.attn_mask[0, 0]  # [T, L]: query i (position 4 + i) sees keys 0 .. 4 + i
    assert causal.sum(-1).tolist() == [5, 6, 7]

    assert (partial.lo, partial.hi, partial.num_keys) == (5, 10, 5)
    assert partial.block_tables.tolist() == [[4, 8]]
    assert partial.meta.attn_mask is None and partial.meta.is_causal  # nothing cached: SDPA's own causal mask


def test_unpacked_prompts_get_passes_of_their_own():
    r1, r2 = request("r1", 3), request("r2", 9)
    runner = ModelRunner(model=None, cache=SimpleNamespace(device=torch.device("cpu"), block_size=BS, layout=ONE_TABLE),
                         pack_prompts=False)
    plan = SimpleNamespace(chunks=[ScheduledChunk(r1, 2, 1, [[5]]), ScheduledChunk(r2, 0, 9, [[1, 2, 3]])], block_ops=[])
    step = runner.prepare_inputs(plan)
    assert [p.input_ids.shape[1] for p in step.passes] == [1, 9]
    assert step.passes[1].meta.slot_mapping.tolist() == [4, 5, 6, 7, 8, 9, 10, 11, 12]
    assert step.sampling == [r1, r2]


def test_fresh_prompts_of_one_length_attend_as_one_batch():
    """A burst of new prompts of one length: one attention group of B sequences × T tokens. A prompt after
    a prefix hit, or of another length, keeps a group of its own."""
    r = [request(f"r{i}", 10) for i in range(1, 7)]
    chunks = [
        ScheduledChunk(r[0], 9, 1, [[3, 7, 1]]),  # a decode
        ScheduledChunk(r[1], 0, 6, [[2, 5]]),  # fresh, T = 6 ─┐ one group
        ScheduledChunk(r[2], 0, 6, [[9, 10]]),  # fresh, T = 6 ─┘
        ScheduledChunk(r[3], 4, 6, [[0, 6, 11]]),  # after a 4-token prefix hit: alone
        ScheduledChunk(r[4], 0, 6, [[4, 8]]),  # fresh, but the run was broken: alone
        ScheduledChunk(r[5], 0, 5, [[12, 13]]),  # fresh, another length: alone
    ]
    runner = ModelRunner(model=None, cache=SimpleNamespace(device=torch.device("cpu"), block_size=BS, layout=ONE_TABLE))
    groups = runner._build(chunks).meta.groups
    assert [(g.lo, g.hi, g.batch_size) for g in groups] == [(0, 1, 1), (1, 13, 2), (13, 19, 1), (19, 25, 1), (25, 30, 1)]
    burst = groups[1]
    assert burst.block_tables.tolist() == [[2, 5], [9, 10]] and burst.num_keys == 6
    assert burst.meta.positions.tolist() == [list(range(6))] * 2
    assert burst.meta.attn_mask is None and burst.meta.is_causal
