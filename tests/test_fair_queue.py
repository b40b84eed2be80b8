"""Fair shares between clients in the scheduler (scheduler/fair.py), without a model.

Each step is simulated as in test_scheduler.py: schedule, then every chunk that reaches its request's
end gets token 7. A "giant" client sends many prompts at once; a small client's prompt arrives behind
them and must get its first token within a few steps, not after the giant finishes.
"""

from __future__ import annotations

from kvlab.kv.manager import KVCacheManager
from kvlab.request import Request, RequestStatus
from kvlab.sampling import SamplingParams
from kvlab.scheduler import Scheduler, SchedulerConfig
from kvlab.scheduler.fair import admission_order, seat_victims, water_fill
from test_scheduler import shape, step  # the same plan helpers (tests/ is on the path: conftest.py)


def make(num_blocks=256, block_size=4, max_num_seqs=4, budget=32, fair=True):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)
    config = SchedulerConfig(max_model_len=128, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                             fair_share=fair)  # fmt: skip
    return Scheduler(config, kv)


def req(rid: str, prompt_len: int, max_tokens: int = 4, first: int = 100, client: str | None = None) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return Request(rid, list(range(first, first + prompt_len)), params, max_tokens=max_tokens, client_id=client)


def run_out(s: Scheduler) -> None:
    for _ in range(10_000):
        if not s.has_unfinished_requests:
            break
        step(s)
    counts = s.kv.pool.check_integrity()
    assert not s.has_unfinished_requests and counts.used == 0 and s.kv.block_tables == {}


def test_water_fill_is_max_min_fair_and_never_exceeds_the_budget():
    assert water_fill({"giant": 1000, "small": 5}, 32) == {"small": 5, "giant": 27}
    assert water_fill({"a": 100, "b": 100, "c": 100}, 32) == {"a": 10, "b": 11, "c": 11}
    assert water_fill({"a": 3, "b": 4}, 32) == {"a": 3, "b": 4}
    assert water_fill({"a": 9, "b": 9, "c": 9}, 2) == {"a": 1, "b": 1, "c": 0}  # never past the budget


def test_water_fill_among_a_few_clients_at_a_time():
    many = {f"c{i}": 256 for i in range(10)}
    shares = water_fill(many, 512, max_clients=8)
    assert [shares[f"c{i}"] for i in range(10)] == [64] * 8 + [0, 0]  # the first eight, 64 each; two wait
    small = {f"c{i}": 10 for i in range(10)}
    assert water_fill(small, 512, max_clients=8) == small  # eight ask for less than the budget: all are served
    # the smallest ask goes first; a third client joins while the first two ask for less than the budget
    assert water_fill({"late": 300, "newcomer": 6, **many}, 512, max_clients=2) == {
        "late": 0, "newcomer": 6, "c0": 253, "c1": 253, **{f"c{i}": 0 for i in range(2, 10)}}


def test_many_equal_prompts_go_through_a_few_at_a_time():
    """16 clients with a 64-token prompt each, a budget of 128: two whole prompts a step (MIN_SHARE 64),
    so that the first tokens come step by step and the first prompts' decodes begin while the rest
    prefill, not 16 slivers of 8 tokens a step that all finish in the same last step."""
    s = make(max_num_seqs=16, budget=128)
    for i in range(16):
        s.add_request(req(f"r{i}", 64, max_tokens=4, first=100 * (i + 1), client=f"client{i}"))
    first = step(s)
    assert shape(first) == [("r0", 0, 64), ("r1", 0, 64)]
    second = step(s)
    assert [c for c in shape(second) if c[2] == 1] == [("r0", 64, 1), ("r1", 64, 1)]  # decoding already
    assert sum(c[2] for c in shape(second)) <= 128
    run_out(s)


def test_one_client_keeps_first_come_first_served_order():
    running = []
    waiting = [req(f"r{i}", 4) for i in range(5)]
    assert [r.request_id for r in admission_order(waiting, running, 3)] == ["r0", "r1", "r2"]
    assert seat_victims([req("x", 4)] * 4, waiting, 4) == []  # one client: nobody is preempted for fairness


def test_admission_goes_to_the_client_holding_fewest_seats():
    running = [req("g0", 4, client="giant"), req("g1", 4, client="giant")]
    waiting = [req("g2", 4, client="giant"), req("g3", 4, client="giant"), req("s0", 4, client="small"),
               req("t0", 4, client="other")]  # fmt: skip
    assert [r.request_id for r in admission_order(waiting, running, 3)] == ["s0", "t0", "g2"]


def test_a_small_request_behind_a_giant_one_takes_a_seat_and_half_the_prompt_budget():
    s = make(max_num_seqs=4, budget=32)
    for i in range(16):  # the giant: 16 prompts of 20 tokens, one client
        s.add_request(req(f"g{i}", 20, max_tokens=20, first=1000 + 100 * i, client="giant"))
    step(s)
    step(s)
    assert {r.client_id for r in s.running} == {"giant"} and len(s.running) == 4
    small = req("small", 6, max_tokens=2, first=50, client="small")
    s.add_request(small)
    plan = step(s)
    # every seat was the giant's: its latest admitted request gave one back, and the small prompt ran whole
    assert [r.request_id for r in plan.preempted] == ["g3"]
    assert ("small", 0, 6) in shape(plan) and small.output_token_ids == [7]
    assert plan.num_tokens <= 32
    step(s)
    assert small.status is RequestStatus.FINISHED_LENGTH  # two tokens, two steps after it arrived
    run_out(s)


def test_prompt_budget_is_split_between_clients_while_both_prefill():
    s = make(max_num_seqs=4, budget=16)
    s.add_request(req("giant", 100, max_tokens=2, first=1000, client="giant"))
    step(s)
    s.add_request(req("other", 40, max_tokens=2, first=3000, client="other"))
    plan = step(s)
    assert shape(plan) == [("giant", 16, 8), ("other", 0, 8)]  # half each, the budget exactly spent
    run_out(s)


def test_seats_are_not_taken_back_and_forth():
    s = make(max_num_seqs=4, budget=64)
    for i in range(8):
        s.add_request(req(f"a{i}", 4, max_tokens=30, first=100 + 10 * i, client="a"))
    step(s)
    for i in range(8):
        s.add_request(req(f"b{i}", 4, max_tokens=30, first=500 + 10 * i, client="b"))
    first = step(s)
    assert len(first.preempted) == 2  # b reaches its share of 2 seats
    for _ in range(10):
        assert step(s).preempted == []  # and nobody is preempted again while both hold their shares
    assert sorted(r.client_id for r in s.running) == ["a", "a", "b", "b"]
    run_out(s)


def steps_to_first_token(fair: bool) -> int:
    """A 64-prompt request (one client), then a 2-token request of another client: steps until its token."""
    s = make(max_num_seqs=16, budget=128, fair=fair)
    for i in range(64):
        s.add_request(req(f"g{i}", 40, max_tokens=32, first=2000 + 50 * i, client="giant"))
    step(s)
    small = req("small", 8, max_tokens=2, first=10, client="small")
    s.add_request(small)
    for n in range(1, 10_000):
        step(s)
        if small.output_token_ids:
            run_out(s)
            return n
    raise AssertionError("the small request never got a token")


def test_fairness_measured_against_first_come_first_served():
    fair, fcfs = steps_to_first_token(True), steps_to_first_token(False)
    assert fair == 1  # its first token in the very step after it arrived
    assert fcfs > 50 * fair  # first come, first served: behind most of the giant's 64 prompts


def test_a_normal_request_still_runs_to_its_end():
    s = make()
    r = req("plain", 6, max_tokens=3)
    s.add_request(r)
    run_out(s)
    assert r.output_token_ids == [7, 7, 7] and r.status is RequestStatus.FINISHED_LENGTH
