"""What a decode step of B sequences costs against a step of one, on the path `kvlab serve` uses.

    .venv/bin/python benchmarks/bench_batch_step.py                        # both registry models
    .venv/bin/python benchmarks/bench_batch_step.py --models smollm2-135m --batches 1 4 16 --rounds 5

Seed 002's claim: the weights are read once for all the sequences of a step, so 10 tokens at once cost
about 1.9× one (28 vs 52 ms). For each model and setting (the exact products, and `--activation-quant
int8`), B requests with distinct 64-token prompts are prefilled, then decode steps of all B are timed
(wall clock, the engine's own step(): scheduling, the C decode step, sampling). Settings and batch
sizes alternate within every round; the figures are medians over rounds of each round's median step.
The split, timed inside the same steps (the decode backend's phase clock): the matrix products (the
layers', and the LM head's apart), the mixer (attention over the cache with RoPE and the new K/V's
writes), the layers' other work (norms, residuals, the gated activation), and the rest of the step
(the embedding, sampling, scheduling: the engine's Python). Each round also measures the arithmetic
roof (kernels/probe.py: the float32 multiply-adds a second a loop of FMAs makes on the threads, and on
one): B × a token's multiply-adds ÷ that rate is the least time the exact products of a step can take.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvlab  # noqa: E402,F401  (before torch: its OpenMP settings, kvlab/__init__.py)
import torch  # noqa: E402

from kvlab import LLM, SamplingParams  # noqa: E402
from kvlab.backends.cpu import PHASES  # noqa: E402
from kvlab.kernels.probe import mac_rate  # noqa: E402
from kvlab.lab.common import cpu_model  # noqa: E402

SETTINGS = {"exact": None, "int8": "int8", "bf16x3": "bf16x3"}


def decode_steps(llm: LLM, batch: int, steps: int, prompt_len: int, seed: int) -> tuple[list[float], list[float]]:
    """Seconds of each of `steps` decode steps of `batch` sequences (prompts prefilled first), and the
    seconds a step spent in each of the backend's PHASES (their mean; zeros without the backend)."""
    engine = llm.engine
    g = torch.Generator().manual_seed(seed)
    vocab = min(llm.config.vocab_size, 30000)
    # while the later prompts are prefilled the earlier ones decode, a token a step: each may take what its
    # context leaves, and is aborted once the timed steps are done
    params = SamplingParams(max_tokens=engine.pool_plan.max_model_len - prompt_len, temperature=0, ignore_eos=True)
    ids = [engine.add_request(torch.randint(100, vocab, (prompt_len,), generator=g).tolist(), params)
           for _ in range(batch)]  # fmt: skip
    while engine.num_waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()  # prefill (and the first token)
    decoding = len(engine.scheduler.running)
    if decoding != batch:
        raise SystemExit(f"{decoding} of the {batch} sequences were left to decode after the prompts (the KV pool, or "
                         f"their context): not a step of {batch}")  # fmt: skip
    times = []
    backend = engine.runner.driver.decode_path().backend
    with backend.phase_clock() if backend is not None else contextlib.nullcontext(None) as phases:
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        split = [0.0] * len(PHASES) if phases is None else (phases / steps).tolist()
    if len(engine.scheduler.running) != batch:
        raise SystemExit(f"a sequence ended or was preempted during the timed steps of {batch}: their context is too short")
    for rid in ids:
        engine.abort_request(rid)
    return times, split


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
        # each sequence's prompt, the tokens it decodes while the others' prompts are prefilled (a step's budget
        # of 512 tokens, less the decodes' rows: under prompt_len · B / 128), and the timed steps
        context = max(1024, args.prompt_len + args.prompt_len * max(args.batches) // 128 + args.steps + 8)
        llms = {s: LLM(model, threads=args.threads, activation_quant=SETTINGS[s], max_model_len=context,
                       enable_prefix_caching=False, kv_cache_dtype=args.kv_cache_dtype,
                       max_num_seqs=max(32, *args.batches)) for s in args.settings}  # fmt: skip
        samples = {(s, b): [] for s in args.settings for b in args.batches}
        splits = {(s, b): [] for s in args.settings for b in args.batches}
        roofs: list[tuple[float, float]] = []  # (G MAC/s on the threads, on one) each round
        for r in range(args.rounds):
            roofs.append((mac_rate(args.threads) or 0.0, mac_rate(1) or 0.0))
            for b in args.batches:
                for s in args.settings:
                    times, split = decode_steps(llms[s], b, args.steps, args.prompt_len, seed=r)
                    samples[s, b].append(statistics.median(times))
                    splits[s, b].append(split)
        rows = {}
        for s in args.settings:
            one = statistics.median(samples[s, args.batches[0]])
            for b in args.batches:
                step = statistics.median(samples[s, b])
                # each part's median over the rounds; the rest: the step less the parts of its own round
                part = {name: statistics.median(x[i] for x in splits[s, b]) * 1e3 for i, name in enumerate(PHASES)}
                rest = statistics.median(t - sum(x) for t, x in zip(samples[s, b], splits[s, b])) * 1e3
                rows[f"{s}/{b}"] = {"setting": s, "batch": b, "step_ms": step * 1e3, "tok_s": b / step,
                                    "vs_batch_1": step / one, "products_ms": part["products"] + part["head"],
                                    "head_ms": part["head"], "attention_ms": part["mixer"],
                                    "layer_other_ms": part["layer_other"], "rest_ms": rest,
                                    "weight_format": llms[s].loaded.weight_format}  # fmt: skip
                row = rows[f"{s}/{b}"]
                print(f"{model:>20} {s:>6} B={b:<3} step {row['step_ms']:7.2f} ms  ×{row['vs_batch_1']:.2f} of B=1  "
                      f"{row['tok_s']:7.1f} tok/s  products {row['products_ms']:6.2f} ms (LM head {row['head_ms']:5.2f})  "
                      f"attention {row['attention_ms']:5.2f}  layers' other {row['layer_other_ms']:4.2f}  "
                      f"rest {row['rest_ms']:5.2f} ms", flush=True)  # fmt: skip
        roof, roof_one = (statistics.median(x[i] for x in roofs) for i in range(2))
        results.setdefault("roof_g_mac_s", {})[model] = {"threads": roof, "one": roof_one}
        if "exact" in args.settings and roof:
            macs = sum(llms["exact"].loaded.model.matmul_macs_per_token())
            base = rows[f"exact/{args.batches[0]}"]["step_ms"]
            for b in args.batches:
                floor = b * macs / roof / 1e6  # ms
                row = rows[f"exact/{b}"]
                row["products_floor_ms"] = floor
                print(f"{model:>20}  exact B={b:<3} roof {roof:.0f} G MAC/s ({roof_one:.0f} on one thread): its products "
                      f"take ≥ {floor:.2f} ms, ×{floor / base:.2f} the B=1 step; measured {row['products_ms']:.2f} ms "
                      f"({floor / row['products_ms']:.0%} of the roof's rate)")  # fmt: skip
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
