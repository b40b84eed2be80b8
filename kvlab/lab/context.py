"""Experiment `context`: the time of one decode step as the KV cache grows.

The cache is filled with random keys and values and marked as holding `context` tokens, then a few
decode steps run on top: a step costs the same whatever numbers the cache holds, and no prompt of
8,000 tokens has to be prefilled first. Each sample is the mean of 4 consecutive steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvlab.config import GatedDeltaNet, Mamba2
from kvlab.lab.common import Lab, Timing, greedy
from kvlab.lab.report import held, md_table, num, pct, ratio, spread
from kvlab.lab.sources import BLOG_POST

NAME = "context"
TITLE = "Decode step against context length"
CLAIM = (
    "Besides the weights, every decode step reads the whole KV cache, because the new token attends to "
    "every earlier one; the longer the context, the more bytes a step reads and the slower it gets."
)
SOURCE = BLOG_POST
MEASURED = "Qwen2.5-0.5B float32: one step 27.6 ms at 10 tokens, 33.9 at 1,000, 51.0 at 4,000, 72.1 at 8,000 (2.6×)"

CONTEXTS, QUICK_CONTEXTS = (10, 100, 1000, 4000, 8000), (4, 16, 64)
STEPS, QUICK_STEPS = 4, 2  # decode steps per timed sample


@dataclass
class ContextPoint:
    context: int
    step: Timing  # seconds per decode step
    kv_bytes_read: int  # KV cache bytes one step reads (mean over the sample's steps)
    weight_bytes_read: int  # weight bytes one step streams
    kv_share: float  # of all bytes read per step
    slowdown: float  # median step time ÷ that at the shortest context


@dataclass
class ContextResult:
    points: list[ContextPoint]
    kv_bytes_per_token: int
    notes: list[str] = field(default_factory=list)
    recurrent_layers: int = 0  # layers with a constant state instead of a KV cache (a hybrid: Qwen3.5)
    num_layers: int = 0


@torch.inference_mode()
def run(lab: Lab) -> ContextResult:
    steps = QUICK_STEPS if lab.quick else STEPS
    contexts, notes = lab.sizes(CONTEXTS, QUICK_CONTEXTS, prefill=False, room=steps)
    cache = lab.new_cache(max(contexts) + steps)
    for t in cache.k + cache.v:  # [1, Hkv, max_len, D] each
        t.normal_()
    token = lab.prompt(1)
    weights = lab.loaded.decode_weight_bytes()
    points: list[ContextPoint] = []
    bar = lab.progress(len(contexts), NAME)
    for context in contexts:
        bar.set_postfix_str(f"context {context}")

        def fill(context=context):  # mark `context` tokens as cached: their K/V are the random numbers
            cache.truncate(0)
            cache.commit(cache.plan(context))
            if cache.states is not None:  # a hybrid: its constant states stand for those tokens too
                cache.states.stand_for(context)

        timing = lab.measure(lambda: greedy(lab.model, cache, token, steps), setup=fill)
        step = Timing.of([s / steps for s in timing.samples_s])
        kv = cache.bytes_per_token() * (context + (steps + 1) // 2)
        first = points[0].step.median_s if points else step.median_s
        points.append(ContextPoint(context, step, kv, weights, kv / (kv + weights), step.median_s / first))
        bar.update(ContextResult(points, cache.bytes_per_token(), notes))
    bar.close()
    layers = lab.loaded.config.layers
    recurrent = sum(isinstance(layer.mixer, (GatedDeltaNet, Mamba2)) for layer in layers)
    return ContextResult(points, cache.bytes_per_token(), notes, recurrent, len(layers))


def table(data: dict) -> str:
    head = ["context", "decode step ms (min–max)", "KV read per step MB", "weights read MB", "KV share of bytes",
            "step vs shortest"]  # fmt: skip
    rows = [
        [num(p["context"]), spread(p["step"]), num(p["kv_bytes_read"] / 1e6),
         num(p["weight_bytes_read"] / 1e6, 0), pct(p["kv_share"]), ratio(p["slowdown"])]
        for p in data["points"]
    ]  # fmt: skip
    return md_table(head, rows)


def verdict(data: dict) -> str:
    points = data["points"]
    if len(points) < 2:
        return "Only one context fitted the model: nothing to compare."
    first, last = points[0], points[-1]
    if data.get("recurrent_layers"):
        return _hybrid_verdict(data, first, last)
    ok = last["slowdown"] > 1.2
    return (
        f"{held(ok, last['slowdown'] > 1.05)}: a decode step at {num(last['context'])} tokens took "
        f"{num(last['step']['median_s'] * 1e3)} ms, {ratio(last['slowdown'])} the "
        f"{num(first['step']['median_s'] * 1e3)} ms at {num(first['context'])} ({SOURCE.short} measured 2.6× from 10 to "
        f"8,000); by then the KV cache it reads was {num(last['kv_bytes_read'] / 1e6, 0)} MB, "
        f"{pct(last['kv_share'])} of the bytes read per step."
    )


def _hybrid_verdict(data: dict, first: dict, last: dict) -> str:
    """A hybrid's claim (seed 000): its step grows only with its attention layers' context, as the bytes it
    reads predict, not with every layer's."""
    predicted = (last["kv_bytes_read"] + last["weight_bytes_read"]) / (first["kv_bytes_read"] + first["weight_bytes_read"])
    ok = last["slowdown"] <= max(1.2, 1.2 * predicted)
    return (
        f"{held(ok, last['slowdown'] <= 1.5 * predicted)}: {data['recurrent_layers']} of {data['num_layers']} layers "
        f"keep a constant state instead of a KV cache, so only the attention layers' cache grows: "
        f"{num(last['kv_bytes_read'] / 1e6, 0)} MB at {num(last['context'])} tokens, {pct(last['kv_share'])} of the "
        f"bytes a step reads. The bytes predict a step {ratio(predicted)} the one at {num(first['context'])} tokens; "
        f"it took {ratio(last['slowdown'])} ({num(last['step']['median_s'] * 1e3)} vs "
        f"{num(first['step']['median_s'] * 1e3)} ms)."
    )
