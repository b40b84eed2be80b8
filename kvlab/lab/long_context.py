"""Experiment `long-context`: perplexity by position, from well inside the trained context to twice past it.

One long real text (`kvlab quality`'s: Python's own standard-library sources) of 2 × max_position_embeddings
tokens is scored token by token, the cache filled chunk by chunk (chunked prefill: every position
attends to all before it), three ways:

    as shipped    the model's own RoPE, its rotary tables simply extended past the trained length
    YaRN ×F       a rope-scaling override, {"rope_type": "yarn", "factor": F, "original_max_position_embeddings":
                  trained}, F the factor that covers the text (`--rope-scaling` on run / serve, LLM(rope_scaling=))
    restarted     the control: the same tokens in windows of the trained length, each from an empty
                  cache, so no position ever leaves the trained range (what truncating the context gives)

Per bucket of positions (a quarter of the trained length each): perplexity = exp(mean −log p(token | all
before it)) over the tokens whose position lies in the bucket. The model's own limit is never raised
for anything else: the tables are stretched for the passes of this experiment and restored after.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from kvlab.kv.cache import ContiguousKVCache
from kvlab.lab.common import Lab
from kvlab.lab.report import held, md_table, num, ratio
from kvlab.lab.sources import COURSE
from kvlab.runner.driver import ModelDriver

NAME = "long-context"
TITLE = "Past the trained context: RoPE as shipped against YaRN"
CLAIM = (
    "A model has seen positions only up to its trained context (max_position_embeddings); past it, plain "
    "RoPE gives rotations it never learned and the output degrades to garbage. Rescaling the rotations "
    "(YaRN, enabled with a rope_scaling block) stretches the usable window."
)
SOURCE = COURSE
MEASURED = "nothing: it cites YaRN (Peng et al., 2023) and Qwen's rope_scaling block"

QUICK_TOKENS = 1024  # quick: at most this many tokens (past the trained length only for a tiny model)
BUCKETS_PER_TRAINED = 4  # buckets a trained length is cut into
CHUNK, QUICK_CHUNK = 1024, 32  # tokens per forward pass (chunked prefill)
SCORE_ROWS = 256  # positions log-softmaxed at once (float64 over the vocabulary)
BREAKS = 2.0  # a bucket "breaks down" at twice the control's perplexity
HOLDS = 1.25  # YaRN "holds" within 25% of the control's perplexity past the trained length


@dataclass
class Series:
    kind: str  # "shipped", "yarn" or "restarted"
    label: str
    rope: str  # the rotary settings, in words
    ppl: list[float]  # per bucket
    ppl_inside: float  # positions before the trained length
    ppl_past: float | None  # positions from the trained length on (None: the text does not reach it)
    seconds: float


@dataclass
class LongContextResult:
    trained: int  # the model's max_position_embeddings
    tokens: int  # scored sequence length, BOS included
    text: str
    edges: list[int]  # bucket b holds positions edges[b] ≤ p < edges[b + 1] (of the predicted token)
    rope_scaling: dict  # the YaRN override
    series: list[Series] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# ---- scoring ------------------------------------------------------------------------------------


def token_nll(driver: ModelDriver, loaded, ids: list[int], chunk: int, progress=None) -> torch.Tensor:
    """−log p(ids[i] | ids[:i]) for i = 1 … len − 1, float64 [len − 1]: the ids fed `chunk` at a time
    through one cache, as a chunked prefill does; `progress(done, total)` after each chunk."""
    model = loaded.model
    cache = ContiguousKVCache.for_model(loaded.config, len(ids), dtype=model.dtype, device=model.device)
    out = []
    for c0 in range(0, len(ids), chunk):
        part = ids[c0 : c0 + chunk]
        targets = torch.tensor(ids[c0 + 1 : c0 + 1 + len(part)], device=model.device)  # one fewer at the end
        x = torch.tensor([part], dtype=torch.long, device=model.device)
        logits = driver.run(x, cache, logits_index=torch.arange(len(targets), device=model.device))[0]  # [T, V]
        for r0 in range(0, len(targets), SCORE_ROWS):
            logp = torch.log_softmax(logits[r0 : r0 + SCORE_ROWS].double(), dim=-1)
            out.append(-logp.gather(-1, targets[r0 : r0 + SCORE_ROWS, None])[:, 0].cpu())
        if progress is not None:
            progress(c0 + len(part), len(ids))
    return torch.cat(out)


def restarted_nll(driver: ModelDriver, loaded, ids: list[int], window: int, chunk: int, bos: int | None,
                  first: torch.Tensor | None = None) -> torch.Tensor:
    """The same scores with the text cut into windows of `window` positions, each from an empty cache:
    no position ever reaches `window`. A window starts with the BOS (ids[0], when the model has one) or,
    without one, with the last token of the window before, then scores `window` − 1 new tokens.

    `first`: the scores of an unbroken pass over the same ids, whose first window is this one's (the
    same tokens at the same positions), so that it is not computed twice."""
    step = window - 1  # new tokens per window
    out = []
    for w0 in range(1, len(ids), step):
        if first is not None and w0 == 1:
            out.append(first[:step])
            continue
        piece = [bos if bos is not None else ids[w0 - 1]] + ids[w0 : w0 + step]
        out.append(token_nll(driver, loaded, piece, chunk))
    return torch.cat(out)


def bucket_ppl(nll: torch.Tensor, edges: list[int]) -> list[float]:
    """Perplexity per bucket; nll[i] scores the token at position i + 1."""
    positions = torch.arange(1, len(nll) + 1)
    return [math.exp(float(nll[(positions >= lo) & (positions < hi)].mean())) for lo, hi in zip(edges, edges[1:])]


def span_ppl(nll: torch.Tensor, lo: int, hi: int) -> float | None:
    part = nll[max(lo - 1, 0) : max(hi - 1, 0)]
    return math.exp(float(part.mean())) if len(part) else None


def bucket_edges(tokens: int, trained: int) -> list[int]:
    """Edges of buckets a quarter of the trained length wide (always at the trained length itself), or
    eight even buckets where the text is shorter than the trained length (quick runs)."""
    width = trained // BUCKETS_PER_TRAINED if tokens > trained else max(tokens // 8, 1)
    edges = list(range(0, tokens, width))
    return edges + [tokens] if edges[-1] < tokens else edges


# ---- the rotary tables of a pass ------------------------------------------------------------------


@contextmanager
def rotary_for(loaded, positions: int, scaling: dict | None = None) -> Iterator[object]:
    """The lab's model with rotary tables for `positions` positions (and with `scaling`, a rope-scaling
    override: kvlab.llm.with_rope_scaling); the model's own config and tables are restored after."""
    from kvlab.llm import with_rope_scaling

    model, config, before = loaded.model, loaded.config, loaded.model.rotary.cos.shape[0]
    try:
        if scaling is None:
            model.build_rotary(positions, model.device)
            yield loaded
        else:
            yield with_rope_scaling(loaded, scaling, positions)
    finally:
        model.config = config
        model.build_rotary(before, model.device)


def long_text(lab: Lab, tokens: int) -> tuple[list[int], int | None, str]:
    """(`tokens` ids, BOS first where the model's tokenizer adds one; that BOS or None; what the text is):
    `kvlab quality`'s text, or the lab's random ids for a model without a tokenizer."""
    from kvlab.quality.text import text_ids
    from kvlab.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(lab.loaded)
    if tokenizer is None:
        return lab.prompt(tokens)[0].tolist(), None, "random token ids (the model has no tokenizer)"
    bos = tokenizer.bos_token_id
    if bos is None or tokenizer.encode("", add_special_tokens=True)[:1] != [bos]:
        bos = None  # the model's prompts start without one
    ids, what = text_ids(tokenizer, tokens - (bos is not None))
    return ([bos] if bos is not None else []) + ids, bos, what


@torch.inference_mode()
def run(lab: Lab) -> LongContextResult:
    from kvlab.kernels import ThreadPolicy

    trained = lab.config.max_position_embeddings
    tokens = min(QUICK_TOKENS, 2 * trained) if lab.quick else 2 * trained
    notes = []
    if lab.max_prompt and tokens > lab.max_prompt:
        notes.append(f"text shortened from {tokens:,} to {lab.max_prompt:,} tokens by --max-prompt")
        tokens = lab.max_prompt
    ids, bos, what = long_text(lab, tokens)
    tokens = len(ids)
    factor = max(2.0, float(math.ceil(tokens / trained)))
    scaling = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": trained}
    chunk = QUICK_CHUNK if lab.quick else CHUNK
    edges = bucket_edges(tokens, trained)
    notes.append(f"{tokens:,} tokens of {what}, fed {chunk:,} at a time; the model's trained context is "
                 f"{trained:,} (max_position_embeddings), its rotary tables stretched to {tokens:,} for this "
                 "experiment only")  # fmt: skip
    result = LongContextResult(trained, tokens, what, edges, scaling, [], notes)
    driver = ModelDriver(lab.model, ThreadPolicy(threads=torch.get_num_threads()))
    passes = (("shipped", "as shipped", None), ("yarn", f"YaRN ×{factor:g}", scaling),
              ("restarted", f"restarted every {trained:,}", None))  # fmt: skip
    bar = lab.progress(len(passes), NAME)
    shipped = None  # the first pass's scores: the control's first window
    for kind, label, how in passes:
        bar.set_postfix_str(label)
        start = time.perf_counter()
        if kind == "restarted":
            nll = restarted_nll(driver, lab.loaded, ids, trained, chunk, bos, first=shipped)
            rope = f"as shipped ({describe(lab.config.rope)}), never past position {trained - 1:,}"
        else:
            with rotary_for(lab.loaded, tokens, how) as loaded:
                nll = token_nll(driver, loaded, ids, chunk,
                                lambda done, total, label=label: bar.set_postfix_str(f"{label}, {done:,} of {total:,}"))
                rope = describe(loaded.config.rope)
            shipped = nll if kind == "shipped" else shipped
        result.series.append(Series(kind, label, rope, bucket_ppl(nll, edges), span_ppl(nll, 1, trained),
                                    span_ppl(nll, trained, tokens), time.perf_counter() - start))  # fmt: skip
        bar.update(result)
    bar.close()
    return result


def describe(rope) -> str:
    text = f"theta {rope.theta:g}"
    if rope.type != "default":
        text += f", {rope.type} ×{rope.factor:g}"
        if rope.original_max_position_embeddings:
            text += f" of {rope.original_max_position_embeddings:,}"
    return text


# ---- the report ------------------------------------------------------------------------------------


def table(data: dict) -> str:
    edges, trained = data["edges"], data["trained"]
    head = ["positions", *(s["label"] for s in data["series"])]
    rows = []
    for b, (lo, hi) in enumerate(zip(edges, edges[1:])):
        mark = " (past trained)" if lo >= trained else ""
        rows.append([f"{num(lo)}–{num(hi - 1)}{mark}", *(num(s["ppl"][b]) for s in data["series"])])
    rows.append([f"**all before {num(trained)}**", *(num(s["ppl_inside"]) for s in data["series"])])
    if all(s["ppl_past"] is not None for s in data["series"]):
        rows.append([f"**all from {num(trained)} on**", *(num(s["ppl_past"]) for s in data["series"])])
    rows.append(["seconds", *(num(s["seconds"], 0) for s in data["series"])])
    ropes = "; ".join(f"{s['label']}: {s['rope']}" for s in data["series"])
    return md_table(head, rows) + f"\n\nPerplexity of the next token, by its position. RoPE: {ropes}."


def verdict(data: dict) -> str:
    series = {s["kind"]: s for s in data["series"]}
    plain, yarn, control = series.get("shipped"), series.get("yarn"), series.get("restarted")
    trained = data["trained"]
    if not (plain and yarn and control) or plain["ppl_past"] is None:
        return f"Not judged: the text did not reach past the trained context of {num(trained)} tokens."
    breaks = [(lo, p / c) for lo, p, c in zip(data["edges"], plain["ppl"], control["ppl"])
              if lo >= trained and p >= BREAKS * c]  # fmt: skip
    where = (f"it breaks down from position {num(breaks[0][0])} ({ratio(breaks[0][1])} the control's perplexity there)"
             if breaks else f"it never reached {ratio(BREAKS)} the control's perplexity")  # fmt: skip
    garbage = plain["ppl_past"] >= BREAKS * control["ppl_past"]
    holds = yarn["ppl_past"] <= HOLDS * control["ppl_past"]
    return (
        f"{held(garbage and holds, garbage or holds)}: past the trained {num(trained)} tokens, RoPE as shipped "
        f"scored a perplexity of {num(plain['ppl_past'])} against {num(control['ppl_past'])} for the same tokens "
        f"kept inside the trained range ({ratio(plain['ppl_past'] / control['ppl_past'])}); {where}. "
        f"{yarn['label']} {'held' if holds else 'did not hold'} it at {num(yarn['ppl_past'])} "
        f"({ratio(yarn['ppl_past'] / control['ppl_past'])} the control), at a cost of {num(yarn['ppl_inside'])} "
        f"against {num(plain['ppl_inside'])} inside the trained range."
    )
