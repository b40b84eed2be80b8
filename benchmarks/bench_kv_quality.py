"""The quality table of the KV-cache formats: `kvlab quality`'s measurement for many settings at once.

    .venv/bin/python benchmarks/bench_kv_quality.py smollm2-135m qwen2.5-coder-0.5b [--tokens 8192]

For each model, every setting is scored against float32 KV over the same text in one pass (the
reference's logits computed once), kept in the results store so `kvlab run` / `serve` find the
verdicts, and printed as one markdown table: mean / p99 KL divergence, same top token, perplexity.
"""

from __future__ import annotations

import argparse
import sys

import torch

from kvlab import hub
from kvlab.kernels import ThreadPolicy
from kvlab.kv.formats import KVFormats
from kvlab.tokenizer import load_tokenizer
from kvlab.model.loader import load_model
from kvlab.quality import store
from kvlab.quality.measure import Candidate, measure
from kvlab.quality.text import ids_digest, text_ids

# (K format, V format, rotation)
SETTINGS = [
    ("q8_0", "q8_0", "off"), ("q8_0", "q8_0", "on"),
    ("q4_0", "q4_0", "off"), ("q4_0", "q4_0", "on"),
    ("q8_0", "q4_0", "off"), ("q8_0", "q4_0", "on"),
    ("q4_0", "q8_0", "on"),
    ("fp8_e4m3", "fp8_e4m3", "off"), ("fp8_e4m3", "fp8_e4m3", "on"),
    ("bfloat16", "bfloat16", "off"), ("float16", "float16", "off"),
]  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="+")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--window", type=int, default=2048)
    p.add_argument("--settings", help="comma-separated K:V:rotation triples (default: the whole list)")
    args = p.parse_args(argv)
    settings = SETTINGS if not args.settings else [tuple(t.split(":")) for t in args.settings.split(",")]
    print("| model | K | V | rotated | mean KLD | p99 KLD | same top | ppl (float32 KV → this) | verdict |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.models:
        path = hub.pull(name, quiet=True)
        loaded = load_model(path, dtype="float32", max_positions=args.window)
        tokenizer = load_tokenizer(loaded)
        ids, what = text_ids(tokenizer, args.tokens)
        bos = tokenizer.bos_token_id if tokenizer.encode("", add_special_tokens=True)[:1] == [tokenizer.bos_token_id] else None
        policy = ThreadPolicy()
        cands = []
        for k, v, rotation in settings:
            formats = KVFormats.resolve(cache_type_k=k, cache_type_v=v, rotation=rotation)
            cands.append(Candidate(f"{formats.description} KV, weights as stored", loaded, formats, policy))
        reference = Candidate("float32 KV", loaded, KVFormats.plain(torch.float32), policy)
        results = measure(reference, cands, ids, window=args.window, chunk=512, bos=bos,
                          progress=lambda d, t: print(f"  {name}: window {d}/{t}", file=sys.stderr, flush=True))  # fmt: skip
        for (k, v, rotation), cand, r in zip(settings, cands, results):
            record = {**r.to_dict(), "model": name, "text": what, "window": args.window, "kv_k": k, "kv_v": v,
                      "kv_rotation": [cand.formats.rotate_k, cand.formats.rotate_v], "weights": "as stored",
                      "dtype": "float32"}  # fmt: skip
            store.save(path, store.setting_key(cand.formats, "as stored"), ids_digest(ids), record)
            print(f"| {name} | {k} | {v} | {rotation} | {r.mean_kld:.5f} | {r.p99_kld:.4f} | {100 * r.same_top_p:.2f}% "
                  f"| {r.ppl_ref:.3f} → {r.ppl:.3f} | {r.verdict} |", flush=True)  # fmt: skip
        print(f"<!-- {name}: {results[0].tokens:,} positions of {what}, {results[0].seconds:.0f} s -->", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
