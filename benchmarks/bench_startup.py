"""Start-up: `kvlab run MODEL "hi" --max-tokens 1` wall time beside `python -c "import torch"`.

    .venv/bin/python benchmarks/bench_startup.py --model smollm2-135m --repeat 5

Both commands run as fresh processes, alternating round by round, so the machine's noise falls on
both; it prints each one's median (min–max) and the median of the per-round differences, which is
what kvlab itself adds to importing torch. `--profile` also writes a cProfile of one run (sorted by
cumulative time) to see where that difference goes. Not part of `make test`.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def wall(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} s ({min(values):.2f}–{max(values):.2f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--profile", type=Path, help="also write one run's cProfile statistics here (text)")
    args = p.parse_args()
    python = sys.executable
    kvlab = [python, "-m", "kvlab.cli", "run", args.model, "hi", "--max-tokens", "1"]
    torch_only = [python, "-c", "import torch"]
    wall(kvlab)  # warm the page cache and compile the kernels once; not counted
    runs: dict[str, list[float]] = {"import torch": [], "kvlab run": []}
    for i in range(args.repeat):
        order = [("import torch", torch_only), ("kvlab run", kvlab)]
        for name, cmd in order if i % 2 == 0 else order[::-1]:
            runs[name].append(wall(cmd))
    extra = [k - t for k, t in zip(runs["kvlab run"], runs["import torch"])]
    for name, values in runs.items():
        print(f"{name:14s} {summary(values)}")
    print(f"{'difference':14s} {summary(extra)}   (median of the rounds' differences)")
    if args.profile:
        out = args.profile.with_suffix(".prof")
        subprocess.run([python, "-m", "cProfile", "-o", str(out), "-m", "kvlab.cli", *kvlab[3:]],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        import pstats

        with open(args.profile, "w") as f:
            pstats.Stats(str(out), stream=f).sort_stats("cumulative").print_stats(60)
        print(f"profile of one run: {args.profile}")


if __name__ == "__main__":
    main()
