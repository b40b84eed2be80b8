"""Experiment `kv-dtype`: the KV cache in fewer bits: bytes, decode speed at a long context, how many
sequences fit, and what it costs in quality.

For every cache format the model's head_dim can hold (floats, fp8_e4m3, q8_0, q4_0, keys and values
apart, q4_0 with and without the Hadamard rotation):
- bytes per token, exact (the cache class's own count, scales included);
- decode tok/s at a long context (4,096 tokens; seed 002's context table), through the serving engine
  as `kvlab run` decodes: a prompt prefilled once, then consecutive decode steps timed;
- full-context sequences a fixed budget (1 GiB) holds, from the same pool plan `kvlab serve` prints;
- mean KL divergence and same-top-token share against float32 KV over real text (`kvlab quality`'s
  measurement, 2,048 tokens in windows of 1,024).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvlab.config import EngineConfig
from kvlab.engine import LLMEngine
from kvlab.errors import KvlabError
from kvlab.kernels import ThreadPolicy
from kvlab.kv.formats import KVFormats
from kvlab.kv.paged import PagedKVCache
from kvlab.kv.pool_plan import plan_kv_pool
from kvlab.lab.common import Lab, Timing, max_positions
from kvlab.lab.report import faster, held, md_table, num, pct, ratio, spread
from kvlab.lab.sources import COURSE
from kvlab.sampling import SamplingParams

NAME = "kv-dtype"
TITLE = "The KV cache in fewer bits: memory, speed and quality"
CLAIM = (
    "The KV cache can be stored in fewer bits, as weights can: 8 bits halve its memory (so twice the "
    "tokens and sequences fit) at a small loss of quality, while 4-bit keys hurt more than 4-bit values; "
    "the loss must be measured (KL divergence against the full-precision cache) before it is trusted."
)
SOURCE = COURSE
MEASURED = "vLLM --kv-cache-dtype fp8 and llama.cpp --cache-type-k/-v q8_0: '8-bit halves the memory with usually small quality loss; 4-bit keys tend to hurt more'"

CONTEXT, QUICK_CONTEXT = 4096, 40
STEPS, QUICK_STEPS = 8, 2  # decode steps per timed sample
BUDGET = 1 << 30  # bytes of KV pool for the concurrency column
KLD_TOKENS, QUICK_KLD_TOKENS = 2048, 96
KLD_WINDOW, QUICK_KLD_WINDOW = 1024, 48
# (label, K format, V format, rotation): float32 first, the base of every ratio
SETTINGS = (
    ("float32", "float32", "float32", "off"),
    ("bfloat16", "bfloat16", "bfloat16", "off"),
    ("float16", "float16", "float16", "off"),
    ("fp8_e4m3", "fp8_e4m3", "fp8_e4m3", "auto"),
    ("q8_0", "q8_0", "q8_0", "auto"),
    ("q8_0, no rotation", "q8_0", "q8_0", "off"),
    ("K q8_0, V q4_0", "q8_0", "q4_0", "auto"),
    ("K q4_0, V q8_0", "q4_0", "q8_0", "auto"),
    ("q4_0", "q4_0", "q4_0", "auto"),
    ("q4_0, no rotation", "q4_0", "q4_0", "off"),
)


@dataclass
class KVDtypePoint:
    label: str
    formats: str  # as kvlab run's footer names them
    bytes_per_token: int
    decode_step: Timing
    decode_tok_s: float
    max_sequences: float  # full-context sequences in BUDGET bytes
    # quality against float32 KV: measured last, for every format together (None until then)
    mean_kld: float | None = None
    p99_kld: float | None = None
    same_top_p: float | None = None
    ppl: float | None = None
    verdict: str | None = None


@dataclass
class KVDtypeResult:
    context: int
    budget_bytes: int
    kld_tokens: int
    ppl_ref: float
    points: list[KVDtypePoint]
    notes: list[str] = field(default_factory=list)


def _settings(lab: Lab) -> tuple[list[tuple], list[str]]:
    """The settings this model's head_dim can hold (q8_0 / q4_0 need whole blocks of 32)."""
    kept, notes = [], []
    dtype = lab.model.dtype
    for label, k, v, rotation in SETTINGS:
        formats = KVFormats.resolve(cache_type_k=k, cache_type_v=v, model_dtype=dtype, rotation=rotation)
        try:
            PagedKVCache.bytes_per_token_for(lab.config, dtype, formats)
            formats.k.encode(torch.zeros(lab.config.head_dim))
            formats.v.encode(torch.zeros(lab.config.head_dim))
        except KvlabError as e:
            notes.append(f"{label} skipped: {e}")
            continue
        kept.append((label, formats, EngineConfig(cache_type_k=k, cache_type_v=v, kv_rotation=rotation)))
    return kept, notes


def _text(lab: Lab, tokens: int) -> tuple[list[int], int | None, str]:
    """Real text for the KL divergence (the quality guard's), or the lab's random ids without a tokenizer."""
    from kvlab.tokenizer import load_tokenizer
    from kvlab.quality.text import text_ids

    tokenizer = load_tokenizer(lab.loaded)
    if tokenizer is None:
        return lab.prompt(tokens)[0].tolist(), None, "random token ids (the model has no tokenizer)"
    ids, what = text_ids(tokenizer, tokens)
    bos = tokenizer.bos_token_id if tokenizer.encode("", add_special_tokens=True)[:1] == [tokenizer.bos_token_id] else None
    return ids, bos, what


def _room(lab: Lab, steps: int) -> int:
    """Positions past the prompt the timed steps need: the first token, warm-up and every repeat."""
    return steps * (lab.repeat + 2) + 2


def _decode(lab: Lab, config: EngineConfig, context: int, steps: int) -> Timing:
    """Consecutive decode steps of one request whose prompt holds `context` tokens (prefilled untimed)."""
    import dataclasses

    config = dataclasses.replace(config, max_model_len=context + _room(lab, steps),
                                 kv_memory_bytes=None, max_num_seqs=1, enable_prefix_caching=False)  # fmt: skip
    engine = LLMEngine(lab.loaded, None, config, policy=ThreadPolicy())
    prompt = lab.prompt(context)[0].tolist()
    engine.add_request(prompt, SamplingParams(max_tokens=config.max_model_len - context, temperature=0, ignore_eos=True))
    while not engine.scheduler.running or engine.scheduler.running[0].num_computed_tokens < context:
        engine.step()  # the prompt's chunks, and the first token

    def run():
        for _ in range(steps):
            engine.step()

    timing = lab.measure(run)
    return Timing.of([s / steps for s in timing.samples_s])


@torch.inference_mode()
def run(lab: Lab) -> KVDtypeResult:
    from kvlab.quality.measure import Candidate, measure

    steps = QUICK_STEPS if lab.quick else STEPS
    context, notes = lab.capped(CONTEXT, QUICK_CONTEXT)
    room = _room(lab, steps)
    if context + room > max_positions(lab.loaded):
        context = max_positions(lab.loaded) - room
        notes.append(f"context shortened to {context:,} tokens: the decode steps must fit the model's positions")
    settings, more = _settings(lab)
    notes += more
    bar = lab.progress(len(settings) + 1, NAME)
    result = KVDtypeResult(context, BUDGET, 0, float("nan"), [], notes)
    for label, formats, config in settings:  # speed and size first, each point saved as it finishes
        bar.set_postfix_str(label)
        step = _decode(lab, config, context, steps)
        plan = plan_kv_pool(EngineConfig(max_model_len=context, kv_memory_bytes=BUDGET, cache_type_k=config.cache_type_k,
                                         cache_type_v=config.cache_type_v, kv_rotation=config.kv_rotation),
                            lab.config, lab.model.dtype, lab.model.device)  # fmt: skip
        result.points.append(KVDtypePoint(label, formats.description, plan.bytes_per_token, step, 1 / step.median_s,
                                          plan.max_concurrency(context)))  # fmt: skip
        bar.update(result)
    # quality last: one pass over the text measures every format at once, and is the longest point
    bar.set_postfix_str("KL divergence")
    kld_tokens = QUICK_KLD_TOKENS if lab.quick else KLD_TOKENS
    window = QUICK_KLD_WINDOW if lab.quick else KLD_WINDOW
    ids, bos, what = _text(lab, kld_tokens)
    notes.append(f"KL divergence over {len(ids):,} tokens of {what}, windows of {window:,}")
    policy = ThreadPolicy()
    reference = Candidate("float32", lab.loaded, KVFormats.plain(torch.float32), policy)
    quality = measure(reference, [Candidate(label, lab.loaded, f, policy) for label, f, _ in settings],
                      ids, window=window, chunk=min(512, window), bos=bos,
                      progress=lambda i, n: bar.set_postfix_str(f"KL divergence, window {i} of {n}"))  # fmt: skip
    for point, q in zip(result.points, quality):
        point.mean_kld, point.p99_kld, point.same_top_p, point.ppl, point.verdict = (
            q.mean_kld, q.p99_kld, q.same_top_p, q.ppl, q.verdict)  # fmt: skip
    if quality:
        result.kld_tokens, result.ppl_ref = quality[0].tokens, quality[0].ppl_ref
    bar.update()
    bar.close()
    return result


def table(data: dict) -> str:
    base = data["points"][0]
    head = ["KV cache", "B per token", "vs float32", f"decode step ms at {data['context']:,} (min–max)", "decode tok/s",
            "decode vs float32", f"sequences in {data['budget_bytes'] >> 20:,} MiB", "mean KLD", "p99 KLD",
            "same top", "perplexity", "verdict"]  # fmt: skip
    rows = [[
        p["formats"], num(p["bytes_per_token"]), "–" if p is base else ratio(p["bytes_per_token"] / base["bytes_per_token"]),
        spread(p["decode_step"]), num(p["decode_tok_s"]),
        "–" if p is base else faster(base["decode_step"]["median_s"] / p["decode_step"]["median_s"]),
        num(p["max_sequences"], 1), *_quality_cells(p),
    ] for p in data["points"]]  # fmt: skip
    if not data["kld_tokens"]:  # an unfinished run: the quality pass comes last
        return md_table(head, rows) + "\n\nQuality not measured yet (the KL divergence pass comes last)."
    return md_table(head, rows) + (
        f"\n\nPerplexity with float32 KV: {num(data['ppl_ref'], 3)} over {data['kld_tokens']:,} scored positions. "
        "Verdicts as `kvlab quality`: ok = mean KLD ≤ 0.005 and same top ≥ 97%; caution = ≤ 0.03 and ≥ 90%."
    )


def _quality_cells(p: dict) -> list[str]:
    if p.get("mean_kld") is None:
        return ["–"] * 5
    return [f"{p['mean_kld']:.5f}", f"{p['p99_kld']:.4f}", f"{100 * p['same_top_p']:.2f}%", num(p["ppl"], 3),
            p["verdict"]]


def _point(data: dict, label: str) -> dict | None:
    return next((p for p in data["points"] if p["label"] == label), None)


def verdict(data: dict) -> str:
    half, q8 = _point(data, "float16") or _point(data, "bfloat16"), _point(data, "q8_0")
    kq4, vq4 = _point(data, "K q4_0, V q8_0"), _point(data, "K q8_0, V q4_0")
    if not (half and q8 and kq4 and vq4):
        return "Not judged: the model's head_dim holds no q8_0 / q4_0 blocks (they need whole blocks of 32)."
    shrink = half["bytes_per_token"] / q8["bytes_per_token"]
    small = q8["mean_kld"] <= 0.005 and q8["same_top_p"] >= 0.97
    keys_worse = kq4["mean_kld"] > vq4["mean_kld"]
    base = data["points"][0]
    speed = base["decode_step"]["median_s"] / q8["decode_step"]["median_s"]
    return (
        f"{held(shrink >= 1.8 and small and keys_worse, shrink >= 1.8 and (small or keys_worse))}: q8_0 holds "
        f"{ratio(shrink)} the tokens of 16-bit floats in the same bytes ({num(q8['max_sequences'], 1)} against "
        f"{num(half['max_sequences'], 1)} full-context sequences), at a mean KLD of {q8['mean_kld']:.4f} with the top "
        f"token unchanged at {pct(q8['same_top_p'])} of positions ({'small' if small else 'not small'} by kvlab's "
        f"'ok' bar); 4-bit keys cost a mean KLD of {kq4['mean_kld']:.4f} against {vq4['mean_kld']:.4f} for 4-bit "
        f"values ({'keys hurt more' if keys_worse else 'keys did not hurt more'}); at {data['context']:,} tokens "
        f"of context q8_0 decoded {faster(speed, 'float32 KV')}."
    )
