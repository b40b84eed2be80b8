"""kvlab against llama.cpp on the same GGUF file and the same token ids, in alternating processes.

    bash benchmarks/setup_llamacpp.sh                          # once: the peer, in a venv of its own
    .venv/bin/python benchmarks/bench_llamacpp.py --models smollm2-135m qwen2.5-coder-0.5b --repeat 3

Each round runs one kvlab process and one llama.cpp process per model (the order alternating from
round to round), each measuring, with 2 threads:
  - load: constructing the model from the file (kvlab: its weights and tokenizer; llama.cpp: Llama())
  - decode tok/s after a 64- and a 1,024-token prompt: 32 greedy tokens, timed from the first to the
    last (kvlab: the serving engine, LLMEngine; llama.cpp: eval of one token, argmax of its logits)
  - prefill tok/s at 1,024 tokens: one pass over the prompt (kvlab: one chunk of one request)
  - peak RSS of the process
and, for kvlab, the split of a decode step: ms in the matrix products (kernel calls) and in
everything else (Python, small ops, attention); and for both, the share of the roofline a decode step
after 64 tokens reaches: the weight bytes it reads a token × tok/s ÷ the read bandwidth measured in
kvlab's process of the round (a sum over 1 GiB at the same threads). It prints medians (min–max) and kvlab/llama.cpp
ratios taken round by round (only same-run ratios
mean anything on a shared machine). The prompts are the same ids for both: Python standard-library
source text, tokenized by the GGUF's own vocabulary. Not part of `make test`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VENV = Path(os.environ.get("LLAMACPP_VENV", Path.home() / ".cache/kvlab-bench/llamacpp"))
DECODE_CONTEXTS = (64, 1024)
DECODE_STEPS = 32
PREFILL = 1024


def prompt_ids(model: str, n: int) -> list[int]:
    """n token ids of real text (this Python's own standard library), by the model's tokenizer."""
    import inspect
    import json as json_module

    sys.path.insert(0, str(ROOT))
    from kvlab.hub import resolve_model
    from kvlab.tokenizer import Tokenizer

    text = inspect.getsource(json_module.decoder) + inspect.getsource(json_module.encoder)
    ids = Tokenizer.load(Path(resolve_model(model))).encode(text, add_special_tokens=False)
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---- the two workers: each measures one model in its own process and prints one JSON line -------------


def kvlab_worker(model: str, ids: dict[int, list[int]], threads: int, activation_quant: str | None = None) -> dict:
    sys.path.insert(0, str(ROOT))
    import kvlab  # noqa: F401  (before torch: its OpenMP settings, kvlab/__init__.py)
    import torch

    from kvlab import LLM, SamplingParams
    from kvlab.llm import settle_heap

    torch.set_num_threads(threads)
    t = time.perf_counter()
    llm = LLM(model, threads=threads, max_model_len=2048, max_num_seqs=1, max_num_batched_tokens=2048,
              enable_prefix_caching=False, activation_quant=activation_quant)  # fmt: skip
    settle_heap()  # as kvlab run does after its load
    out = {"load_s": time.perf_counter() - t, "weight_format": llm.loaded.weight_format,
           "weight_bytes": llm.loaded.weight_bytes}  # fmt: skip
    engine = llm.engine

    def run(prompt: list[int], max_tokens: int):
        from kvlab.output.result import RequestOutput

        result = RequestOutput(prompt=None, prompt_token_ids=list(prompt))
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), output=result)
        while engine.has_unfinished_requests:
            engine.step()
        return result

    run(ids[64], 4)  # warm-up: kernels loaded, pages touched
    for context in DECODE_CONTEXTS:
        m = run(ids[context], DECODE_STEPS + 1).metrics
        out[f"decode_{context}_tok_s"] = DECODE_STEPS / m.decode_s
    m = run(ids[PREFILL], 1).metrics
    out["prefill_tok_s"] = PREFILL / m.prefill_compute_s
    out.update(step_split(lambda: run(ids[64], DECODE_STEPS + 1), llm.policy, engine.runner.driver.decode_path().backend))
    out["peak_rss"] = peak_rss()
    out["step_bytes"] = llm.loaded.decode_weight_bytes()  # the weight bytes one decode step reads
    out["bandwidth_GB_s"] = read_bandwidth()
    return out


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """GB/s of a sum over a float32 tensor too big for any cache (every byte read once), at the thread
    count the worker set: the median of `repeats`. After the worker's runs, so its pages don't count."""
    import torch

    x = torch.ones(int(gib * 2**30) // 4)
    x.sum().item()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum().item()
        times.append(time.perf_counter() - t)
    return x.numel() * 4 / statistics.median(times) / 1e9


def step_split(decode, policy, backend) -> dict:
    """ms per decode step and its parts, timed inside the steps as they run (each layer one C call; the
    decode backend's phase clock): the matrix products (the LM head's included), attention (with RoPE
    and the K/V writes), and the rest (norms, residuals, the embedding, sampling: the engine's own work).
    Then the same steps layer by layer from Python, for what the fused step saves."""
    from kvlab.backends.cpu import PHASES

    with backend.phase_clock() if backend is not None else contextlib.nullcontext(None) as phases:
        step_ms = 1000 * decode().metrics.decode_s / DECODE_STEPS
        # decode() timed its decode steps; the prompt's pass is no decode step and ran outside the clock's parts
        part = dict(zip(PHASES, (1000 * phases / DECODE_STEPS).tolist())) if phases is not None else None
    fused, policy.fused_decode = policy.fused_decode, False
    try:
        unfused_ms = 1000 * decode().metrics.decode_s / DECODE_STEPS
    finally:
        policy.fused_decode = fused
    if part is None:  # no decode backend: the parts are not known
        return {"step_ms": step_ms, "unfused_step_ms": unfused_ms}
    products = part["products"] + part["head"]
    return {"step_ms": step_ms, "products_ms": products, "attention_ms": part["mixer"],
            "rest_ms": step_ms - products - part["mixer"], "unfused_step_ms": unfused_ms}  # fmt: skip


def llamacpp_worker(model: str, ids: dict[int, list[int]], threads: int) -> dict:
    import numpy as np
    from llama_cpp import Llama

    sys.path.insert(0, str(ROOT))
    path = _model_path(model)
    t = time.perf_counter()
    llm = Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=2048, n_batch=1024,
                n_ubatch=512, logits_all=False, verbose=False)  # fmt: skip
    out = {"load_s": time.perf_counter() - t}
    vocab = llm.n_vocab()

    def last_logits():  # the logits of the last evaluated token (llama.cpp computes only those here)
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))

    def decode(prompt: list[int], steps: int) -> float:
        llm.reset()
        llm.eval(prompt)
        token = int(np.argmax(last_logits()))
        stamps = []
        for _ in range(steps):
            llm.eval([token])
            token = int(np.argmax(last_logits()))
            stamps.append(time.perf_counter())
        return (len(stamps) - 1) / (stamps[-1] - stamps[0])

    decode(ids[64], 4)  # warm-up
    for context in DECODE_CONTEXTS:
        out[f"decode_{context}_tok_s"] = decode(ids[context], DECODE_STEPS + 1)
    llm.reset()
    t = time.perf_counter()
    llm.eval(ids[PREFILL])
    int(np.argmax(last_logits()))
    out["prefill_tok_s"] = PREFILL / (time.perf_counter() - t)
    out["peak_rss"] = peak_rss()
    return out


def _model_path(model: str) -> Path:
    from kvlab.hub import resolve_model

    return Path(resolve_model(model))


# ---- the orchestrator ---------------------------------------------------------------------------------


def spawn(engine: str, model: str, ids_file: Path, threads: int, venv: Path, activation_quant: str | None = None) -> dict:
    python = sys.executable if engine == "kvlab" else str(venv / "bin" / "python")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}
    cmd = [python, __file__, "--worker", engine, "--models", model, "--ids", str(ids_file), "--threads", str(threads)]
    if activation_quant and engine == "kvlab":
        cmd += ["--activation-quant", activation_quant]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{engine} worker on {model} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summary(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "samples": xs}


FIGURES = ("decode_64_tok_s", "decode_1024_tok_s", "prefill_tok_s", "load_s", "peak_rss")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma3-270m"])
    ap.add_argument("--repeat", type=int, default=3, help="rounds (one process of each engine per model each)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="llama-cpp-python's venv (setup_llamacpp.sh)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--activation-quant", choices=["int8"], help="kvlab's 8-bit activations (as llama.cpp does; "
                    "not exact, see kvlab quality); default: kvlab's exact products")  # fmt: skip
    ap.add_argument("--worker", choices=["kvlab", "llamacpp"], help=argparse.SUPPRESS)
    ap.add_argument("--ids", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        ids = {int(k): v for k, v in json.loads(Path(args.ids).read_text()).items()}
        if args.worker == "kvlab":
            print(json.dumps(kvlab_worker(args.models[0], ids, args.threads, args.activation_quant)))
        else:
            print(json.dumps(llamacpp_worker(args.models[0], ids, args.threads)))
        return 0
    if not (args.venv / "bin" / "python").exists():
        raise SystemExit(f"no llama-cpp-python in {args.venv}: run bash benchmarks/setup_llamacpp.sh first")
    sys.path.insert(0, str(ROOT))
    from kvlab.errors import KvlabError
    from kvlab.hub import resolve_model

    try:  # every model pulled before the first round, not a traceback after the first models' rounds
        for model in args.models:
            resolve_model(model)
    except KvlabError as e:
        print(f"bench_llamacpp: {e} (or leave it out of --models)", file=sys.stderr)
        return 2
    import tempfile

    results = {"command": " ".join(sys.argv), "threads": args.threads, "activation_quant": args.activation_quant,
               "models": {}}
    for model in args.models:
        ids = {n: prompt_ids(model, n) for n in sorted({*DECODE_CONTEXTS, PREFILL})}
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(ids, f)
        runs = {"kvlab": [], "llamacpp": []}
        for r in range(args.repeat):
            order = ("kvlab", "llamacpp") if r % 2 == 0 else ("llamacpp", "kvlab")
            for engine in order:
                runs[engine].append(spawn(engine, model, Path(f.name), args.threads, args.venv, args.activation_quant))
                print(f"  {model} round {r + 1} {engine}: " + ", ".join(
                    f"{k} {runs[engine][-1][k]:.3g}" for k in FIGURES), flush=True)  # fmt: skip
        os.unlink(f.name)
        entry = {e: {k: summary([run[k] for run in runs[e]]) for k in FIGURES} for e in runs}
        entry["ratio"] = {k: summary([a[k] / b[k] for a, b in zip(runs["kvlab"], runs["llamacpp"])]) for k in FIGURES}
        entry["kvlab_weights"] = {"format": runs["kvlab"][0]["weight_format"], "bytes": runs["kvlab"][0]["weight_bytes"]}
        entry["kvlab_step"] = {k: summary([run[k] for run in runs["kvlab"]])
                               for k in ("step_ms", "products_ms", "attention_ms", "rest_ms", "unfused_step_ms")
                               if k in runs["kvlab"][0]}  # fmt: skip
        entry["roofline"] = roofline(runs)
        results["models"][model] = entry
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def roofline(runs: dict) -> dict:
    """The share of the measured read bandwidth a decode step after 64 tokens reaches, for each engine's
    runs: the weight bytes it reads (kvlab's count: the same GGUF blocks for both, a mixture's chosen
    experts only) × tokens/s ÷ GB/s (measured in kvlab's process of the round)."""
    step_bytes = runs["kvlab"][0]["step_bytes"]
    out = {"step_bytes": step_bytes, "bandwidth_GB_s": summary([run["bandwidth_GB_s"] for run in runs["kvlab"]])}
    for engine in ("kvlab", "llamacpp"):
        out[f"{engine}_share"] = summary([step_bytes * run["decode_64_tok_s"] / 1e9 / k["bandwidth_GB_s"]
                                          for run, k in zip(runs[engine], runs["kvlab"])])  # fmt: skip
    return out


def print_table(results: dict) -> None:
    for model, e in results["models"].items():
        print(f"\n{model}: kvlab {e['kvlab_weights']['format']} ({e['kvlab_weights']['bytes'] / 1e6:.1f} MB) vs "
              f"llama.cpp, {results['threads']} threads; medians (min–max) of {len(e['ratio']['load_s']['samples'])}")
        print(f"{'':20s} {'kvlab':>24s} {'llama.cpp':>24s} {'kvlab / llama.cpp':>22s}")
        for k in FIGURES:
            scale, unit = (1e-6, "MB") if k == "peak_rss" else (1, "")

            def cell(d):
                return f"{d['median'] * scale:8.2f} ({d['min'] * scale:.2f}–{d['max'] * scale:.2f}){unit}"

            r = e["ratio"][k]
            print(f"{k:20s} {cell(e['kvlab'][k]):>24s} {cell(e['llamacpp'][k]):>24s} "
                  f"{r['median']:8.2f}× ({r['min']:.2f}–{r['max']:.2f})")  # fmt: skip
        split = {k: v["median"] for k, v in e["kvlab_step"].items()}
        parts = (f" = {split['products_ms']:.2f} ms in the matrix products + {split['attention_ms']:.2f} ms attention "
                 f"+ {split['rest_ms']:.2f} ms everything else" if "products_ms" in split else "")  # fmt: skip
        print(f"kvlab decode step after 64 tokens: {split['step_ms']:.2f} ms{parts} (layer by layer from Python: "
              f"{split['unfused_step_ms']:.2f} ms)")  # fmt: skip
        roof = e["roofline"]
        print(f"decode after 64 tokens reads {roof['step_bytes'] / 1e6:.1f} MB of weights a token; read bandwidth "
              f"measured {roof['bandwidth_GB_s']['median']:.1f} GB/s: kvlab reaches "
              f"{100 * roof['kvlab_share']['median']:.0f}% of that roofline, llama.cpp "
              f"{100 * roof['llamacpp_share']['median']:.0f}%")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
