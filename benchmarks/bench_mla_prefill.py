"""Multi-head latent attention's prompt chunk, absorbed against rebuilt, at DeepSeek-V3's latent widths.

    .venv/bin/python benchmarks/bench_mla_prefill.py [--heads 16] [--hidden 1024] [--threads 1]

One MLAttention layer (kvlab.model.mla) with DeepSeek-V3's kv_lora_rank 512, rope 64, nope 128, v 128 and
q_lora_rank 1536, fewer heads and a narrower hidden size so that its weights fit a laptop (the ratio is per
head), random weights, float32, a contiguous cache. Each length: the best of 3 passes, one warm-up excluded;
the largest difference of the two outputs is printed beside the times (they must agree).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from kvlab.config.hf import config_from_hf
from kvlab.kv.cache import ContiguousKVCache
from kvlab.model.mla import MLAttention
from kvlab.model.rope import RotaryEmbedding

CONFIG = Path(__file__).resolve().parent.parent / "kvlab" / "configs" / "deepseek-v3.json"


def layer(heads: int, hidden: int) -> tuple[MLAttention, object]:
    raw = json.loads(CONFIG.read_text())
    raw.update(hidden_size=hidden, num_attention_heads=heads, num_hidden_layers=1)
    config = config_from_hf(raw, name="deepseek-v3 (narrowed)", source=str(CONFIG))
    attn = MLAttention(config, 0)
    g = torch.Generator().manual_seed(0)
    for p in attn.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.02
    return attn, config


@torch.inference_mode()
def time_pass(attn: MLAttention, config, x: torch.Tensor, cos, sin, repeat: int = 3) -> tuple[float, torch.Tensor]:
    times, out = [], None
    for i in range(repeat + 1):
        cache = ContiguousKVCache.for_model(config, x.shape[1])
        meta = cache.plan(x.shape[1])
        start = time.perf_counter()
        out = attn(x, cos, sin, cache, meta)
        if i:  # the first pass warms up
            times.append(time.perf_counter() - start)
    return min(times), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    attn, config = layer(args.heads, args.hidden)
    rotary = RotaryEmbedding(config.rope, attn.rope_dim, 4096)
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} thread(s), "
          f"{args.heads} heads, hidden {args.hidden}")
    for tokens in (128, 512, 1024):
        x = torch.randn(1, tokens, args.hidden, generator=torch.Generator().manual_seed(tokens))
        cos, sin = rotary(torch.arange(tokens)[None], torch.float32)
        results = {}
        for absorb in (True, False):
            attn.absorb = absorb
            results[absorb] = time_pass(attn, config, x, cos, sin)
        (absorbed, a), (rebuilt, b) = results[True], results[False]
        print(f"{tokens:5} tokens: absorbed {absorbed * 1e3:7.1f} ms, rebuilt {rebuilt * 1e3:7.1f} ms "
              f"({absorbed / rebuilt:.2f}×), max |Δ| {(a - b).abs().max().item():.1e}")


if __name__ == "__main__":
    main()
