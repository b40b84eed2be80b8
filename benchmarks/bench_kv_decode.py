"""Decode speed at long contexts with the KV cache in each format: float32, bfloat16, float16, q8_0, q4_0, fp8_e4m3.

    .venv/bin/python benchmarks/bench_kv_decode.py --models smollm2-135m qwen2.5-coder-0.5b \
        --contexts 1000 4000 8000 --repeat 5

At a long context a decode step's time is mostly reading the cache: every layer reads every cached
key and value of the sequence. The fused decode step (kernels/decode.c) reads them in their stored
bytes (34 per 32 values for q8_0, 18 for q4_0, 33 for fp8_e4m3, 128 for float32), so a quantized
cache is read faster than a float one.

Rotation as the engine's default (--kv-rotation auto: q8_0 and q4_0 Hadamard-rotated; --rotation).
For each model one paged cache per format holds the longest context (one sequence), its blocks
filled with random K/V vectors in that format (encoded by kv/formats.py; the step's time does not
depend on the values). A decode step at context N is then the model's own forward over one new token
at position N - 1 through ModelDriver, which takes the fused step: the weights' products, the new
K/V written in the cache's format, attention over N keys, the logits. Per repeat, each format runs
STEPS steps in turn (the order rotating between repeats, so machine drift and noisy neighbours hit
every format alike); one warm-up round is excluded. Printed: decode tok/s (median of the repeats,
min–max) and each format's ratio to float32 measured in the same run. --json prints one JSON object.
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

from kvlab.kernels import ThreadPolicy  # noqa: E402
from kvlab.kv.cache import AttentionMetadata  # noqa: E402
from kvlab.kv.formats import KVFormats  # noqa: E402
from kvlab.kv.paged import AttentionGroup, KVGroupMetadata, PagedKVCache, PagedMetadata  # noqa: E402
from kvlab.model.loader import load_model  # noqa: E402
from kvlab.runner.driver import ModelDriver  # noqa: E402

FORMATS = ["float32", "bfloat16", "float16", "q8_0", "q4_0", "fp8_e4m3"]
STEPS = 8  # decode steps per format per repeat
BLOCK = 16


def filled_cache(config, formats: KVFormats, num_tokens: int, seed: int) -> PagedKVCache:
    """A paged cache of num_tokens slots (+ one block), every vector random and stored in `formats`."""
    blocks = -(-num_tokens // BLOCK) + 1
    cache = PagedKVCache.for_model(config, blocks, BLOCK, formats=formats)
    g = torch.Generator().manual_seed(seed)
    for parts_list, fmt in ((cache.k_parts, formats.k), (cache.v_parts, formats.v)):
        for parts in parts_list:
            for b in range(0, blocks, 64):  # a few blocks at a time: no float copy of the whole cache
                n = min(64, blocks - b)
                x = torch.randn(n, BLOCK, config.num_kv_heads, config.head_dim, generator=g)
                for t, value in zip(parts, fmt.encode(x)):
                    t[b : b + n] = value
    return cache


def decode_inputs(context: int, device) -> tuple[torch.Tensor, PagedMetadata, torch.Tensor]:
    """One sequence's next token at position context - 1: ids, metadata (blocks 0.. in order), logits index."""
    pos = context - 1
    tables = torch.arange(-(-context // BLOCK), dtype=torch.long)[None]  # [1, blocks]
    attn = AttentionMetadata(positions=torch.tensor([[pos]]), start=context - 1, attn_mask=None)
    group = AttentionGroup(0, 1, tables, context, attn)
    slots = torch.tensor([pos], dtype=torch.long)  # block pos // BLOCK is block number pos // BLOCK
    meta = PagedMetadata(positions=torch.tensor([[pos]]), kv_groups=[KVGroupMetadata(slots, [group])])
    return torch.tensor([[5]]), meta, torch.tensor([0])


def measure(args) -> dict:
    rows = []
    for name in args.models:
        loaded = load_model(name, max_positions=max(args.contexts) + BLOCK)
        config = loaded.config
        driver = ModelDriver(loaded.model, ThreadPolicy(threads=args.threads))
        caches = {f: filled_cache(config, KVFormats.resolve(f, rotation=args.rotation), max(args.contexts), seed=i)
                  for i, f in enumerate(FORMATS)}  # fmt: skip
        for context in args.contexts:
            ids, meta, index = decode_inputs(context, loaded.model.device)
            for f, cache in caches.items():
                assert driver._fused_step(ids, cache, meta, index) is not None, f"{f}: not the fused step"
            speeds: dict[str, list[float]] = {f: [] for f in FORMATS}
            for r in range(args.repeat + 1):  # round 0 warms up
                order = FORMATS[r % len(FORMATS) :] + FORMATS[: r % len(FORMATS)]
                for f in order:
                    start = time.perf_counter()
                    for _ in range(STEPS):
                        driver.run(ids, caches[f], meta, index)
                    if r:
                        speeds[f].append(STEPS / (time.perf_counter() - start))
            row = {"model": name, "weights": loaded.weight_format, "context": context}
            for f in FORMATS:
                xs = speeds[f]
                row[f] = {"median": statistics.median(xs), "min": min(xs), "max": max(xs),
                          "kv_bytes_per_token": caches[f].bytes_per_token()}  # fmt: skip
            rows.append(row)
            print(f"  {name} {context}: " + ", ".join(f"{f} {row[f]['median']:.1f}" for f in FORMATS),
                  file=sys.stderr, flush=True)  # fmt: skip
        del caches
    return {"threads": args.threads, "rotation": args.rotation, "repeat": args.repeat, "steps": STEPS, "rows": rows,
            "machine": platform.processor() or platform.machine()}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-0.5b"])
    p.add_argument("--contexts", type=int, nargs="+", default=[1000, 4000, 8000])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--rotation", default="auto", choices=["auto", "on", "off"],
                   help="--kv-rotation: auto (the engine's default) rotates the q8_0 and q4_0 caches")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = measure(args)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"decode tok/s, one sequence, fused step, {args.threads} threads, --kv-rotation {args.rotation}, median of "
          f"{args.repeat} × {STEPS} steps (min–max); × = ratio to float32 in the same run")  # fmt: skip
    print(f"{'model':<20} {'context':>7}  " + "  ".join(f"{f:>22}" for f in FORMATS))
    for r in result["rows"]:
        base = r["float32"]["median"]
        cells = []
        for f in FORMATS:
            s = r[f]
            ratio = "" if f == "float32" else f" ×{s['median'] / base:.2f}"
            cells.append(f"{s['median']:6.1f} ({s['min']:.0f}–{s['max']:.0f}){ratio}")
        print(f"{r['model']:<20} {r['context']:>7}  " + "  ".join(f"{c:>22}" for c in cells))
    print("KV bytes per token: " + ", ".join(f"{f} {result['rows'][0][f]['kv_bytes_per_token']}" for f in FORMATS)
          + f" ({result['rows'][0]['model']})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
