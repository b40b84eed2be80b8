"""Experiment `dtype`: the same model in float32, bfloat16 and float16.

One decode step (median of 8 consecutive steps at context 16) and one 500-token prefill per dtype.
The weights are loaded again in each dtype; KV cache and activations follow the weights' dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvlab.lab.common import Lab, Timing, time_decode, time_prefill
from kvlab.lab.report import faster, held, md_table, num, spread
from kvlab.lab.sources import BLOG_POST

NAME = "dtype"
TITLE = "16-bit weights: decode against prefill"
CLAIM = (
    "Halving the bytes per weight should make decode, which waits for memory, nearly twice as fast "
    "although it computes exactly as much; prefill, which waits for arithmetic, gains nothing, and on a "
    "CPU without fast 16-bit matrix units it gets slower."
)
SOURCE = BLOG_POST
MEASURED = "Qwen2.5-0.5B: decode 27.3 ms in float32, 16.5 in bfloat16 (1.7× faster); 500-token prefill 341 ms → 3,711 ms (11× slower)"

DTYPES = ("float32", "bfloat16", "float16")
DECODE_CONTEXT, QUICK_DECODE_CONTEXT = 16, 4
DECODE_STEPS, QUICK_DECODE_STEPS = 8, 2
PREFILL_TOKENS, QUICK_PREFILL_TOKENS = 500, 16


@dataclass
class DtypePoint:
    dtype: str
    weight_bytes: int
    decode_step: Timing  # seconds per decode step
    decode_gb_s: float  # weight bytes a step streams ÷ median step time, 1e9 bytes/s
    prefill_tokens: int
    prefill: Timing  # seconds per prompt
    prefill_tok_s: float


@dataclass
class DtypeResult:
    points: list[DtypePoint]
    notes: list[str] = field(default_factory=list)


@torch.inference_mode()
def run(lab: Lab) -> DtypeResult:
    context = QUICK_DECODE_CONTEXT if lab.quick else DECODE_CONTEXT
    steps = QUICK_DECODE_STEPS if lab.quick else DECODE_STEPS
    tokens, notes = lab.capped(PREFILL_TOKENS, QUICK_PREFILL_TOKENS)
    points = []
    bar = lab.progress(len(DTYPES), NAME)
    for dtype in DTYPES:
        bar.set_postfix_str(f"loading {dtype}")
        loaded = lab.load(dtype)
        bar.set_postfix_str(dtype)
        timing, _ = time_decode(lab, context, steps, loaded)
        step = Timing.of([s / steps for s in timing.samples_s])
        prefill = time_prefill(lab, tokens, loaded)
        points.append(DtypePoint(
            dtype, loaded.weight_bytes, step, loaded.decode_weight_bytes() / step.median_s / 1e9,
            tokens, prefill, tokens / prefill.median_s,
        ))  # fmt: skip
        lab.release(dtype)  # keep one extra copy of the weights in memory at a time
        bar.update(DtypeResult(points, notes))
    bar.close()
    return DtypeResult(points, notes)


def table(data: dict) -> str:
    base = data["points"][0]
    head = ["dtype", "weights MB", "decode step ms (min–max)", "decode GB/s", "decode vs float32",
            "prefill ms (min–max)", "prefill tokens", "prefill vs float32"]  # fmt: skip
    rows = []
    for p in data["points"]:
        is_base = p is base
        rows.append([
            p["dtype"], num(p["weight_bytes"] / 1e6, 0), spread(p["decode_step"]), num(p["decode_gb_s"]),
            "–" if is_base else faster(base["decode_step"]["median_s"] / p["decode_step"]["median_s"]),
            spread(p["prefill"]), num(p["prefill_tokens"]),
            "–" if is_base else faster(base["prefill"]["median_s"] / p["prefill"]["median_s"]),
        ])  # fmt: skip
    return md_table(head, rows)


def verdict(data: dict) -> str:
    base, halves = data["points"][0], data["points"][1:]
    decode = {p["dtype"]: base["decode_step"]["median_s"] / p["decode_step"]["median_s"] for p in halves}
    prefill = {p["dtype"]: base["prefill"]["median_s"] / p["prefill"]["median_s"] for p in halves}
    best = max(decode, key=decode.get)
    faster_decode = decode[best] > 1.1
    prefill_no_gain = max(prefill.values()) < 1.1  # 16-bit prefill is not faster than float32
    prefill_text = " and ".join(f"{faster(v)} in {k}" for k, v in prefill.items())
    return (
        f"{held(faster_decode and prefill_no_gain, faster_decode or prefill_no_gain)}: a decode step in "
        f"{best} ran {faster(decode[best], 'in float32')} ({SOURCE.short} measured 1.7× faster), reading "
        f"{num(next(p['decode_gb_s'] for p in halves if p['dtype'] == best))} GB/s of weights against "
        f"{num(base['decode_gb_s'])} in float32, while the {num(base['prefill_tokens'])}-token prefill ran "
        f"{prefill_text} ({SOURCE.short}: 7–11× slower)."
    )
