"""Peak memory (resident set) of kvlab against llama.cpp on the same GGUF file and context.

    bash benchmarks/setup_llamacpp.sh                           # once: the llama.cpp peer
    .venv/bin/python benchmarks/bench_rss.py --models smollm2-135m qwen2.5-coder-0.5b --repeat 2

Each figure is the peak RSS of one process, from the kernel (os.wait4's ru_maxrss, so nothing is
missed between samples), with 2 threads and a context of --context tokens:
  - run    kvlab: `kvlab run MODEL PROMPT --max-tokens 64 --max-model-len C` (the CLI as a person runs it)
           llama.cpp: Llama(MODEL, n_ctx=C), the same prompt, 64 greedy tokens
  - serve  kvlab: `kvlab serve MODEL --max-model-len C` while 16 requests × (64 in, 64 out) run at once
           (kvlab's load generator, random token ids, greedy, ignore_eos), then stopped
           llama.cpp: the same 16 × (64 in, 64 out) decoded together in one context of C tokens
           (llama.cpp's multi-sequence batch API, n_seq_max 16, one unified KV cache: llama-server's way)
and with --breakdown, what a kvlab process holds after each stage of `kvlab run` (import torch, import
kvlab, load the model, the tokenizer, the engine, 64 tokens generated), split into anonymous memory
and file pages (the GGUF's weights are mapped from the file, so they count once, as file pages), with
the largest mappings. Not part of `make test`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VENV = Path(os.environ.get("LLAMACPP_VENV", Path.home() / ".cache/kvlab-bench/llamacpp"))
PROMPT = ("The history of computing is a story of machines that got smaller, faster and cheaper, and of the "
          "people who learned to use them. Write a short essay about one of those people, and say why")  # fmt: skip
MAX_TOKENS = 64
SERVE = (16, 64, 64)  # requests × (prompt tokens, output tokens)


def status(pid: int | str = "self") -> dict:
    """VmRSS, VmHWM, RssAnon, RssFile of a process, in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


def measured(cmd: list[str], env: dict, log: Path, during=None) -> dict:
    """Run `cmd` to its end (or, with `during`, until during(proc) has done its work and stopped it):
    its peak RSS from the kernel, and how long it ran.

    Linux carries a process's peak across exec (the mm it execs from counts), so a child's ru_maxrss is at
    least this process's own peak when it spawned the child: this orchestrator stays small (no torch, about
    30 MB); `spawner_peak_rss` records it, and a figure not above it would say nothing."""
    spawner = status()["VmHWM"]
    t = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        extra = {}
        try:
            if during is not None:
                extra = during(proc) or {}
        finally:
            if proc.poll() is None and during is not None:
                proc.send_signal(signal.SIGTERM)
            _, code, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(code)
    ok = proc.returncode == 0 or (during is not None and proc.returncode in (-signal.SIGTERM, 128 + signal.SIGTERM))
    if not ok:
        raise SystemExit(f"{' '.join(cmd[:6])} … failed ({proc.returncode}):\n{log.read_text()[-3000:]}")
    peak = usage.ru_maxrss * 1024
    if peak <= spawner:
        print(f"warning: {cmd[0]}'s peak RSS is no more than its spawner's ({spawner / 1e6:.0f} MB): not measured")
    return {"peak_rss": peak, "spawner_peak_rss": spawner, "wall_s": time.perf_counter() - t, **extra}


# ---- kvlab ------------------------------------------------------------------------------------------------


def kvlab_env(threads: int) -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}


def kvlab_run(model: str, args, log_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "kvlab", "run", model, PROMPT, "--max-tokens", str(MAX_TOKENS), "--max-model-len",
           str(args.context), "--threads", str(args.threads), "--temperature", "0", "--ignore-eos"]  # fmt: skip
    return measured(cmd, kvlab_env(args.threads), log_dir / f"kvlab-run-{model}.log")


def kvlab_serve(model: str, args, log_dir: Path) -> dict:
    from socket import socket

    with socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "kvlab", "serve", model, "--port", str(port), "--max-model-len", str(args.context),
           "--threads", str(args.threads)]  # fmt: skip
    url = f"http://127.0.0.1:{port}"

    def load(proc) -> dict:
        import httpx

        sys.path.insert(0, str(ROOT))
        from kvlab.bench.serve import Workload, run_http

        deadline = time.time() + 300
        while time.time() < deadline:
            if proc.poll() is not None:
                return {}
            try:
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        idle = status(proc.pid)
        n, n_in, n_out = SERVE
        result = run_http(url, Workload(n, n, n_in, n_out, seed=7)).summary()
        busy = status(proc.pid)
        return {"rss_ready": idle["VmRSS"], "rss_after_load": busy["VmRSS"], "output_tok_s": result["output_tok_s"],
                "completed": result["completed"]}  # fmt: skip

    return measured(cmd, kvlab_env(args.threads), log_dir / f"kvlab-serve-{model}.log", during=load)


# ---- llama.cpp: the workers run in its venv -------------------------------------------------------------


def llamacpp_run_worker(path: str, context: int, threads: int) -> dict:
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=context, n_threads=threads, n_threads_batch=threads, verbose=False)
    tokens = llm.tokenize(PROMPT.encode(), add_bos=True)
    out = []
    for token in llm.generate(tokens, top_k=1, temp=0.0, reset=True):  # greedy; EOS is not checked here
        out.append(token)
        if len(out) == MAX_TOKENS:
            break
    return {"prompt_tokens": len(tokens), "generated": len(out)}


def llamacpp_serve_worker(path: str, context: int, threads: int) -> dict:
    """SERVE's requests decoded together in one context: prompts in batches of whole prompts, then one
    batch of one token per sequence per step, greedy (llama-server's slots do the same)."""
    import ctypes
    import random

    import llama_cpp as L
    import numpy as np
    from llama_cpp._internals import LlamaContext, LlamaModel

    n, n_in, n_out = SERVE
    model = LlamaModel(path_model=path, params=L.llama_model_default_params(), verbose=False)
    params = L.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = context, 512, 512, n
    params.n_threads = params.n_threads_batch = threads
    params.kv_unified = True
    ctx = LlamaContext(model=model, params=params, verbose=False)
    vocab = model.n_vocab()
    batch = L.llama_batch_init(512, 0, 1)
    rng = random.Random(7)
    prompts = [[rng.randrange(100, min(vocab, 32000) - 100) for _ in range(n_in)] for _ in range(n)]

    def submit(items):  # (token, position, sequence, wants logits)
        batch.n_tokens = len(items)
        for i, (tok, pos, seq, logits) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, logits
        if L.llama_decode(ctx.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def argmax(i: int) -> int:
        ptr = L.llama_get_logits_ith(ctx.ctx, i)
        return int(np.argmax(np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(vocab,))))

    last = [0] * n
    per_batch = 512 // n_in
    for start in range(0, n, per_batch):
        seqs = range(start, min(start + per_batch, n))
        submit([(t, p, s, p == n_in - 1) for s in seqs for p, t in enumerate(prompts[s])])
        for k, s in enumerate(seqs):
            last[s] = argmax(k * n_in + n_in - 1)
    t = time.perf_counter()
    for step in range(n_out - 1):
        submit([(last[s], n_in + step, s, True) for s in range(n)])
        last = [argmax(s) for s in range(n)]
    decode_s = time.perf_counter() - t
    L.llama_batch_free(batch)
    return {"decode_tok_s": n * (n_out - 1) / decode_s}


def llamacpp(kind: str, model: str, args, log_dir: Path) -> dict:
    path = str(model_path(model))
    cmd = [str(args.venv / "bin" / "python"), __file__, "--worker", kind, "--path", path, "--context", str(args.context),
           "--threads", str(args.threads)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    env.pop("PYTHONPATH", None)
    out = measured(cmd, env, log_dir / f"llamacpp-{kind}-{model}.log")
    lines = (log_dir / f"llamacpp-{kind}-{model}.log").read_text().strip().splitlines()
    out.update(json.loads(next(x for x in reversed(lines) if x.startswith("{"))))  # llama.cpp logs after it
    return out


def model_path(model: str) -> Path:
    sys.path.insert(0, str(ROOT))
    from kvlab.hub import resolve_model

    return Path(resolve_model(model))


# ---- what a kvlab process holds, stage by stage ---------------------------------------------------------


BREAKDOWN = r"""
import gc, json, sys, time
from pathlib import Path

def status():
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out

stages = []
def stage(label):
    stages.append({"stage": label, **status(), "modules": len(sys.modules)})

model, context, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
stage("python")
import numpy
stage("import numpy")
import torch
torch.set_num_threads(threads)
stage("import torch")
from kvlab.config import EngineConfig
from kvlab.engine import LLMEngine
from kvlab.kernels import ThreadPolicy
from kvlab.model.loader import load_model
from kvlab.sampling import SamplingParams
from kvlab.tokenizer import load_tokenizer
stage("import kvlab (engine, loader, tokenizer)")
loaded = load_model(model)
stage("load the model")
tokenizer = load_tokenizer(loaded)
stage("load the tokenizer")
engine = LLMEngine(loaded, tokenizer, EngineConfig(max_model_len=context), policy=ThreadPolicy(threads=threads))
stage("build the engine (KV pool reserved, not touched)")
engine.add_request(tokenizer.encode(sys.argv[4]), SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
while engine.has_unfinished_requests:
    engine.step()
stage("64 tokens generated")
# the GGUF parse's metadata (the tokenizer's vocabulary as Python objects): what LLM() lets go once its tokenizer
# and engine are built (this script builds them itself, so it drops it here)
held = getattr(loaded, "gguf", None)
if held is not None:
    loaded.gguf = None
    del held
    gc.collect()
    stage("without the GGUF parse (as LLM() drops it)")
rope = [m for m in loaded.model.modules() if hasattr(m, "cos") and isinstance(getattr(m, "cos"), torch.Tensor)]
rope_bytes = sum(m.cos.nbytes + m.sin.nbytes for m in rope)
maps = {}
name = None
for line in Path("/proc/self/smaps").read_text().splitlines():
    parts = line.split()
    if parts and "-" in parts[0] and len(parts) >= 5 and parts[0][0] in "0123456789abcdef":
        name = parts[5] if len(parts) > 5 else "[anonymous]"
    elif parts and parts[0] == "Rss:":
        maps[name] = maps.get(name, 0) + int(parts[1]) * 1024
top = sorted(maps.items(), key=lambda kv: -kv[1])[:12]
print(json.dumps({"stages": stages, "rope_table_bytes": rope_bytes, "top_mappings": top}))
"""


def breakdown(model: str, args, log_dir: Path) -> dict:
    cmd = [sys.executable, "-c", BREAKDOWN, model, str(args.context), str(args.threads), PROMPT]
    log = log_dir / f"kvlab-breakdown-{model}.log"
    out = measured(cmd, kvlab_env(args.threads), log)
    out.update(json.loads(next(x for x in reversed(log.read_text().strip().splitlines()) if x.startswith("{"))))
    return out


# ---- the orchestrator -----------------------------------------------------------------------------------


def mb(x: float) -> str:
    return f"{x / 1e6:.0f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-0.5b"])
    ap.add_argument("--context", type=int, default=2048, help="kvlab's --max-model-len, llama.cpp's n_ctx")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1, help="processes of each kind (peak RSS barely varies)")
    ap.add_argument("--skip", action="append", default=[], choices=["run", "serve", "breakdown", "llamacpp"])
    ap.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="llama-cpp-python's venv (setup_llamacpp.sh)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--worker", choices=["run", "serve"], help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker = llamacpp_run_worker if args.worker == "run" else llamacpp_serve_worker
        print(json.dumps(worker(args.path, args.context, args.threads)))
        return 0
    peer = "llamacpp" not in args.skip
    if peer and not (args.venv / "bin" / "python").exists():
        raise SystemExit(f"no llama-cpp-python in {args.venv}: run bash benchmarks/setup_llamacpp.sh (or --skip llamacpp)")
    log_dir = Path(tempfile.mkdtemp(prefix="bench-rss-"))
    results = {"command": " ".join(sys.argv), "context": args.context, "threads": args.threads, "models": {}}
    for model in args.models:
        entry: dict = {"file_bytes": model_path(model).stat().st_size}
        for kind, fn in (("run", kvlab_run), ("serve", kvlab_serve)):
            if kind in args.skip:
                continue
            for r in range(args.repeat):
                entry.setdefault(f"kvlab_{kind}", []).append(fn(model, args, log_dir))
                if peer:
                    entry.setdefault(f"llamacpp_{kind}", []).append(llamacpp(kind, model, args, log_dir))
                print(f"  {model} {kind} {r + 1}: kvlab {mb(entry[f'kvlab_{kind}'][-1]['peak_rss'])} MB"
                      + (f", llama.cpp {mb(entry[f'llamacpp_{kind}'][-1]['peak_rss'])} MB" if peer else ""), flush=True)  # fmt: skip
        if "breakdown" not in args.skip:
            entry["breakdown"] = breakdown(model, args, log_dir)
        results["models"][model] = entry
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def print_table(results: dict) -> None:
    print(f"\npeak RSS (MB), {results['threads']} threads, context {results['context']:,} tokens; median of the processes")
    print(f"{'model':22s} {'what':6s} {'kvlab':>8s} {'llama.cpp':>10s} {'kvlab − llama.cpp':>18s} {'kvlab ÷ llama.cpp':>18s}")
    for model, e in results["models"].items():
        for kind in ("run", "serve"):
            if f"kvlab_{kind}" not in e:
                continue
            k = statistics.median(x["peak_rss"] for x in e[f"kvlab_{kind}"])
            peer = e.get(f"llamacpp_{kind}")
            l_ = statistics.median(x["peak_rss"] for x in peer) if peer else None
            print(f"{model:22s} {kind:6s} {mb(k):>8s} {mb(l_) if l_ else '–':>10s} "
                  f"{mb(k - l_) if l_ else '–':>18s} {f'{k / l_:.2f}×' if l_ else '–':>18s}")  # fmt: skip
        b = e.get("breakdown")
        if b:
            print(f"\n{model}: a kvlab process stage by stage (MB: resident, of it anonymous / file pages; peak so far)")
            prev = 0
            for s in b["stages"]:
                print(f"  {s['stage']:48s} {mb(s['VmRSS']):>6s} (+{mb(s['VmRSS'] - prev):>4s})  anon {mb(s['RssAnon']):>5s}"
                      f"  file {mb(s['RssFile']):>5s}  peak {mb(s['VmHWM']):>5s}  {s['modules']} modules")  # fmt: skip
                prev = s["VmRSS"]
            print(f"  RoPE tables (cos, sin): {mb(b['rope_table_bytes'])} MB; largest mappings: "
                  + ", ".join(f"{Path(n).name} {mb(v)}" for n, v in b["top_mappings"][:6]))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
