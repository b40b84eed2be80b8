"""The kernels' thread pool: its job counter across 2³¹ and 2³², fork, two callers at once, sleeping workers.

Every result is compared bit for bit with the same product on one thread: no output value may depend
on the number of threads, on who computed it, or on whether the pool was free. A hang must fail the
run, not stall it: in-process tests run under a watchdog, forked children under a join timeout.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import threading
import time

import pytest
import torch

from kvlab.kernels import gemv
from kvlab.kernels.gemv import gemv_available, linear, pool_stats

pytestmark = pytest.mark.skipif(not gemv_available(), reason="no C compiler: BLAS serves every call")


@pytest.fixture(autouse=True)
def watchdog():
    """A hung pool spins in C with the GIL released: dump the stacks and end the run after 60 s."""
    faulthandler.dump_traceback_later(60, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def _cases(seed: int = 0):
    """(x, weight, bias) of decode-like shapes: short and long rows, a tail of out % 4 rows, 16-bit weights."""
    g = torch.Generator().manual_seed(seed)
    shapes = [
        (1, 576, 576, torch.float32), (3, 1536, 579, torch.float32), (2, 577, 1003, torch.bfloat16),
        (1, 64, 130, torch.float16),
    ]  # fmt: skip
    return [
        (torch.randn(rows, n, generator=g), torch.randn(out, n, generator=g).to(dtype), torch.randn(out, generator=g))
        for rows, n, out, dtype in shapes
    ]


def _alone(cases):
    return [linear(x, w, b, threads=1) for x, w, b in cases]


def test_results_are_bit_identical_at_every_thread_count():
    cases = _cases()
    for (x, w, b), want in zip(cases, _alone(cases)):
        for threads in (2, 3, 5, 8, 16):
            assert torch.equal(linear(x, w, b, threads=threads), want), (tuple(w.shape), threads)


@pytest.mark.parametrize("start", [2**31 - 3, 2**32 - 3])
def test_job_counter_crosses_2_31_and_2_32(start):
    """The claim tag is the job's generation: it used to turn negative at 2³¹ and hang every call."""
    cases = _cases()
    want = _alone(cases)
    gemv._set_pool_generation(start)
    for _ in range(3):
        for (x, w, b), expected in zip(cases, want):
            assert torch.equal(linear(x, w, b, threads=4), expected)
    # every call went through the pool (only pool jobs bump the counter), across the boundary
    assert pool_stats()["generation"] == (start + 3 * len(cases)) % 2**32


def test_a_call_that_finds_the_pool_busy_computes_alone():
    cases = _cases(1)
    want = [linear(x, w, b, threads=4) for x, w, b in cases]
    before = pool_stats()["solo_calls"]
    with gemv._pool_held():
        got = [linear(x, w, b, threads=4) for x, w, b in cases]
    assert all(torch.equal(a, e) for a, e in zip(got, want))
    assert pool_stats()["solo_calls"] == before + len(cases)


def test_two_threads_calling_at_once_get_what_each_gets_alone():
    """ctypes releases the GIL, so two threads (two engines, a server and an offline call) meet in the pool."""
    cases = _cases(2)
    want = _alone(cases)
    solo_before = pool_stats()["solo_calls"]
    wrong, calls = [], [0, 0]
    deadline = time.monotonic() + 20

    def caller(index: int):
        while time.monotonic() < deadline:
            for (x, w, b), expected in zip(cases, want):
                if not torch.equal(linear(x, w, b, threads=2 + index), expected):
                    wrong.append(tuple(w.shape))
            calls[index] += 1
            if min(calls) >= 50 and pool_stats()["solo_calls"] > solo_before:
                return

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []
    assert min(calls) >= 50
    assert pool_stats()["solo_calls"] > solo_before  # they did meet: one of them found the pool busy


def _compute_in_child(cases, want):
    solo_before = pool_stats()["solo_calls"]
    for threads in (4, 2, 1):
        for (x, w, b), expected in zip(cases, want):
            assert torch.equal(linear(x, w, b, threads=threads), expected)
    stats = pool_stats()
    assert stats["workers"] >= 3  # the child started workers of its own: not silently one thread
    assert stats["solo_calls"] == solo_before  # and the pool was free, though the parent's was busy


def _fork_and_compute(cases, want) -> None:
    child = multiprocessing.get_context("fork").Process(target=_compute_in_child, args=(cases, want))
    child.start()
    child.join(timeout=30)
    if child.is_alive():
        child.kill()
        child.join()
        pytest.fail("the forked child hung in the kernel pool")
    assert child.exitcode == 0


def test_fork_while_another_thread_computes_then_compute_in_the_child():
    cases = _cases(3)
    want = _alone(cases)
    x, w, _ = cases[1]
    stop = threading.Event()

    def keep_the_pool_busy():
        while not stop.is_set():
            linear(x, w, threads=4)

    busy = threading.Thread(target=keep_the_pool_busy)
    busy.start()
    try:
        for _ in range(4):
            _fork_and_compute(cases, want)
    finally:
        stop.set()
        busy.join()
    with gemv._pool_held():  # certain this time: the pool is held at the fork, as by a thread the child lacks
        _fork_and_compute(cases, want)


def test_workers_a_call_leaves_out_sleep_through_it():
    """After a 9-thread call, 2-thread calls wake at most their one helper, never the 7 others."""
    x, w, b = _cases(4)[2]
    linear(x, w, b, threads=9)
    assert pool_stats()["workers"] >= 8
    deadline = time.monotonic() + 10
    while pool_stats()["asleep"] < 8 and time.monotonic() < deadline:  # idle workers sleep after 2 ms
        time.sleep(0.01)
    assert pool_stats()["asleep"] >= 8
    before = pool_stats()["wakeups"]
    for _ in range(100):
        linear(x, w, b, threads=2)
    assert pool_stats()["wakeups"] - before <= 100  # each call signals worker 0 at most
    assert pool_stats()["asleep"] >= 7


def _expected_claims(num_items: int, chunk: int, threads: int) -> dict[int, int]:
    """pool.c's rule: `chunk` items a claim, fewer near the end (a 2·threads-th of what is left, but not
    under 4, nor over chunk), and never past the last item."""
    if num_items <= chunk:  # one chunk: the caller computes it alone
        return {0: num_items}
    claims, begin = {}, 0
    while begin < num_items:
        left = num_items - begin
        size = min(chunk, max(left // (2 * threads), 4), left)
        claims[begin], begin = size, begin + size
    return claims


@pytest.mark.parametrize("num_items,chunk,threads", [(60, 15, 2), (96, 24, 2), (36, 4, 2), (1000, 1, 3), (3072, 96, 2),
                                                     (17, 100, 2), (5, 4, 2), (200, 50, 4)])  # fmt: skip
def test_each_item_is_computed_once_and_claims_shrink_near_the_end(num_items, chunk, threads):
    """Runs of a quarter of a job left one core idle for up to a run at its end: claims now shrink as the
    work runs out. Whoever claims it, the claim that starts at an item has the size the rule gives it."""
    for _ in range(20):
        counts, claims = gemv._pool_claims(num_items, chunk, threads)
        assert counts == [1] * num_items
        assert claims == _expected_claims(num_items, chunk, threads)
    if num_items > chunk:  # however long the runs, the last claim is short
        assert claims[max(claims)] <= 4
