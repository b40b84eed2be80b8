"""Start-up: `kvlab run MODEL "hi" --max-tokens 1` beside `import torch`, or (--small) the small questions.

The small questions load no model: `--version`, `--help`, `list`, argument, name and file errors.

    .venv/bin/python benchmarks/bench_startup.py --model smollm2-135m --repeat 5
    .venv/bin/python benchmarks/bench_startup.py --small --repeat 7

Both commands run as fresh processes, alternating round by round, so the machine's noise falls on
both; it prints each one's median (min–max) and the median of the per-round differences, which is
what kvlab itself adds to importing torch. `--profile` also writes a cProfile of one run (sorted by
cumulative time) to see where that difference goes. Not part of `make test`.

`--small` runs each small question as a whole process (`kvlab ...` as the console script starts it, in an
empty KVLAB_HOME), --repeat times in rotation, and prints a table of medians (min–max) with its exit code,
beside `python -c pass` and `python -c "import torch"` for scale. None of them should import torch: the
table's last column says whether each did. To time another checkout (`git archive REV kvlab | tar -x -C DIR`),
run this from outside any checkout with PYTHONPATH=DIR (`python -c` puts the current directory first).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def wall(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} s ({min(values):.2f}–{max(values):.2f})"


# the small questions: each must answer without importing torch
SMALL = [
    ["--version"],
    ["--help"],
    ["list"],
    ["run", "no-such-model"],
    ["run", "smollm2-135m", "--top-p", "5"],
    ["run", "/missing/file.gguf"],
    ["pull", "no-such-model"],
    ["rm", "smollm2-135m"],
    ["run", "--help"],
]
# `kvlab ARGS` as the console script runs it, then whether torch came in (on stderr's last line)
KVLAB = ("import sys; from kvlab.cli import main\n"
         "try:\n    code = main(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\n"
         "sys.stdout.flush(); print('TORCH' if 'torch' in sys.modules else 'no torch', file=sys.stderr)\n"
         "sys.exit(code)")


def timed(cmd: list[str], env: dict) -> tuple[float, int, str]:
    """(seconds, exit code, stderr's last line) of one whole process."""
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)  # fmt: skip
    seconds = time.perf_counter() - start
    return seconds, done.returncode, (done.stderr.strip().splitlines() or [""])[-1]


def small(repeat: int) -> None:
    """Each small question `repeat` times, in rotation, as whole processes; one table."""
    python = sys.executable
    with tempfile.TemporaryDirectory() as home:
        env = {**os.environ, "KVLAB_HOME": home}
        rows = [("python -c pass", [python, "-c", "pass"]),
                ("python -c 'import torch'", [python, "-c", "import torch"])]  # fmt: skip
        rows += [("kvlab " + " ".join(args), [python, "-c", KVLAB, *args]) for args in SMALL]
        times: dict[str, list[float]] = {name: [] for name, _ in rows}
        codes, torch_seen = {}, {}
        for name, cmd in rows:  # once each, not counted: the page cache and .pyc files
            timed(cmd, env)
        for _ in range(repeat):
            for name, cmd in rows:
                seconds, codes[name], last = timed(cmd, env)
                times[name].append(seconds)
                torch_seen[name] = "yes" if last == "TORCH" else "no" if last == "no torch" else "-"
    print(f"{platform.node()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; "
          f"Python {platform.python_version()}; median (min–max) of {repeat} runs each, as whole processes")
    width = max(len(name) for name, _ in rows)
    print(f"{'command':{width}}  {'wall time':>22}  exit  torch")
    for name, _ in rows:
        print(f"{name:{width}}  {summary(times[name]):>22}  {codes[name]:>4}  {torch_seen[name]:>5}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--profile", type=Path, help="also write one run's cProfile statistics here (text)")
    p.add_argument("--small", action="store_true", help="time the small questions instead (no model loaded)")
    args = p.parse_args()
    if args.small:
        small(args.repeat)
        return
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
