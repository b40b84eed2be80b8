"""The scheduler without a model: token budgets, continuous batching, chunked prefill, preemption.

Each step is simulated: schedule, then every chunk that reaches its request's end gets token 7.
"""

from __future__ import annotations

from kvlab.kv.manager import BlockCopy, KVCacheManager
from kvlab.request import Request, RequestStatus
from kvlab.sampling import SamplingParams
from kvlab.scheduler import Scheduler, SchedulerConfig, StepResult


def make(num_blocks=16, block_size=4, max_num_seqs=8, budget=64, prefix_caching=True, recompute=False):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    config = SchedulerConfig(max_model_len=64, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                             recompute_every_step=recompute)  # fmt: skip
    return Scheduler(config, kv)


def req(rid: str, prompt_len: int, max_tokens: int = 4, first: int = 100) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return Request(rid, list(range(first, first + prompt_len)), params, max_tokens=max_tokens)


def step(s: Scheduler):
    plan = s.schedule()
    s.update(plan, StepResult({c.request.request_id: [7] for c in plan.chunks if c.samples}))
    return plan


def shape(plan) -> list[tuple[str, int, int]]:
    return [(c.request.request_id, c.start, c.num_new_tokens) for c in plan.chunks]


def check_empty(s: Scheduler) -> None:
    counts = s.kv.pool.check_integrity()
    assert counts.used == 0 and s.kv.block_tables == {} and s.kv.ledger().held_blocks == 0


def test_one_request_prefills_then_decodes_one_token_per_step():
    s = make()
    r = req("a", 6, max_tokens=3)
    s.add_request(r)
    assert shape(step(s)) == [("a", 0, 6)]
    assert s.kv.block_tables["a"] == [[0, 1]] and r.output_token_ids == [7]
    assert shape(step(s)) == [("a", 6, 1)]
    assert shape(step(s)) == [("a", 7, 1)]
    assert r.status is RequestStatus.FINISHED_LENGTH and r.output_token_ids == [7, 7, 7]
    assert not s.has_unfinished_requests
    check_empty(s)


def test_continuous_batching_admits_a_request_while_others_decode():
    s = make()
    a, b = req("a", 5, max_tokens=6), req("b", 3, max_tokens=2, first=200)
    s.add_request(a)
    step(s)
    step(s)  # a decodes
    s.add_request(b)
    plan = step(s)
    assert shape(plan) == [("a", 6, 1), ("b", 0, 3)]  # b's prompt joins a's decode in one step
    assert shape(step(s)) == [("a", 7, 1), ("b", 3, 1)]
    assert b.is_finished and not a.is_finished
    while s.has_unfinished_requests:
        step(s)
    check_empty(s)


def test_chunked_prefill_splits_a_long_prompt_under_the_budget_and_decodes_go_first():
    s = make(budget=8)
    a = req("a", 3, max_tokens=8)
    s.add_request(a)
    step(s)
    s.add_request(req("long", 20, first=300))
    assert shape(step(s)) == [("a", 3, 1), ("long", 0, 7)]
    assert shape(step(s)) == [("a", 4, 1), ("long", 7, 7)]
    assert s.running[1].output_token_ids == []  # no token until the whole prompt is in
    assert shape(step(s)) == [("a", 5, 1), ("long", 14, 6)]
    assert s.running[1].output_token_ids == [7]  # the last chunk sampled the long prompt's first token
    while s.has_unfinished_requests:
        step(s)
    check_empty(s)


def test_max_num_seqs_keeps_the_rest_waiting():
    s = make(max_num_seqs=2)
    for i in range(3):
        s.add_request(req(f"r{i}", 2, max_tokens=2, first=100 * (i + 1)))
    assert [c.request.request_id for c in step(s).chunks] == ["r0", "r1"]
    assert [r.request_id for r in s.waiting] == ["r2"]
    step(s)  # r0, r1 finish
    assert shape(step(s)) == [("r2", 0, 2)]
    while s.has_unfinished_requests:
        step(s)
    check_empty(s)


def test_preemption_frees_the_latest_request_and_recomputes_it_later():
    s = make(num_blocks=4, block_size=4, prefix_caching=False)
    a, b = req("a", 7, max_tokens=6), req("b", 7, max_tokens=6, first=200)
    s.add_request(a)
    s.add_request(b)
    assert shape(step(s)) == [("a", 0, 7), ("b", 0, 7)]
    assert s.kv.block_tables == {"a": [[0, 1]], "b": [[2, 3]]}
    step(s)  # both at 8 tokens computed: every block full
    plan = step(s)  # a needs a third block: b (admitted last) is preempted
    assert [r.request_id for r in plan.preempted] == ["b"]
    assert shape(plan) == [("a", 9 - 1, 1)]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert s.kv.block_tables == {"a": [[0, 1, 2]]}  # b's blocks, released last to first: 2 is at the front
    s.kv.pool.check_integrity()
    while not a.is_finished:
        step(s)
    plan = step(s)  # b comes back and recomputes prompt + its 2 tokens, then goes on
    assert shape(plan) == [("b", 0, 9)]
    while s.has_unfinished_requests:
        step(s)
    assert b.output_token_ids == [7] * 6 and b.num_preemptions == 1
    check_empty(s)


def test_a_request_preempts_itself_when_nobody_else_can_give_way():
    s = make(num_blocks=3, block_size=4, prefix_caching=False)
    a, b = req("a", 4, max_tokens=8), req("b", 8, max_tokens=1, first=200)
    s.add_request(a)
    s.add_request(b)
    step(s)  # a: blocks [0], b: [1, 2]; b finishes at once (max_tokens 1)
    assert b.is_finished
    while not a.is_finished:
        step(s)
    assert a.num_preemptions == 0
    check_empty(s)


def test_prefix_hit_prefills_only_the_uncached_tokens():
    s = make(block_size=4)
    s.add_request(req("a", 10, max_tokens=1))
    step(s)
    b = req("b", 14)  # same first 10 tokens, then 4 more
    s.add_request(b)
    plan = step(s)
    assert shape(plan) == [("b", 10, 4)]
    assert b.num_cached_tokens == 10
    copies = [op for op in plan.block_ops if isinstance(op, BlockCopy)]
    assert [c.num_tokens for c in copies] == [2]  # tokens 8, 9 from a's partial block
    assert s.kv.stats.queries == 24 and s.kv.stats.hits == 10
    while s.has_unfinished_requests:
        step(s)
    check_empty(s)


def test_abort_waiting_and_running_requests_frees_their_blocks():
    s = make()
    a, b, c = req("a", 5, max_tokens=9), req("b", 6, first=200), req("c", 3, first=300)
    for r in (a, b):
        s.add_request(r)
    step(s)
    s.add_request(c)
    s.finish_request(a, RequestStatus.FINISHED_ABORTED)
    s.finish_request(c, RequestStatus.FINISHED_ABORTED)
    assert a.finish_reason == "abort" and c.finish_reason == "abort" and list(s.waiting) == []
    s.finish_request(b, RequestStatus.FINISHED_ABORTED)
    check_empty(s)


def test_recompute_mode_forgets_every_token_after_each_sample():
    s = make(prefix_caching=False, recompute=True)
    r = req("a", 5, max_tokens=3)
    s.add_request(r)
    assert shape(step(s)) == [("a", 0, 5)]
    assert r.num_computed_tokens == 0 and s.kv.pool.num_used_blocks == 0
    assert shape(step(s)) == [("a", 0, 6)]
    assert shape(step(s)) == [("a", 0, 7)]
    assert r.is_finished
    check_empty(s)


def test_rejected_positions_are_rolled_back_before_their_blocks_are_made_findable():
    """A result that rejects the last positions a step computed (as a verifier rejects drafted tokens;
    here simply the chunk's last two) keeps only the accepted K/V, and registers only full accepted blocks."""
    s = make()
    r = req("a", 9, max_tokens=4)
    s.add_request(r)
    plan = s.schedule()
    assert shape(plan) == [("a", 0, 9)] and s.kv.block_tables["a"] == [[0, 1, 2]]
    s.update(plan, StepResult({"a": [7]}, num_rejected_tokens={"a": 2}))
    assert r.num_computed_tokens == 7 and s.kv.block_tables["a"] == [[0, 1]]  # block 2 held only positions 8, 9
    assert s.kv._num_registered.get("a", 0) == 1  # block 1 (positions 4-7) is not full of accepted tokens
    assert r.output_token_ids == [7] and r.num_tokens == 10
    assert shape(s.schedule()) == [("a", 7, 3)]  # the rejected positions are computed again
    s.kv.pool.check_integrity()


def test_several_tokens_in_one_result_are_appended_in_order_and_stop_at_the_limit():
    s = make()
    r = req("a", 5, max_tokens=3)
    s.add_request(r)
    plan = s.schedule()
    got = s.update(plan, StepResult({"a": [11, 12, 13, 14]}))
    assert got == [r] and r.output_token_ids == [11, 12, 13]  # max_tokens 3: the fourth is not taken
    assert r.status is RequestStatus.FINISHED_LENGTH
    check_empty(s)
