"""Experiment `cache`: decoding with the KV cache against recomputing the whole sequence every step.

With the cache, a step pushes one token through the model. Without it (kvlab's NoCache), step i
pushes all context + i tokens through again. The no-cache runs are capped at a few steps (8 at
context 64, 4 at 512, 2 at 1,024) so the experiment finishes; tokens per second stay comparable.
Both runs are greedy from the same prompt, so they must produce the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvlab.kv.cache import NoCache
from kvlab.lab.common import Lab, Timing, forward, time_decode
from kvlab.lab.report import held, md_table, num, ratio
from kvlab.lab.sources import COURSE

NAME = "cache"
TITLE = "With and without the KV cache"
CLAIM = (
    "Without a cache, each new token re-reads the whole conversation, so the work per token grows with "
    "the context; the cache keeps every past token's keys and values, so a step only computes the new "
    "token. The gap widens as the context grows, and both ways produce exactly the same tokens."
)
SOURCE = COURSE
MEASURED = "Qwen3-0.6B, 32 tokens: 8.1 vs 1 tok/s at context 64, 5.1 vs 0.41 at 512 (12×), 5.49 vs 0.3 at 1,024 (18×)"

CONTEXTS, QUICK_CONTEXTS = (64, 512, 1024), (8, 16)
CACHED_STEPS, QUICK_CACHED_STEPS = 32, 4


def uncached_steps(context: int, quick: bool) -> int:
    """Steps to run without a cache: each costs a prefill of the whole sequence."""
    return 4 if quick else max(2, min(8, 2048 // context))


@dataclass
class CachePoint:
    context: int
    cached_steps: int
    cached: Timing  # seconds for `cached_steps` decode steps
    cached_tok_s: float
    uncached_steps: int
    uncached: Timing  # seconds for `uncached_steps` full recomputations
    uncached_tok_s: float
    slowdown: float  # cached tok/s ÷ uncached tok/s
    tokens_per_uncached_step: float  # tokens pushed through the model per new token, without the cache
    tokens_equal: bool  # the no-cache tokens equal the first tokens of the cached run
    cached_ids: list[int]
    uncached_ids: list[int]


@dataclass
class CacheResult:
    points: list[CachePoint]
    all_tokens_equal: bool
    notes: list[str] = field(default_factory=list)


@torch.inference_mode()
def run(lab: Lab) -> CacheResult:
    steps = QUICK_CACHED_STEPS if lab.quick else CACHED_STEPS
    contexts, notes = lab.sizes(CONTEXTS, QUICK_CONTEXTS, room=steps)
    points = []
    bar = lab.progress(len(contexts), NAME)
    for context in contexts:
        bar.set_postfix_str(f"context {context}")
        cached, cached_ids = time_decode(lab, context, steps)  # cached_ids: first token + `steps` more
        n = uncached_steps(context, lab.quick)
        sequence = torch.cat([lab.prompt(context), torch.tensor([[cached_ids[0]]], device=lab.model.device)], 1)
        produced: list[int] = []

        def recompute():
            ids, produced[:] = sequence, []
            for _ in range(n):  # every step: a fresh, empty cache and the whole sequence
                token = forward(lab.model, NoCache.for_model(lab.config, device=ids.device), ids).argmax(-1)
                produced.append(int(token))
                ids = torch.cat([ids, token[:, None]], dim=1)

        uncached = lab.measure(recompute)
        cached_tok_s, uncached_tok_s = steps / cached.median_s, n / uncached.median_s
        points.append(CachePoint(
            context, steps, cached, cached_tok_s, n, uncached, uncached_tok_s, cached_tok_s / uncached_tok_s,
            tokens_per_uncached_step=context + (n + 1) / 2, tokens_equal=cached_ids[1 : n + 1] == produced,
            cached_ids=cached_ids, uncached_ids=[cached_ids[0]] + produced,
        ))  # fmt: skip
        bar.update(CacheResult(points, all(p.tokens_equal for p in points), list(notes)))
    bar.close()
    caps = ", ".join(f"{p.uncached_steps} at context {p.context:,}" for p in points)
    notes.append(f"the no-cache runs are capped at a few steps ({caps}) so that they finish; tok/s counts steps")
    return CacheResult(points, all(p.tokens_equal for p in points), notes)


def table(data: dict) -> str:
    hf = data.get("transformers")
    head = ["context", "with cache tok/s", "without tok/s", "slowdown", "tokens per step without", "same tokens"]
    if hf:
        head += ["transformers with / without tok/s", "kvlab ÷ transformers (with / without)"]
    rows = []
    for i, p in enumerate(data["points"]):
        row = [
            num(p["context"]), num(p["cached_tok_s"]), num(p["uncached_tok_s"]), ratio(p["slowdown"]),
            f"{num(p['tokens_per_uncached_step'], 0)} (vs 1)",
            f"yes ({p['uncached_steps']} steps)" if p["tokens_equal"] else "**no**",
        ]
        if hf:
            h = hf["points"][i]
            row += [
                f"{num(h['cached_tok_s'])} / {num(h['uncached_tok_s'])}",
                f"{ratio(p['cached_tok_s'] / h['cached_tok_s'])} / {ratio(p['uncached_tok_s'] / h['uncached_tok_s'])}",
            ]
        rows.append(row)
    return md_table(head, rows)


def verdict(data: dict) -> str:
    points = data["points"]
    if not points:
        return "No context fitted the model: nothing to judge."
    middle = next((p for p in points if p["context"] == 512), points[len(points) // 2])
    grows = points[-1]["slowdown"] > points[0]["slowdown"]
    ok = points[-1]["slowdown"] > 2 and grows and data["all_tokens_equal"]
    text = (
        f"{held(ok, middle['slowdown'] > 1)}: without the cache, decoding at context {num(middle['context'])} "
        f"was {ratio(middle['slowdown'])} slower ({SOURCE.short} measured 12× at 512)"
    )
    if len(points) > 1:
        text += (
            f", and the gap {'grew' if grows else 'did not grow'} from {ratio(points[0]['slowdown'])} at "
            f"{num(points[0]['context'])} to {ratio(points[-1]['slowdown'])} at {num(points[-1]['context'])}"
        )
    same = "the tokens were identical" if data["all_tokens_equal"] else "the tokens differed"
    return f"{text}; {same}."
