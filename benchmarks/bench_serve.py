"""The serving engine on this machine: batching, prefix caching, and the step layout, in one run.

    .venv/bin/python benchmarks/bench_serve.py --model smollm2-135m --threads 2 --repeat 3 --json serve.json

  1. batching      16 requests (64 prompt tokens, 64 output tokens, EOS ignored) all at once, against
                   the same 16 one after another: total output tok/s and the ratio (issue target ≥ 4×);
                   the share of each run's time in steps with prompt tokens, and the ratio of the rest
  2. prefix cache  a 1,000-token shared prefix + 16 own tokens: TTFT on a miss (new prefix) against a
                   hit (the same prefix again): the ratio (target ≥ 5×)
  3. step layout   8 requests decoding while 8 prompts arrive: prompt chunks packed into the decodes'
                   forward against forwards of their own; and the decode step at 16 sequences with the
                   GEMV kernel (the thread policy's max_kernel_rows) against BLAS

Every figure is a median over --repeat runs (min–max beside it); warm-up runs are excluded; each run
uses fresh random prompts (seeded), so no run hits the prefix cache of another unless it should.
The same workloads run against a server with `kvlab bench serve --url ...`.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvlab  # noqa: E402,F401  (before torch: its OpenMP settings, kvlab/__init__.py)
import torch  # noqa: E402

from kvlab.bench.serve import Workload, run_in_process  # noqa: E402
from kvlab.config import EngineConfig  # noqa: E402
from kvlab.engine import LLMEngine  # noqa: E402
from kvlab.kernels import ThreadPolicy  # noqa: E402
from kvlab.model.loader import load_model  # noqa: E402
from kvlab.llm import settle_heap  # noqa: E402
from kvlab.quant.activations import with_int8_activations  # noqa: E402
from kvlab.sampling import SamplingParams  # noqa: E402


def stats(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "samples": xs}


POLICY = ThreadPolicy()  # every engine of the run: --threads, --gemv-max-rows (set in main)
ENGINE_OPTIONS = {"kv_memory_bytes": 2**30}  # every engine's: --kv-cache-dtype (set in main)


def engine(loaded, **options) -> LLMEngine:
    return LLMEngine(loaded, None, EngineConfig(**ENGINE_OPTIONS, **options), policy=POLICY)


def batching(loaded, repeat: int, requests: int, prompt_len: int, output_len: int) -> dict:
    eng = engine(loaded)
    run_in_process(eng, Workload(4, 4, prompt_len, 8, seed=999))  # warm-up
    concurrent, sequential, runs = [], [], []
    times = {requests: [], 1: []}  # per run: (duration, seconds in steps with prompt tokens)
    for r in range(repeat):
        for concurrency, sink in ((requests, concurrent), (1, sequential)):
            w = Workload(requests, concurrency, prompt_len, output_len, seed=1000 * r + concurrency)
            result = run_in_process(eng, w)
            sink.append(result.summary()["output_tok_s"])
            runs.append(result.summary())
            times[concurrency].append((result.duration_s, result.prompt_step_s))
            print(f"  run {r + 1}: {concurrency:2d} at a time  {sink[-1]:7.1f} output tok/s  "
                  f"(TTFT p50 {result.summary()['ttft_p50_s'] * 1000:.0f} ms, "
                  f"TPOT p50 {result.summary()['tpot_p50_s'] * 1000:.1f} ms)", flush=True)  # fmt: skip
    ratios = [c / s for c, s in zip(concurrent, sequential)]
    # the prompts cost the same arithmetic either way; what batching can save is in the other steps
    decode_ratios = [(sd - sp) / (cd - cp) for (cd, cp), (sd, sp) in zip(times[requests], times[1])]
    return {"concurrent_tok_s": stats(concurrent), "sequential_tok_s": stats(sequential), "ratio": stats(ratios),
            "concurrent_prompt_share": stats([p / d for d, p in times[requests]]),
            "sequential_prompt_share": stats([p / d for d, p in times[1]]),
            "decode_steps_ratio": stats(decode_ratios), "runs": runs}  # fmt: skip


def prefix(loaded, repeat: int, prefix_len: int, suffix_len: int) -> dict:
    eng = engine(loaded)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    vocab = loaded.config.vocab_size
    miss, hit, cached = [], [], []

    def ttft(ids):
        rid = eng.add_request(ids, params)
        while eng.has_unfinished_requests:
            for out in eng.step():
                if out.request_id == rid and out.finished:
                    return out.output.metrics

    g = torch.Generator().manual_seed(7)
    ttft(torch.randint(100, vocab - 100, (prefix_len + suffix_len,), generator=g).tolist())  # warm-up
    for _ in range(repeat):
        shared = torch.randint(100, vocab - 100, (prefix_len,), generator=g).tolist()
        own = [torch.randint(100, vocab - 100, (suffix_len,), generator=g).tolist() for _ in range(2)]
        first, second = ttft(shared + own[0]), ttft(shared + own[1])
        miss.append(first.ttft_s)
        hit.append(second.ttft_s)
        cached.append(second.cached_prompt_tokens)
        print(f"  miss {first.ttft_s * 1000:7.1f} ms ({first.cached_prompt_tokens} cached)   "
              f"hit {second.ttft_s * 1000:6.1f} ms ({second.cached_prompt_tokens} cached)", flush=True)  # fmt: skip
    return {"ttft_miss_s": stats(miss), "ttft_hit_s": stats(hit), "ratio": stats([m / h for m, h in zip(miss, hit)]),
            "cached_tokens_on_hit": cached, "prefix_len": prefix_len, "suffix_len": suffix_len}  # fmt: skip


def step_layout(loaded, repeat: int) -> dict:
    """8 decoding + 8 prompts of 64 arriving; and one decode step at 16 sequences, GEMV vs BLAS."""
    out = {}
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    vocab = loaded.config.vocab_size
    for pack in (True, False):
        eng = engine(loaded, pack_prompts=pack, enable_prefix_caching=False)
        times = []
        for r in range(repeat + 1):
            g = torch.Generator().manual_seed(r)
            ids = [torch.randint(100, vocab - 100, (64,), generator=g).tolist() for _ in range(16)]
            for p in ids[:8]:
                eng.add_request(p, params)
            for _ in range(3):
                eng.step()  # the first 8 are decoding now
            for p in ids[8:]:
                eng.add_request(p, params)
            t = time.perf_counter()
            eng.step()  # 8 decodes + 8 × 64 prompt tokens (one step at the default 512-token budget... and the rest)
            while eng.num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running):
                eng.step()
            if r:  # the first is warm-up
                times.append(time.perf_counter() - t)
            while eng.has_unfinished_requests:
                eng.step()
        out["packed_s" if pack else "separate_s"] = stats(times)
    eng = engine(loaded, enable_prefix_caching=False)
    g = torch.Generator().manual_seed(99)
    for p in [torch.randint(100, vocab - 100, (64,), generator=g).tolist() for _ in range(16)]:
        eng.add_request(p, SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True))
    eng.step()  # all prompts in (one step with a 1,024-token budget... two at 512)
    while any(r.num_output_tokens == 0 for r in eng.scheduler.running) or eng.num_waiting:
        eng.step()
    default_rows = POLICY.max_kernel_rows
    for label, rows in (("blas", 8), ("gemv", 64)):
        POLICY.max_kernel_rows = rows  # the engine's own policy: its next passes read it
        try:
            eng.step()
            samples = []
            for _ in range(max(repeat, 3) * 3):
                t = time.perf_counter()
                eng.step()
                samples.append(time.perf_counter() - t)
        finally:
            POLICY.max_kernel_rows = default_rows
        out[f"decode_step_16_{label}_s"] = stats(samples)
    for rid in list(eng._states):
        eng.abort_request(rid)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--prefix-len", type=int, default=1000)
    ap.add_argument("--skip", action="append", default=[], choices=["batching", "prefix", "layout"])
    ap.add_argument("--gemv-max-rows", type=int,
                    help="try another crossover between the GEMV kernel and BLAS (max_kernel_rows) for this run")  # fmt: skip
    ap.add_argument("--activation-quant", choices=["int8"],
                    help="kvlab's 8-bit activations over the GGUF blocks (opt-in; `kvlab quality` measures them)")  # fmt: skip
    ap.add_argument("--kv-cache-dtype", default="auto", help="the KV cache's format, as `kvlab serve` takes it")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    POLICY.threads = args.threads
    ENGINE_OPTIONS["kv_cache_dtype"] = args.kv_cache_dtype
    if args.gemv_max_rows is not None:
        POLICY.max_kernel_rows = args.gemv_max_rows
    loaded = load_model(args.model, dtype=args.dtype)
    if args.activation_quant:
        loaded = with_int8_activations(loaded)
    settle_heap()  # as `kvlab serve` does after its load (KVLAB_GC_FREEZE=0: not)
    results = {
        "command": " ".join(sys.argv),
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__, "python": platform.python_version(), "commit": _commit()},  # fmt: skip
        "model": args.model,
        "dtype": args.dtype,
        "activation_quant": args.activation_quant,
        "kv_cache_dtype": args.kv_cache_dtype,
        "gemv_max_rows": POLICY.max_kernel_rows,
    }
    if "batching" not in args.skip:
        print(f"1. batching: {args.requests} × ({args.prompt_len} in, {args.output_len} out)", flush=True)
        results["batching"] = batching(loaded, args.repeat, args.requests, args.prompt_len, args.output_len)
    if "prefix" not in args.skip:
        print(f"2. prefix cache: {args.prefix_len}-token shared prefix + 16 tokens, TTFT", flush=True)
        results["prefix"] = prefix(loaded, args.repeat, args.prefix_len, 16)
    if "layout" not in args.skip:
        print("3. step layout", flush=True)
        results["layout"] = step_layout(loaded, args.repeat)
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def print_table(r: dict) -> None:
    def cell(s, scale=1.0, unit=""):
        return f"{s['median'] * scale:.1f}{unit} ({s['min'] * scale:.1f}–{s['max'] * scale:.1f})"

    m = r["machine"]
    acts = f", {r['activation_quant']} activations" if r.get("activation_quant") else ""
    kv = f", KV cache {r['kv_cache_dtype']}" if r.get("kv_cache_dtype", "auto") != "auto" else ""
    print(f"\n{r['model']} {r['dtype']}{acts}{kv}, {m['threads']} threads, torch {m['torch']}, commit {m['commit']}")
    if "batching" in r:
        b = r["batching"]
        print(f"  concurrent output tok/s   {cell(b['concurrent_tok_s'])}")
        print(f"  sequential output tok/s   {cell(b['sequential_tok_s'])}")
        print(f"  ratio                     {cell(b['ratio'], unit='×')}   (target ≥ 4×)")
        if "decode_steps_ratio" in b:  # results saved before it print as they did
            print(f"  steps with prompt tokens  {cell(b['concurrent_prompt_share'], 100, '%')} of the concurrent run's "
                  f"time, {cell(b['sequential_prompt_share'], 100, '%')} of the sequential's")  # fmt: skip
            print(f"  ratio of the other steps  {cell(b['decode_steps_ratio'], unit='×')}   (decode rows only)")
    if "prefix" in r:
        p = r["prefix"]
        print(f"  TTFT miss                 {cell(p['ttft_miss_s'], 1000, ' ms')}")
        print(f"  TTFT hit                  {cell(p['ttft_hit_s'], 1000, ' ms')}")
        print(f"  ratio                     {cell(p['ratio'], unit='×')}   (target ≥ 5×)")
    if "layout" in r:
        s = r["layout"]
        print(f"  8 decodes + 8 prompts: packed {cell(s['packed_s'], 1000, ' ms')}, "
              f"separate forwards {cell(s['separate_s'], 1000, ' ms')}")  # fmt: skip
        print(f"  decode step, 16 sequences: BLAS {cell(s['decode_step_16_blas_s'], 1000, ' ms')}, "
              f"GEMV kernel {cell(s['decode_step_16_gemv_s'], 1000, ' ms')}")  # fmt: skip


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip()  # fmt: skip
    except OSError:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
