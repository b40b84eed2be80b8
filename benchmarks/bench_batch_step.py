"""What a decode step of B sequences costs against a step of one, on the path `kvlab serve` uses.

    .venv/bin/python benchmarks/bench_batch_step.py                        # both registry models
    .venv/bin/python benchmarks/bench_batch_step.py --models smollm2-135m --batches 1 4 16 --rounds 5

Seed 002's claim: the weights are read once for all the sequences of a step, so 10 tokens at once cost
about 1.9× one (28 vs 52 ms). For each model and setting (the exact products, and `--activation-quant
int8`), B requests with distinct 64-token prompts are prefilled, then decode steps of all B are timed
(wall clock, the engine's own step(): scheduling, the C decode step, sampling). Settings and batch
sizes alternate within every round; the figures are medians over rounds of each round's median step.
The split: the products alone (every matrix of the model through its kernel with B rows, timed the
same way), and the rest of the step (attention over the cache, norms, sampling, scheduling).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvlab  # noqa: E402,F401  (before torch: its OpenMP settings, kvlab/__init__.py)
import torch  # noqa: E402

from kvlab import LLM, SamplingParams  # noqa: E402
from kvlab.kernels import quant  # noqa: E402
from kvlab.lab.common import cpu_model  # noqa: E402
from kvlab.quant.linear import PackedLinear  # noqa: E402

SETTINGS = {"exact": None, "int8": "int8"}


def decode_steps(llm: LLM, batch: int, steps: int, prompt_len: int, seed: int) -> list[float]:
    """Seconds of each of `steps` decode steps of `batch` sequences (prompts prefilled first)."""
    engine = llm.engine
    g = torch.Generator().manual_seed(seed)
    vocab = min(llm.config.vocab_size, 30000)
    params = SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True)
    for b in range(batch):
        engine.add_request(torch.randint(100, vocab, (prompt_len,), generator=g).tolist(), params)
    while engine.num_waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()  # prefill (and the first token)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    while engine.has_unfinished_requests:
        engine.step()
    return times


def product_seconds(llm: LLM, batch: int, repeats: int) -> float:
    """One pass of every packed matrix of the model with `batch` rows: the products of one step."""
    layers = [m for m in llm.loaded.model.modules() if isinstance(m, PackedLinear)]
    xs = {m.in_features: torch.randn(batch, m.in_features) for m in layers}
    threads = llm.policy.threads
    best = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for m in layers:
            quant.packed_linear(xs[m.in_features], m.packed(), m.out_features, threads=threads)
        best.append(time.perf_counter() - t0)
    return statistics.median(best)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-0.5b"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=12, help="timed decode steps per batch and round")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-cache-dtype", default="auto", help="the KV cache's format, as `kvlab serve` takes it")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    results = {"machine": {"cpu": cpu_model(), "threads": args.threads, "command": " ".join(sys.argv)}, "models": {}}
    print(f"# {cpu_model()}, {args.threads} threads, KV cache {args.kv_cache_dtype}; step = wall time of engine.step() "
          "with B sequences decoding")
    for model in args.models:
        llms = {s: LLM(model, threads=args.threads, activation_quant=SETTINGS[s], max_model_len=1024,
                       enable_prefix_caching=False, kv_cache_dtype=args.kv_cache_dtype) for s in args.settings}  # fmt: skip
        samples = {(s, b): [] for s in args.settings for b in args.batches}
        for r in range(args.rounds):
            for b in args.batches:
                for s in args.settings:
                    samples[s, b].append(statistics.median(decode_steps(llms[s], b, args.steps, args.prompt_len, seed=r)))
        rows = {}
        for s in args.settings:
            one = statistics.median(samples[s, args.batches[0]])
            for b in args.batches:
                step = statistics.median(samples[s, b])
                prod = product_seconds(llms[s], b, repeats=5)
                rows[f"{s}/{b}"] = {"setting": s, "batch": b, "step_ms": step * 1e3, "tok_s": b / step,
                                    "vs_batch_1": step / one, "products_ms": prod * 1e3,
                                    "rest_ms": (step - prod) * 1e3, "weight_format": llms[s].loaded.weight_format}  # fmt: skip
                row = rows[f"{s}/{b}"]
                print(f"{model:>20} {s:>6} B={b:<3} step {row['step_ms']:7.2f} ms  ×{row['vs_batch_1']:.2f} of B=1  "
                      f"{row['tok_s']:7.1f} tok/s  products {row['products_ms']:6.2f} ms  rest {row['rest_ms']:6.2f} ms",
                      flush=True)  # fmt: skip
        if "exact" in args.settings and "int8" in args.settings:
            base = statistics.median(samples["exact", args.batches[0]])
            for b in args.batches:
                r = statistics.median(samples["int8", b]) / base
                rows[f"int8/{b}"]["vs_exact_batch_1"] = r
                print(f"{model:>20}   int8 B={b:<3} step ×{r:.2f} of the exact B=1 step")
        results["models"][model] = rows
        for llm in llms.values():
            llm.close()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
