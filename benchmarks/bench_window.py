"""What the sliding window saves: the windowed paged cache against the full one, on gemma3-270m.

    .venv/bin/python benchmarks/bench_window.py --model gemma3-270m --contexts 64 1000 4000 --repeat 3

For each context length a prompt of that many tokens is prefilled, then 32 greedy tokens are decoded;
two engines share the loaded model (its own GGUF blocks):
  - windowed: sliding layers keep only the blocks their 512-token window reaches (kv/layout.py)
  - full:     every layer keeps every token, the window only a mask (llama.cpp's --swa-full)
Runs alternate between the two so machine drift hits both; warm-up runs are excluded. Printed: decode
tok/s (median, min–max), the peak KV bytes the request held (blocks in use × block bytes, sampled
inside each step, a 512-token prefill chunk included), and `kvlab mem`'s figure at the final length.
--json prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvlab import SamplingParams  # noqa: E402
from kvlab.config import EngineConfig  # noqa: E402
from kvlab.engine import LLMEngine  # noqa: E402
from kvlab.memory import kv_bytes  # noqa: E402
from kvlab.model.loader import load_model  # noqa: E402

DECODE_TOKENS = 32
MODES = {"windowed": True, "full": False}


def run_once(engine: LLMEngine, prompt: list[int]) -> tuple[float, int]:
    """(decode tok/s, peak KV bytes held) of one request: the prompt prefilled, then DECODE_TOKENS tokens."""
    params = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0, ignore_eos=True)
    rid = engine.add_request(prompt, params)
    per_block, peaks, first, last = engine.pool_plan.bytes_per_block, [0], None, None
    forward = engine.runner.forward

    def sampled_forward(inputs):  # inside the step: its blocks allocated, the window not yet slid
        peaks.append(engine.kv.pool.num_used_blocks * per_block)
        return forward(inputs)

    engine.runner.forward = sampled_forward
    while engine.has_unfinished_requests:
        outs = engine.step()
        now = time.perf_counter()
        if any(o.request_id == rid and o.output.token_ids for o in outs):
            first = first or now  # the first token ends the prefill
            last = now
    engine.runner.forward = forward
    return (DECODE_TOKENS - 1) / (last - first), max(peaks)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--contexts", type=int, nargs="+", default=[64, 1000, 4000])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    max_len = max(args.contexts) + DECODE_TOKENS + 16
    loaded = load_model(args.model, max_positions=max_len)
    configs = {mode: EngineConfig(max_model_len=max_len, kv_memory_bytes=256 << 20, windowed_kv=windowed,
                                  enable_prefix_caching=False) for mode, windowed in MODES.items()}  # fmt: skip
    engines = {mode: LLMEngine(loaded, None, config) for mode, config in configs.items()}
    g = torch.Generator().manual_seed(0)
    rows = []
    for context in args.contexts:
        prompt = [2] + torch.randint(1_000, 200_000, (context - 1,), generator=g).tolist()
        speeds: dict[str, list[float]] = {m: [] for m in MODES}
        peaks: dict[str, int] = {}
        for i in range(args.repeat + 1):  # run 0 warms up
            for mode, engine in engines.items():
                tok_s, peak = run_once(engine, prompt)
                if i:
                    speeds[mode].append(tok_s)
                peaks[mode] = peak
        final = context + DECODE_TOKENS - 1  # tokens computed when the last one is sampled
        row = {"context": context, "kvlab_mem_bytes": kv_bytes(loaded.config, final, kv_dtype="float32")}
        for mode in MODES:
            xs = speeds[mode]
            row[mode] = {"decode_tok_s": {"median": statistics.median(xs), "min": min(xs), "max": max(xs)},
                         "peak_kv_bytes": peaks[mode]}  # fmt: skip
        rows.append(row)
    result = {"model": args.model, "weights": loaded.weight_format, "threads": args.threads, "rows": rows,
              "machine": platform.processor() or platform.machine(), "decode_tokens": DECODE_TOKENS}  # fmt: skip
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{args.model} ({loaded.weight_format}), {args.threads} threads, {DECODE_TOKENS} decoded tokens, "
          f"median of {args.repeat} (min–max)")  # fmt: skip
    print(f"{'context':>8}  {'windowed tok/s':>22}  {'full tok/s':>22}  {'peak KV windowed':>17}  "
          f"{'peak KV full':>13}  {'kvlab mem':>10}")  # fmt: skip
    for r in rows:
        cells = []
        for mode in MODES:
            s = r[mode]["decode_tok_s"]
            cells.append(f"{s['median']:7.1f} ({s['min']:.1f}–{s['max']:.1f})")
        w, f = r["windowed"]["peak_kv_bytes"], r["full"]["peak_kv_bytes"]
        print(f"{r['context']:>8}  {cells[0]:>22}  {cells[1]:>22}  {w / 2**20:>13.2f} MiB  {f / 2**20:>9.2f} MiB  "
              f"{r['kvlab_mem_bytes'] / 2**20:>6.2f} MiB")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
