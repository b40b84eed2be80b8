"""kvlab against llama.cpp on a hybrid file of Qwen3.5-9B's layer shape (Gated DeltaNet + gated attention).

    bash benchmarks/setup_llamacpp.sh                 # once: the peer, in a venv of its own
    .venv/bin/python benchmarks/bench_hybrid.py --layers 4 --repeat 1

The file is written here: random Q4_0 blocks — THE VALUES ARE NOISE; the bytes and shapes are Qwen3.5-9B's
(kvlab/configs/qwen3.5-9b.json: hidden 4096; Gated DeltaNet with 16 key heads and 32 value heads of 128, conv
of 4; gated attention with 16/4 heads of 256, a quarter rotated; MLP 12,288), `--layers` of its 32 layers in
its own pattern (three Gated DeltaNet layers, then one attention layer), and a `--vocab`-token head (8,192).
A decode step's speed does not depend on the values. Each round runs benchmarks/bench_llamacpp.py's two
workers (same file, same token ids): decode tok/s after 64 and 1,024 tokens, prefill tok/s at 1,024, load, peak
RSS. It prints medians (min–max), the ratio, and the constant state one sequence holds (kvlab's state pool
slot; llama.cpp keeps the same numbers in float32). Not part of `make test`.
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

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))

import bench_llamacpp as peer  # noqa: E402  (its workers and its process handling)

CACHE = Path(os.environ.get("KVLAB_BENCH_CACHE", Path.home() / ".cache/kvlab-bench")) / "hybrid"
E, FFN, HEADS, KV_HEADS, HEAD_DIM, ROTARY = 4096, 12288, 16, 4, 256, 64
HK, HV, DK, DV, KERNEL, INTERVAL = 16, 32, 128, 128, 4, 4


def write_file(layers: int, vocab: int, seed: int = 0) -> Path:
    """Qwen3.5-9B's first `layers` layers as random Q4_0 blocks (norms 1, conv taps and A, dt small, F32)."""
    import gguf

    from kvlab.lab.moe_gguf import _random_blocks, _vocabulary

    path = CACHE / f"qwen35-9b-shape-{layers}L-{vocab}v-q4_0.gguf"
    if path.exists():
        return path
    CACHE.mkdir(parents=True, exist_ok=True)
    rng, qtype = np.random.default_rng(seed), gguf.GGMLQuantizationType.Q4_0
    w = gguf.GGUFWriter(str(path.with_suffix(".tmp")), "qwen35")
    for add, value in ((w.add_block_count, layers), (w.add_context_length, 4096), (w.add_embedding_length, E),
                       (w.add_feed_forward_length, FFN), (w.add_head_count, HEADS), (w.add_head_count_kv, KV_HEADS),
                       (w.add_key_length, HEAD_DIM), (w.add_value_length, HEAD_DIM), (w.add_layer_norm_rms_eps, 1e-6),
                       (w.add_rope_freq_base, 1e7), (w.add_rope_dimension_count, ROTARY),
                       (w.add_rope_dimension_sections, [11, 11, 10, 0]), (w.add_ssm_conv_kernel, KERNEL),
                       (w.add_ssm_state_size, DK), (w.add_ssm_group_count, HK), (w.add_ssm_time_step_rank, HV),
                       (w.add_ssm_inner_size, HV * DV), (w.add_full_attention_interval, INTERVAL)):  # fmt: skip
        add(value)
    _vocabulary(w, vocab)

    def matrix(name: str, rows: int, cols: int) -> None:
        w.add_tensor(name, _random_blocks(rng, qtype, (rows,), cols), raw_dtype=qtype)

    def vector(name: str, values: np.ndarray) -> None:
        w.add_tensor(name, np.ascontiguousarray(values, dtype=np.float32))

    matrix("token_embd.weight", vocab, E)
    vector("output_norm.weight", np.ones(E))
    matrix("output.weight", vocab, E)
    conv = 2 * HK * DK + HV * DV
    for i in range(layers):
        b = f"blk.{i}."
        vector(b + "attn_norm.weight", np.ones(E))
        vector(b + "post_attention_norm.weight", np.ones(E))
        if (i + 1) % INTERVAL:  # Gated DeltaNet
            matrix(b + "attn_qkv.weight", conv, E)
            matrix(b + "attn_gate.weight", HV * DV, E)
            matrix(b + "ssm_beta.weight", HV, E)
            matrix(b + "ssm_alpha.weight", HV, E)
            vector(b + "ssm_conv1d.weight", rng.standard_normal((conv, KERNEL)) * 0.1)
            vector(b + "ssm_dt.bias", np.ones(HV))
            vector(b + "ssm_a", -rng.uniform(0.01, 16, HV))
            vector(b + "ssm_norm.weight", np.ones(DV))
            matrix(b + "ssm_out.weight", E, HV * DV)
        else:  # gated attention: attn_q holds a query and a gate per head
            vector(b + "attn_q_norm.weight", np.ones(HEAD_DIM))
            vector(b + "attn_k_norm.weight", np.ones(HEAD_DIM))
            matrix(b + "attn_q.weight", 2 * HEADS * HEAD_DIM, E)
            matrix(b + "attn_k.weight", KV_HEADS * HEAD_DIM, E)
            matrix(b + "attn_v.weight", KV_HEADS * HEAD_DIM, E)
            matrix(b + "attn_output.weight", E, HEADS * HEAD_DIM)
        matrix(b + "ffn_gate.weight", FFN, E)
        matrix(b + "ffn_up.weight", FFN, E)
        matrix(b + "ffn_down.weight", E, FFN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    path.with_suffix(".tmp").rename(path)
    return path


def state_bytes(path: Path) -> int:
    from kvlab.config import load_config
    from kvlab.memory.kv import state_bytes as calculator

    return calculator(load_config(path))


def prefix_choice(layers: int, prefill_tok_s: float, block_size: int = 16) -> dict:
    """What prefix caching for a hybrid would cost (state snapshots at block boundaries, vLLM's way) against
    what leaving it off costs (each request recomputes the shared prefix), for the whole Qwen3.5-9B: the
    snapshot's bytes from the calculator, the recompute time from this run's prefill rate at `layers`
    layers scaled to all of them (a prompt's time grows with the layers it runs through)."""
    from kvlab.config import load_config
    from kvlab.memory.kv import kv_bytes_per_token
    from kvlab.memory.kv import state_bytes as calculator

    config = load_config("qwen3.5-9b")
    snapshot, block_kv = calculator(config, state_dtype="bfloat16"), kv_bytes_per_token(config) * block_size
    full_rate = prefill_tok_s * layers / config.num_layers
    out = {"snapshot_bytes_bf16": snapshot, "kv_bytes_per_block_bf16": block_kv, "block_size": block_size,
           "prefill_tok_s_full_model": full_rate,
           "recompute_s": {n: n / full_rate for n in (1024, 4096)}}  # fmt: skip
    print(f"\nprefix caching for the whole Qwen3.5-9B ({config.num_layers} layers): one state snapshot (bfloat16) is "
          f"{snapshot / 2**20:.1f} MiB where a {block_size}-token block of its attention layers' KV is "
          f"{block_kv / 2**10:.0f} KiB ({snapshot / block_kv:.0f}x): a snapshot at every block boundary multiplies a "
          f"cached prefix's bytes by {1 + snapshot / block_kv:.0f}. Off, each request recomputes its shared prefix: "
          + ", ".join(f"{n:,} tokens in {t:.1f} s" for n, t in out["recompute_s"].items())
          + f" (this run's prefill, {prefill_tok_s:.0f} tok/s at {layers} layers, scaled to {config.num_layers})")  # fmt: skip
    return out


def summary(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "samples": xs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the 32 of Qwen3.5-9B (default 4)")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--venv", type=Path, default=peer.DEFAULT_VENV, help="llama-cpp-python's venv")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--write-file", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.write_file:
        t = time.perf_counter()
        path = write_file(args.layers, args.vocab)
        print(f"{path} ({path.stat().st_size / 1e9:.2f} GB, {time.perf_counter() - t:.0f} s)", flush=True)
        return 0
    if not (args.venv / "bin" / "python").exists():
        raise SystemExit(f"no llama-cpp-python in {args.venv}: run bash benchmarks/setup_llamacpp.sh first")
    # written in a process of its own, so that the workers' peak RSS does not start from the writer's
    subprocess.run([sys.executable, __file__, "--write-file", "--layers", str(args.layers), "--vocab", str(args.vocab)],
                   check=True)  # fmt: skip
    path = write_file(args.layers, args.vocab)
    g = __import__("random").Random(0)
    ids = {n: [g.randrange(256) for _ in range(n)] for n in sorted({*peer.DECODE_CONTEXTS, peer.PREFILL})}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(ids, f)
    runs = {"kvlab": [], "llamacpp": []}
    for r in range(args.repeat):
        for engine in ("kvlab", "llamacpp") if r % 2 == 0 else ("llamacpp", "kvlab"):
            runs[engine].append(peer.spawn(engine, str(path), Path(f.name), args.threads, args.venv))
            print(f"  round {r + 1} {engine}: " + ", ".join(f"{k} {runs[engine][-1][k]:.3g}" for k in peer.FIGURES),
                  flush=True)  # fmt: skip
    os.unlink(f.name)
    figures = peer.FIGURES
    entry = {e: {k: summary([run[k] for run in runs[e]]) for k in figures} for e in runs}
    entry["ratio"] = {k: summary([a[k] / b[k] for a, b in zip(runs["kvlab"], runs["llamacpp"])]) for k in figures}
    entry["kvlab_weights"] = {"format": runs["kvlab"][0]["weight_format"], "bytes": runs["kvlab"][0]["weight_bytes"]}
    entry["kvlab_step"] = {k: summary([run[k] for run in runs["kvlab"]])
                           for k in ("step_ms", "products_ms", "rest_ms", "unfused_step_ms")}  # fmt: skip
    results = {"command": " ".join(sys.argv), "threads": args.threads, "layers": args.layers, "vocab": args.vocab,
               "state_bytes_per_sequence": state_bytes(path), "models": {path.name: entry},
               "note": "random Q4_0 blocks: the values are noise; bytes and shapes are Qwen3.5-9B's"}  # fmt: skip
    print(f"\nrandom Q4_0 blocks of Qwen3.5-9B's layer shape, {args.layers} layers, vocab {args.vocab}; constant state "
          f"{results['state_bytes_per_sequence']:,} B per sequence (float32)")  # fmt: skip
    peer.print_table(results)
    results["prefix_caching"] = prefix_choice(args.layers, entry["kvlab"]["prefill_tok_s"]["median"])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
