"""Experiment `bits`: the same model held in fewer and fewer bits per weight.

Every weight format this machine can run on the model: float32 and bfloat16 (a GGUF file's blocks
expanded), the file's own block formats as stored, and q8_0 / q4_0 blocks made at load. For each:
the bytes a decode step reads (weights as held, plus the KV cache at that context), one decode step
(median of 8 consecutive steps at context 16) and a 256-token prefill; the prediction is the
memory's read speed ÷ those bytes, and the share is measured ÷ predicted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvlab.kv.cache import ContiguousKVCache
from kvlab.lab.common import Lab, Timing, time_decode, time_prefill
from kvlab.lab.report import faster, held, md_table, num, pct, ratio, spread
from kvlab.lab.roofline import measure_bandwidth
from kvlab.lab.sources import BLOG_POST

NAME = "bits"
TITLE = "Fewer bits per weight: decode speed against bytes read"
CLAIM = (
    "Decode reads every weight once per token, so its speed is the memory's read speed divided by the "
    "bytes of the weights: every bit removed from a weight is decode speed gained, whatever the format, "
    "while the arithmetic stays the same."
)
SOURCE = BLOG_POST
MEASURED = "float32 → bfloat16 on Qwen2.5-0.5B: 1.98 → 0.99 GB of weights, a decode step 27.3 → 16.5 ms; 'for decode, every bit removed is speed gained'"

DECODE_CONTEXT, QUICK_DECODE_CONTEXT = 16, 4
DECODE_STEPS, QUICK_DECODE_STEPS = 8, 2
PREFILL_TOKENS, QUICK_PREFILL_TOKENS = 256, 16
# (label, dtype, quantization, the file's own blocks): float32 first, the base of every ratio
VARIANTS = (
    ("float32", "float32", None, False),
    ("bfloat16", "bfloat16", None, False),
    ("as stored", "float32", None, True),
    ("q8_0", "float32", "q8_0", False),
    ("q4_0", "float32", "q4_0", False),
)


@dataclass
class BitsPoint:
    label: str
    weight_format: str
    weight_bytes: int  # held in memory
    bytes_per_token: int  # one decode step: weights as read, plus the KV cache at the decode context
    bits_per_weight: float  # bytes read by the decode step's products × 8 ÷ their multiply-adds
    decode_step: Timing
    decode_tok_s: float
    predicted_tok_s: float  # bandwidth ÷ bytes_per_token
    roofline_share: float  # measured ÷ predicted
    prefill_tokens: int
    prefill_tok_s: float


@dataclass
class BitsResult:
    bandwidth_gb_s: float
    points: list[BitsPoint]
    notes: list[str] = field(default_factory=list)


def _variants(lab: Lab) -> tuple[list[tuple], list[str]]:
    """The formats this model can take: `as stored` only for a GGUF whose matrices are blocks."""
    stored = lab.loaded.path.suffix == ".gguf"
    kept = [v for v in VARIANTS if not v[3] or stored]
    notes = [] if stored else ["a float checkpoint: no 'as stored' blocks to compare (q8_0 and q4_0 are made at load)"]
    return kept, notes


@torch.inference_mode()
def run(lab: Lab) -> BitsResult:
    context = QUICK_DECODE_CONTEXT if lab.quick else DECODE_CONTEXT
    steps = QUICK_DECODE_STEPS if lab.quick else DECODE_STEPS
    tokens, notes = lab.capped(PREFILL_TOKENS, QUICK_PREFILL_TOKENS)
    variants, more = _variants(lab)
    notes += more
    bar = lab.progress(len(variants) + 1, NAME)
    bar.set_postfix_str("read bandwidth")
    bandwidth = measure_bandwidth(lab).gb_s
    bar.update()
    points = []
    for label, dtype, quantization, stored in variants:
        bar.set_postfix_str(f"loading {label}")
        loaded = lab.load(dtype, quantization, stored)
        bar.set_postfix_str(label)
        timing, _ = time_decode(lab, context, steps, loaded)
        step = Timing.of([s / steps for s in timing.samples_s])
        prefill = time_prefill(lab, tokens, loaded)
        kv = ContiguousKVCache.bytes_per_token_for(loaded.config, loaded.model.dtype) * (context + steps // 2)
        read = loaded.decode_weight_bytes() + kv
        layers_macs, head_macs = loaded.model.matmul_macs_per_token()
        product_bytes = loaded.decode_weight_bytes() - loaded.model.embed_tokens.bytes_read_per_token()
        predicted = bandwidth * 1e9 / read
        points.append(BitsPoint(
            label, loaded.weight_format, loaded.weight_bytes, read, 8 * product_bytes / (layers_macs + head_macs),
            step, 1 / step.median_s, predicted, (1 / step.median_s) / predicted, tokens, tokens / prefill.median_s,
        ))  # fmt: skip
        lab.release(dtype, quantization, stored)  # one extra copy of the weights in memory at a time
        bar.update(BitsResult(bandwidth, points, notes))
    bar.close()
    return BitsResult(bandwidth, points, notes)


def table(data: dict) -> str:
    base = data["points"][0]
    head = ["weights", "held MB", "bits/weight", "read per token MB", "decode step ms (min–max)", "decode tok/s",
            "predicted tok/s", "share", "decode vs float32", "prefill tok/s"]  # fmt: skip
    rows = [[
        f"{p['label']}: {p['weight_format']}", num(p["weight_bytes"] / 1e6, 0), num(p["bits_per_weight"], 2),
        num(p["bytes_per_token"] / 1e6, 1), spread(p["decode_step"]), num(p["decode_tok_s"]),
        num(p["predicted_tok_s"]), pct(p["roofline_share"]),
        "–" if p is base else faster(base["decode_step"]["median_s"] / p["decode_step"]["median_s"]),
        num(p["prefill_tok_s"]),
    ] for p in data["points"]]  # fmt: skip
    return md_table(head, rows) + f"\n\nRead bandwidth (sum over a large tensor): {num(data['bandwidth_gb_s'])} GB/s."


def verdict(data: dict) -> str:
    pts = sorted(data["points"], key=lambda p: p["bytes_per_token"], reverse=True)
    speeds = [p["decode_tok_s"] for p in pts]
    monotone = all(b > a for a, b in zip(speeds, speeds[1:]))
    fewest, most = pts[-1], pts[0]
    gain = fewest["decode_tok_s"] / most["decode_tok_s"]
    bytes_ratio = most["bytes_per_token"] / fewest["bytes_per_token"]
    return (
        f"{held(monotone and gain > 0.5 * bytes_ratio, monotone or gain > 1.5)}: from {most['label']} "
        f"({num(most['bits_per_weight'], 1)} bits per weight) to {fewest['label']} "
        f"({num(fewest['bits_per_weight'], 1)}), the bytes a decode step reads fell {ratio(bytes_ratio)} and "
        f"decode ran {faster(gain)}; every format with fewer bytes decoded "
        f"{'faster' if monotone else 'not always faster'}, at {pct(min(p['roofline_share'] for p in pts))}–"
        f"{pct(max(p['roofline_share'] for p in pts))} of the bandwidth's prediction."
    )
