"""What the prompt cache's disk tier buys: TTFT of a long prompt cold, warm in memory, and from disk after a restart.

    .venv/bin/python benchmarks/bench_prompt_cache.py --models smollm2-135m qwen2.5-coder-0.5b \
        --kv float32 q8_0 --tokens 4000 --repeat 3 [--cold-repeat 1]

For each model and KV format, with --prompt-cache-dir a fresh temporary directory:
  - cold:        a ~4,000-token prompt (Python's own sources, tokenized) prefilled from nothing; the
                 engine writes its blocks to disk meanwhile (off the hot path)
  - warm memory: the same prompt again in the same engine (prefix cache in memory)
  - from disk:   a new engine (a new, empty KV pool and a new tier over the same directory, as after a
                 restart; the loaded weights are shared so that their load is not what is measured)
                 gets the same prompt: its blocks are read back from disk, only the tail is prefilled
Each cold run uses another prompt (its first tokens differ, so no block is shared between them;
--cold-repeat, as cold runs are what take long); each from-disk run is another restart; a short
request warms each engine up first (excluded). Printed: TTFT median (min–max) per mode,
cold / from-disk, the bytes read, and the prompt tokens each mode served from memory and disk. The
files are read through the OS page cache (nothing drops it: the machine is shared), as they would be
soon after the restart of a server on the same host; a cold disk adds its read time (bytes read ÷
the disk's bandwidth). The machine is shared and noisy: medians. --json prints one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvlab import SamplingParams  # noqa: E402
from kvlab.config import EngineConfig  # noqa: E402
from kvlab.engine import LLMEngine  # noqa: E402
from kvlab.model.loader import load_model  # noqa: E402
from kvlab.quality.text import text_ids  # noqa: E402
from kvlab.tokenizer import load_tokenizer  # noqa: E402

MODES = ("cold", "memory", "disk")


def ttft(engine: LLMEngine, prompt: list[int]) -> tuple[float, int, int, float]:
    """(TTFT s, cached prompt tokens, of which from disk, queue s) of one request generating one token. From
    disk, the queue is the read and the copy into the pool (the request waits for them outside the
    scheduler); the rest of TTFT is the prefill of the prompt's last, partial block."""
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    rid = engine.add_request(prompt, params, arrival_s=t0)
    out = None
    while engine.has_unfinished_requests:
        for o in engine.step():
            if o.request_id == rid and o.finished:
                out = o.output
    m = out.metrics
    return m.ttft_s, m.cached_prompt_tokens, m.cached_prompt_tokens_disk, m.queue_s


def engine_for(loaded, kv: str, directory: str, max_len: int) -> LLMEngine:
    config = EngineConfig(max_model_len=max_len, kv_memory_bytes=2 << 30, kv_cache_dtype=kv,
                          prompt_cache_dir=directory, prompt_cache_size=16 << 30)  # fmt: skip
    engine = LLMEngine(loaded, None, config)
    ttft(engine, [1] + list(range(100, 164)))  # warm-up: kernels built, pages touched
    return engine


def bench(loaded, base: list[int], kv: str, repeat: int, cold_repeat: int) -> dict:
    directory = tempfile.mkdtemp(prefix="kvlab-bench-prompt-cache-")
    max_len = len(base) + 64
    # each cold run another prompt: its first tokens differ, so no block is shared with the others
    prompts = [[1000 + 7 * r + i for i in range(16)] + base[16:] for r in range(cold_repeat)]
    times: dict[str, list[float]] = {m: [] for m in MODES}
    served: dict[str, tuple[int, int]] = {}
    read, waited = [], []
    try:
        first = engine_for(loaded, kv, directory, max_len)
        for p in prompts:
            times["cold"].append(ttft(first, p)[0])
            served["cold"] = (0, 0)
        for r in range(repeat):  # the last cold prompt again, from the prefix cache in memory
            t, cached, disk, _ = ttft(first, prompts[-1])
            times["memory"].append(t)
            served["memory"] = (cached, disk)
        first.close()  # every block written (the end of the first process)
        file_bytes = first.prompt_cache.store.file_bytes
        del first
        gc.collect()
        for r in range(repeat):  # each a restart: a new engine, an empty pool, the same directory
            second = engine_for(loaded, kv, directory, max_len)
            t, cached, disk, queue_s = ttft(second, prompts[r % len(prompts)])
            times["disk"].append(t)
            waited.append(queue_s)
            served["disk"] = (cached, disk)
            read.append(second.prompt_cache.stats.bytes_read)
            second.close()
            del second
            gc.collect()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    row = {"kv": kv, "file_bytes": file_bytes, "bytes_read_per_prompt": statistics.median(read),
           "disk_read_and_copy_s": statistics.median(waited)}  # fmt: skip
    for mode in MODES:
        xs = times[mode]
        row[mode] = {"median_s": statistics.median(xs), "min_s": min(xs), "max_s": max(xs), "runs": len(xs),
                     "cached_tokens": served[mode][0], "from_disk": served[mode][1]}  # fmt: skip
    row["cold_over_disk"] = row["cold"]["median_s"] / row["disk"]["median_s"]
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-0.5b"])
    p.add_argument("--kv", nargs="+", default=["float32", "q8_0"])
    p.add_argument("--tokens", type=int, default=4000)
    p.add_argument("--repeat", type=int, default=3, help="warm-memory and from-disk runs (each from disk a restart)")
    p.add_argument("--cold-repeat", type=int, help="cold runs, each another prompt (default --repeat)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = []
    for name in args.models:
        loaded = load_model(name, max_positions=args.tokens + 64)
        base, what = text_ids(load_tokenizer(loaded), args.tokens)
        for kv in args.kv:
            row = bench(loaded, base, kv, args.repeat, args.cold_repeat or args.repeat)
            row.update(model=name, weights=loaded.weight_format, prompt_tokens=len(base), text=what)
            results.append(row)
            if not args.json:
                print(line(row), flush=True)
        del loaded
        gc.collect()
    machine = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "threads": args.threads,
               "load_avg": os.getloadavg(), "command": " ".join(sys.argv)}  # fmt: skip
    if args.json:
        print(json.dumps({"machine": machine, "repeat": args.repeat, "rows": results}, indent=2))
    else:
        print(f"median (min–max) of {args.cold_repeat or args.repeat} cold and {args.repeat} memory and disk runs; "
              f"{machine}")  # fmt: skip
    return 0


def line(r: dict) -> str:
    cells = []
    for mode in MODES:
        m = r[mode]
        cells.append(f"{mode} {m['median_s'] * 1000:.0f} ms ({m['min_s'] * 1000:.0f}–{m['max_s'] * 1000:.0f}; "
                     f"{m['cached_tokens']} cached, {m['from_disk']} from disk)")  # fmt: skip
    return (f"{r['model']:<20} {r['kv']:<8} {r['prompt_tokens']} tokens: " + " | ".join(cells)
            + f" | cold/disk {r['cold_over_disk']:.1f}×, {r['bytes_read_per_prompt'] / 2**20:.1f} MiB read and "
            f"copied in {r['disk_read_and_copy_s'] * 1000:.0f} ms")


if __name__ == "__main__":
    sys.exit(main())
