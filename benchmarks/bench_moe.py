"""kvlab against llama.cpp on a mixture-of-experts file of Qwen3-30B-A3B's layer shape, and on its dense twin.

    bash benchmarks/setup_llamacpp.sh                 # once: the peer, in a venv of its own
    .venv/bin/python benchmarks/bench_moe.py --layers 4 --repeat 3

The files are written by this benchmark (kvlab/lab/moe_gguf.py): random Q4_0 blocks — THE VALUES ARE NOISE;
the bytes and shapes are a real model's (hidden 2048, 128 experts of width 768, 8 active, GQA 32/4 of 128,
q/k norms), `--layers` of its 48 layers and a `--vocab`-token head (8,192 by default, so that the layers
weigh what they weigh in the real model rather than the head), and a decode step's speed does not depend on
the values. The dense twin has the same attention and one dense MLP as wide as the 8 active experts
(6,144): the same active parameters per token.

Each round runs benchmarks/bench_llamacpp.py's two workers (same file, same token ids, alternating
processes, 2 threads by default): decode tok/s after 64 and 1,024 tokens, prefill tok/s at 1,024, load,
peak RSS; and kvlab's decode at 16 sequences (one step = one token of each; kvlab's engine only — the
llama.cpp peer's Python binding decodes one sequence). It prints medians (min–max) and kvlab/llama.cpp
ratios round by round, and for kvlab the weight bytes a decode step reads (attention, the 8 chosen
experts, the head) beside the file's total. Not part of `make test`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))

import bench_llamacpp as peer  # noqa: E402  (its workers and its process handling)

CACHE = Path(os.environ.get("KVLAB_BENCH_CACHE", Path.home() / ".cache/kvlab-bench")) / "moe"
BATCH = 16
FIGURES = peer.FIGURES


def write_files(layers: int, vocab: int) -> dict[str, Path]:
    """The MoE file and its dense twin (written once per shape, kept in CACHE)."""
    from kvlab.lab.moe_gguf import QWEN3_30B_A3B, dense_twin, write_random_gguf

    moe = dataclasses.replace(QWEN3_30B_A3B, layers=layers, vocab=vocab)
    files = {}
    for label, shape in (("moe", moe), ("dense", dense_twin(moe))):
        path = CACHE / f"{label}-a3b-shape-{layers}L-{vocab}v-q4_0.gguf"
        if not path.exists():
            CACHE.mkdir(parents=True, exist_ok=True)
            t = time.perf_counter()
            write_random_gguf(shape, path.with_suffix(".tmp"), "Q4_0")
            path.with_suffix(".tmp").rename(path)
            print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB, {time.perf_counter() - t:.0f} s)", flush=True)
        files[label] = path
    return files


def batch_worker(model: str, threads: int, activation_quant: str | None = None) -> dict:
    """kvlab's decode at BATCH sequences after 64-token prompts: seconds per step (a token of each)."""
    import torch

    from kvlab import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(model, threads=threads, max_model_len=512, max_num_seqs=BATCH, max_num_batched_tokens=1024,
              enable_prefix_caching=False, activation_quant=activation_quant)  # fmt: skip
    engine, steps = llm.engine, peer.DECODE_STEPS
    g = torch.Generator().manual_seed(BATCH)
    for _ in range(BATCH):
        prompt = torch.randint(0, 256, (64,), generator=g).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True))
    started: set[str] = set()
    while len(started) < BATCH:
        started |= {o.request_id for o in engine.step() if o.output.token_ids}
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    step_s = (time.perf_counter() - t) / steps
    return {f"decode_b{BATCH}_tok_s": BATCH / step_s, "decode_read_bytes": llm.loaded.decode_weight_bytes(),
            "weight_bytes": llm.loaded.weight_bytes}  # fmt: skip


def spawn_batch(model: Path, threads: int, activation_quant: str | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, __file__, "--batch-worker", str(model), "--threads", str(threads)]
    if activation_quant:
        cmd += ["--activation-quant", activation_quant]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"kvlab batch worker on {model} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summary(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "samples": xs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the 48 of Qwen3-30B-A3B (default 4)")
    ap.add_argument("--vocab", type=int, default=8192, help="vocabulary rows of the embedding and head (default 8192)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--venv", type=Path, default=peer.DEFAULT_VENV, help="llama-cpp-python's venv")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--activation-quant", choices=["int8"], help="kvlab's 8-bit activations (as llama.cpp does; "
                    "not exact, see kvlab quality); default: kvlab's exact products")  # fmt: skip
    ap.add_argument("--batch-worker", help=argparse.SUPPRESS)
    ap.add_argument("--write-files", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.batch_worker:
        print(json.dumps(batch_worker(args.batch_worker, args.threads, args.activation_quant)))
        return 0
    if args.write_files:
        write_files(args.layers, args.vocab)
        return 0
    if not (args.venv / "bin" / "python").exists():
        raise SystemExit(f"no llama-cpp-python in {args.venv}: run bash benchmarks/setup_llamacpp.sh first")
    # written in a process of its own: the writer holds a file's tensors, and a child's peak RSS (ru_maxrss)
    # starts from its parent's, so the workers spawned after would report it as their own
    subprocess.run([sys.executable, __file__, "--write-files", "--layers", str(args.layers), "--vocab", str(args.vocab)],
                   check=True)  # fmt: skip
    files = write_files(args.layers, args.vocab)  # already there: only their paths
    g = __import__("random").Random(0)
    ids = {n: [g.randrange(256) for _ in range(n)] for n in sorted({*peer.DECODE_CONTEXTS, peer.PREFILL})}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(ids, f)
    results = {"command": " ".join(sys.argv), "threads": args.threads, "layers": args.layers, "vocab": args.vocab,
               "activation_quant": args.activation_quant,
               "note": "random Q4_0 blocks: the values are noise; bytes and shapes are Qwen3-30B-A3B's", "files": {}}  # fmt: skip
    for label, path in files.items():
        runs = {"kvlab": [], "llamacpp": [], "batch": []}
        for r in range(args.repeat):
            order = ("kvlab", "llamacpp") if r % 2 == 0 else ("llamacpp", "kvlab")
            for engine in order:
                runs[engine].append(peer.spawn(engine, str(path), Path(f.name), args.threads, args.venv,
                                               args.activation_quant))  # fmt: skip
                print(f"  {label} round {r + 1} {engine}: " + ", ".join(
                    f"{k} {runs[engine][-1][k]:.3g}" for k in FIGURES), flush=True)  # fmt: skip
            runs["batch"].append(spawn_batch(path, args.threads, args.activation_quant))
            print(f"  {label} round {r + 1} kvlab batch {BATCH}: {runs['batch'][-1][f'decode_b{BATCH}_tok_s']:.3g} tok/s",
                  flush=True)  # fmt: skip
        entry = {e: {k: summary([run[k] for run in runs[e]]) for k in FIGURES} for e in ("kvlab", "llamacpp")}
        entry["ratio"] = {k: summary([a[k] / b[k] for a, b in zip(runs["kvlab"], runs["llamacpp"])]) for k in FIGURES}
        entry["kvlab_batch"] = summary([b[f"decode_b{BATCH}_tok_s"] for b in runs["batch"]])
        entry["bytes"] = {k: runs["batch"][0][k] for k in ("decode_read_bytes", "weight_bytes")}
        entry["kvlab_weights"] = {"format": runs["kvlab"][0]["weight_format"], "bytes": runs["kvlab"][0]["weight_bytes"]}
        entry["kvlab_step"] = {k: summary([run[k] for run in runs["kvlab"]])
                               for k in ("step_ms", "products_ms", "rest_ms", "unfused_step_ms")}  # fmt: skip
        entry["roofline"] = peer.roofline(runs)
        results["files"][label] = entry
    os.unlink(f.name)
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def print_table(results: dict) -> None:
    print(f"\nrandom Q4_0 blocks of Qwen3-30B-A3B's layer shape, {results['layers']} layers, vocab {results['vocab']} "
          "(the values are noise; the bytes and shapes are the model's)")  # fmt: skip
    peer.print_table({"threads": results["threads"], "models": results["files"]})
    for label, e in results["files"].items():
        b = e["bytes"]
        print(f"{label}: kvlab decode at {BATCH} sequences {e['kvlab_batch']['median']:.2f} tok/s "
              f"({e['kvlab_batch']['min']:.2f}–{e['kvlab_batch']['max']:.2f}); a 1-sequence step reads "
              f"{b['decode_read_bytes'] / 1e6:.1f} MB of {b['weight_bytes'] / 1e6:.1f} MB of weights")  # fmt: skip
    moe, dense = results["files"]["moe"], results["files"]["dense"]
    for k in ("decode_64_tok_s", "prefill_tok_s"):
        print(f"MoE / dense twin, {k}: kvlab {moe['kvlab'][k]['median'] / dense['kvlab'][k]['median']:.2f}×, "
              f"llama.cpp {moe['llamacpp'][k]['median'] / dense['llamacpp'][k]['median']:.2f}×")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
