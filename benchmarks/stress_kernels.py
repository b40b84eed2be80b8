"""The kernels' thread pool under stress: oversubscribed, random shapes, every output checked bit for bit.

    .venv/bin/python benchmarks/stress_kernels.py --seconds 60 --callers 2 --max-threads 17

Cases are random products: 1-32 rows, 1-2,100 inputs, 1-3,100 outputs (so every tail of out % 4
rows), float32, bfloat16 or float16 weights, with no bias, a bias or a strided one, and x, W and y
at odd element offsets. Each case's reference is the product on one thread, itself checked against
float64 within float32's rounding bound. Then --callers threads call at once for --seconds, each
call with 1 to --max-threads threads (17: 16 workers on this machine's 2 cores), into an output
pre-filled with NaN; the output must equal the reference bit for bit right away and again one call
later (a late write from a worker would change it). Exit status 1 if any output was wrong.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvlab.kernels import gemv  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def offset_view(t: torch.Tensor, rng: random.Random) -> torch.Tensor:
    """t's values in a buffer 0-3 elements past an allocation's start: misaligned for the vector loads."""
    skip = rng.randrange(4)
    buf = torch.empty(t.numel() + skip, dtype=t.dtype)
    view = buf[skip:].view(t.shape)
    view.copy_(t)
    return view


def make_case(rng: random.Random) -> dict:
    rows, n, out = rng.randint(1, 32), rng.randint(1, 2100), rng.randint(1, 3100)
    dtype = rng.choice(DTYPES)
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    x = offset_view(torch.randn(rows, n, generator=g), rng)
    w = offset_view(torch.randn(out, n, generator=g).to(dtype), rng)
    bias = rng.choice([None, "plain", "strided"])
    if bias == "plain":
        bias = torch.randn(out, generator=g)
    elif bias == "strided":
        bias = torch.randn(out, 2, generator=g)[:, 0]
    ref = torch.empty(rows, out)
    gemv._gemv_into(gemv._kernels[dtype], ref, x, w, bias, 1)
    # float32 sums of n products: within n·2⁻²⁴ of the magnitudes' sum (plus the last rounding)
    exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
    bound = (x.double().abs() @ w.double().abs().T + (0 if bias is None else bias.double().abs())) * (n + 2) * 2**-24
    if not bool(((ref.double() - exact).abs() <= bound).all()):
        raise SystemExit(f"one-thread reference off float64 beyond rounding: rows={rows} n={n} out={out} {dtype}")
    return {"x": x, "w": w, "bias": bias, "ref": ref, "fn": gemv._kernels[dtype], "shape": (rows, n, out, dtype)}


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))  # NaN ≠ anything, -0.0 ≠ 0.0


def caller(cases: list[dict], seed: int, deadline: float, max_threads: int, tally: dict, lock) -> None:
    rng = random.Random(seed)
    calls = wrong = late = 0
    previous = None  # (case, output) of the last call: checked again after this one
    while time.monotonic() < deadline:
        case = rng.choice(cases)
        rows, out = case["ref"].shape
        y = torch.empty(rows * out + rng.randrange(4)).fill_(float("nan"))[-rows * out :].view(rows, out)
        gemv._gemv_into(case["fn"], y, case["x"], case["w"], case["bias"], rng.randint(1, max_threads))
        calls += 1
        if not bits_equal(y, case["ref"]):
            wrong += 1
            print(f"  wrong output: {case['shape']}", flush=True)
        if previous is not None and not bits_equal(previous[1], previous[0]["ref"]):
            late += 1
            print(f"  late write: {previous[0]['shape']}", flush=True)
        previous = (case, y)
    with lock:
        tally["calls"] += calls
        tally["wrong"] += wrong
        tally["late"] += late


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--callers", type=int, default=2, help="threads calling the kernel at once")
    ap.add_argument("--max-threads", type=int, default=17, help="pool threads a call may ask for (1..this)")
    ap.add_argument("--cases", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if not gemv.gemv_available():
        print("no C compiler: the kernel is not available")
        return 1
    torch.set_num_threads(1)  # PyTorch's own fills and compares stay off the pool's cores
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; {' '.join(sys.argv)}", flush=True)
    rng = random.Random(args.seed)
    cases = [make_case(rng) for _ in range(args.cases)]
    print(f"{len(cases)} cases, references checked against float64; stressing for {args.seconds:.0f} s", flush=True)
    before = gemv.pool_stats()
    tally, lock = {"calls": 0, "wrong": 0, "late": 0}, threading.Lock()
    deadline = time.monotonic() + args.seconds
    threads = [
        threading.Thread(target=caller, args=(cases, args.seed * 1000 + i, deadline, args.max_threads, tally, lock))
        for i in range(args.callers)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = gemv.pool_stats()
    print(f"calls: {tally['calls']}  wrong outputs: {tally['wrong']}  late writes: {tally['late']}")
    print(f"pool: {after['workers']} workers, {after['generation'] - before['generation']} pool jobs, "
          f"{after['solo_calls'] - before['solo_calls']} calls ran alone (pool busy), "
          f"{after['wakeups'] - before['wakeups']} worker wakeups")  # fmt: skip
    return 1 if tally["wrong"] or tally["late"] else 0


if __name__ == "__main__":
    sys.exit(main())
