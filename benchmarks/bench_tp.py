"""Tensor parallelism's cost on this machine: world size 1 against 2, and the all-reduce share of a step.

    .venv/bin/python benchmarks/bench_tp.py --model qwen2.5-coder-0.5b --repeat 3

Each round launches `torchrun --nproc-per-node N` for N = 1 and 2 (order alternating) on the same
cores (--cores, default 2: one rank with 2 threads, or two ranks with 1 each), and measures on rank 0:
  - decode: one request, 32 greedy tokens after a 64-token prompt: TPOT and tok/s
  - batch: 16 requests × (64 in, 32 out) at once: output tok/s
  - all-reduce: seconds spent in collectives per decode step, and how many (2 per layer + the
    embedding's and the LM head's)
Prints medians (min–max) over rounds. Not part of `make test`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker(model: str, threads: int, out: str) -> None:
    sys.path.insert(0, str(ROOT))
    import torch

    from kvlab.config import EngineConfig
    from kvlab.engine import LLMEngine
    from kvlab.kernels import ThreadPolicy
    from kvlab.model.huge_pages import into_huge_pages
    from kvlab.model.loader import load_model
    from kvlab.output.result import RequestOutput
    from kvlab.parallel import shard_model, tensor_parallel
    from kvlab.sampling import SamplingParams

    torch.set_num_threads(threads)
    group = tensor_parallel(int(os.environ.get("WORLD_SIZE", "1")))
    loaded = shard_model(load_model(model, huge_pages=False), group)  # each rank its own rows, as LLM does
    into_huge_pages(loaded.model)
    engine = LLMEngine(loaded, None, EngineConfig(max_model_len=512, max_num_seqs=16, enable_prefix_caching=False,
                                                  max_num_batched_tokens=1024), policy=ThreadPolicy(threads=threads))  # fmt: skip
    g = torch.Generator().manual_seed(0)
    vocab = loaded.config.vocab_size
    greedy = SamplingParams(max_tokens=33, temperature=0, ignore_eos=True)

    def run(prompts: list[list[int]]) -> tuple[list[RequestOutput], float]:
        outs = [RequestOutput(prompt=None, prompt_token_ids=p) for p in prompts]
        for p, o in zip(prompts, outs):
            engine.add_request(p, greedy, output=o)
        t = time.perf_counter()
        while engine.has_unfinished_requests:
            engine.step()
        return outs, time.perf_counter() - t

    prompt = lambda: torch.randint(100, vocab - 100, (64,), generator=g).tolist()  # noqa: E731
    run([prompt()])  # warm-up
    outs, _ = run([prompt()])
    m = outs[0].metrics
    group.take_comm_seconds()
    outs, _ = run([prompt()])
    comm_s, collectives = group.take_comm_seconds()
    steps = outs[0].metrics.decode_steps + 1
    batch, wall = run([prompt() for _ in range(16)])
    if group.is_leader:
        Path(out).write_text(json.dumps({
            "tpot_ms": 1000 * m.decode_s / 32, "decode_tok_s": 32 / m.decode_s,
            "comm_ms_per_step": 1000 * comm_s / steps, "collectives_per_step": collectives / steps,
            "batch_tok_s": sum(o.metrics.generated_tokens for o in batch) / wall,
            "weight_bytes_per_rank": loaded.weight_bytes,
        }))  # fmt: skip
    group.close()


def launch(model: str, world: int, threads: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
    cmd = [str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node", str(world), __file__,
           "--worker", "--model", model, "--threads", str(threads), "--out", out]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"world {world} failed:\n{done.stderr[-3000:]}")
    result = json.loads(Path(out).read_text())
    os.unlink(out)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cores", type=int, default=2, help="threads of all ranks together")
    ap.add_argument("--threads", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    if args.worker:
        worker(args.model, args.threads, args.out)
        return 0
    runs: dict[int, list[dict]] = {1: [], 2: []}
    for r in range(args.repeat):
        for world in ((1, 2) if r % 2 == 0 else (2, 1)):
            runs[world].append(launch(args.model, world, max(args.cores // world, 1)))
            print(f"  round {r + 1} world {world}: {runs[world][-1]}", flush=True)
    table = {w: {k: statistics.median(run[k] for run in rs) for k in rs[0]} for w, rs in runs.items()}
    print(f"\n{args.model} on {args.cores} cores (threads per rank: cores ÷ world size); medians of {args.repeat}")
    print(f"{'':26s} {'world 1':>12s} {'world 2':>12s}")
    for k in table[1]:
        print(f"{k:26s} {table[1][k]:12.2f} {table[2][k]:12.2f}")
    share = table[2]["comm_ms_per_step"] / table[2]["tpot_ms"]
    print(f"world 2: collectives take {100 * share:.0f}% of a decode step")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "medians": table}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
