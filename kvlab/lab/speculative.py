"""Experiment `speculative`: prompt lookup and a draft model, k = 1..8, against plain decoding.

Three workloads, greedy, through the model's chat template: two that copy the prompt (edit a given
function; summarise a given passage) and one that does not (write a new story). For each, plain
decoding is timed (the median of --repeat runs), then every proposer at every k: decode tok/s, α, the
mean acceptance length, c (a draft step over a plain decode step, measured by the engine), r (a
verification step's target pass over a plain decode step) and Leviathan's predicted speedup
(1 − α^(k+1)) / ((1 − α)(k·c + 1)) beside the measured one. Every speculative answer is checked to be
the plain one, token for token.

The draft model is the lab model's smaller sibling with the same tokenizer (DRAFTS); a model without
one gets prompt lookup only. --quick uses the model as its own draft (every draft accepted), k ≤ 2.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from kvlab.lab.common import Lab
from kvlab.lab.report import faster, held, md_table, num
from kvlab.lab.sources import SPEC_ARTICLE
from kvlab.spec_decode.metrics import predicted_speedup

NAME = "speculative"
TITLE = "Speculative decoding: a draft's guesses checked in one pass"
CLAIM = (
    "A cheap guess of the next k tokens, checked by the model in one batched pass, gives the same text "
    "faster when the guesses are good: prompt lookup (cost ≈ 0) wins when the answer copies the prompt, "
    "while on a CPU a draft model costing a third of the target barely breaks even or loses, however "
    "often it is right."
)
SOURCE = SPEC_ARTICLE
MEASURED = ("Qwen2.5-0.5B drafting for 1.5B on a CPU (k = 5, greedy): 49–62% slower than plain decoding at mean "
            "acceptance lengths 2.1–3.5")  # fmt: skip

DRAFTS = {"qwen2.5-coder-1.5b": "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b-instruct": "qwen2.5-coder-0.5b"}
KS, QUICK_KS = (1, 2, 3, 4, 5, 6, 7, 8), (1, 2)
MAX_TOKENS, QUICK_MAX_TOKENS = 96, 8

FUNCTION = '''def merge_sorted(a, b):
    """Merge two sorted lists into one sorted list."""
    result = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            result.append(a[i])
            i += 1
        else:
            result.append(b[j])
            j += 1
    result.extend(a[i:])
    result.extend(b[j:])
    return result
'''
PASSAGE = (
    "The lighthouse at Point Reyes was built in 1870 to warn ships away from the rocky headland, one of "
    "the foggiest places on the Pacific coast. Its first-order Fresnel lens, made in France, has 1,032 "
    "pieces of glass and could be seen 24 miles out to sea. Keepers climbed 308 steps down the cliff each "
    "night to wind the clockwork that turned the lens. The light was automated in 1975, and the lens still "
    "sits in its tower, where visitors can see it on weekends."
)
WORKLOADS = {
    "edit a function": ("copying", "Rename merge_sorted to merge_lists and result to merged. Reply with the "
                                   "whole code only.\n\n" + FUNCTION),
    "summarise a passage": ("copying", "Summarise this passage in three sentences, keeping its facts and "
                                       "wording.\n\n" + PASSAGE),
    "write a story": ("free", "Write a short story about a lighthouse keeper who finds a message in a bottle."),
}  # fmt: skip


@dataclass
class SpecPoint:
    workload: str
    kind: str  # copying / free
    proposer: str  # ngram / draft_model
    k: int
    tok_s: float
    plain_tok_s: float
    measured_speedup: float
    alpha: float
    mean_acceptance_length: float
    c: float
    r: float
    predicted_speedup: float
    identical: bool


@dataclass
class SpecResult:
    draft: str | None
    points: list[SpecPoint]
    plain_tok_s: dict[str, float]
    notes: list[str] = field(default_factory=list)


def _generate(engine, tokenizer, text: str, max_tokens: int):
    from kvlab.sampling import SamplingParams

    ids = tokenizer.encode_chat([{"role": "user", "content": text}], add_generation_prompt=True)
    rid = engine.add_request(ids, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    out = None
    while engine.has_unfinished_requests:
        for o in engine.step():
            if o.request_id == rid and o.finished:
                out = o.output
    return out


def run(lab: Lab) -> SpecResult:
    from kvlab.config import EngineConfig
    from kvlab.engine import LLMEngine
    from kvlab.hub import ensure_pulled
    from kvlab.kernels import ThreadPolicy
    from kvlab.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(lab.loaded)
    notes = []
    if tokenizer is None or tokenizer.chat_template is None:
        return SpecResult(None, [], {}, ["the model has no chat template: nothing measured"])
    ks = QUICK_KS if lab.quick else KS
    max_tokens = QUICK_MAX_TOKENS if lab.quick else MAX_TOKENS
    draft = str(lab.loaded.path) if lab.quick else DRAFTS.get(lab.model_name)
    if draft is None:
        notes.append(f"{lab.model_name} has no smaller sibling with its tokenizer in kvlab's registry: prompt lookup only")
    elif not lab.quick:
        ensure_pulled(draft)
    policy = ThreadPolicy()

    def engine(speculative=None):
        context = min(4096, lab.config.max_position_embeddings or 4096)
        return LLMEngine(lab.loaded, tokenizer, EngineConfig(max_model_len=context, speculative_config=speculative),
                         policy=policy)  # fmt: skip

    proposers = [("ngram", lambda k: {"method": "ngram", "num_speculative_tokens": k})]
    if draft:
        proposers.append(("draft_model", lambda k: {"method": "draft_model", "model": draft, "num_speculative_tokens": k}))
    points, plain_rates = [], {}
    bar = lab.progress(len(WORKLOADS) * (1 + len(proposers) * len(ks)), NAME)
    for workload, (kind, text) in WORKLOADS.items():
        plain = engine()
        _generate(plain, tokenizer, text, 4)  # warm-up
        runs = [_generate(plain, tokenizer, text, max_tokens) for _ in range(lab.repeat)]
        want = runs[0].token_ids
        plain_rate = plain_rates[workload] = statistics.median(o.metrics.decode_tok_s for o in runs)
        plain_step = statistics.median(o.metrics.decode_s / max(o.metrics.generated_tokens - 1, 1) for o in runs)
        bar.update()
        for proposer, config in proposers:
            for k in ks:
                bar.set_postfix_str(f"{workload}, {proposer} k={k}")
                spec = engine(config(k))
                _generate(spec, tokenizer, text, 4)
                spec.spec.reset()
                out = _generate(spec, tokenizer, text, max_tokens)
                report = spec.spec.report()
                s = report.stats
                kk = s.mean_draft_length or k
                steps = spec.spec.spec_steps
                verify_s = (steps.seconds - spec.spec.propose_s) / steps.steps if steps.steps else 0.0
                if spec.spec.draft is not None:
                    c = spec.spec.draft.pass_s / max(spec.spec.draft.num_passes, 1) / plain_step
                else:
                    c = spec.spec.propose_s / max(steps.steps, 1) / kk / plain_step
                rate = out.metrics.decode_tok_s
                points.append(SpecPoint(workload, kind, proposer, k, rate, plain_rate, rate / plain_rate if plain_rate else 0.0,
                                        s.acceptance_rate, s.mean_acceptance_length, c, verify_s / plain_step,
                                        predicted_speedup(s.acceptance_rate, kk, c), out.token_ids == want))  # fmt: skip
                bar.update(SpecResult(draft, points, plain_rates, notes))
    bar.close()
    return SpecResult(draft, points, plain_rates, notes)


def table(data: dict) -> str:
    head = ["workload", "proposer", "k", "plain tok/s", "spec tok/s", "measured", "predicted", "α", "mean acc. len",
            "c", "r", "same text"]  # fmt: skip
    rows = [[p["workload"], p["proposer"], p["k"], num(p["plain_tok_s"]), num(p["tok_s"]), faster(p["measured_speedup"]),
             faster(p["predicted_speedup"]), num(p["alpha"], 2), num(p["mean_acceptance_length"], 2), num(p["c"], 3),
             num(p["r"], 2), "yes" if p["identical"] else "NO"] for p in data["points"]]  # fmt: skip
    return md_table(head, rows)


def _best(points, proposer, kind):
    chosen = [p for p in points if p["proposer"] == proposer and p["kind"] == kind]
    return max(chosen, key=lambda p: p["measured_speedup"]) if chosen else None


def verdict(data: dict) -> str:
    points = data["points"]
    if not points:
        return "Did not hold: nothing was measured (" + "; ".join(data["notes"]) + ")."
    same = all(p["identical"] for p in points)
    copy, free = _best(points, "ngram", "copying"), _best(points, "ngram", "free")
    draft = _best(points, "draft_model", "copying")
    lookup_wins = copy is not None and copy["measured_speedup"] > 1.1
    parts = [f"prompt lookup at its best on a copying workload ran {faster(copy['measured_speedup'])} "
             f"(k = {copy['k']}, α {num(copy['alpha'], 2)}, {copy['workload']})"]  # fmt: skip
    if free is not None:
        parts.append(f"on the free story {faster(free['measured_speedup'])} (α {num(free['alpha'], 2)})")
    draft_loses = True
    if draft is not None:
        draft_loses = draft["measured_speedup"] < 1.15
        worst_r = max(p["r"] for p in points if p["proposer"] == "draft_model")
        parts.append(f"the draft model at its best {faster(draft['measured_speedup'])} against a predicted "
                     f"{faster(draft['predicted_speedup'])} (k = {draft['k']}, α {num(draft['alpha'], 2)}, c "
                     f"{num(draft['c'], 2)}): each of its k steps costs c of a target step, and a verification "
                     f"pass costs up to {num(worst_r, 2)} plain steps here, not the 1 the formula assumes "
                     f"({SOURCE.short}: 49–62% slower)")  # fmt: skip
    verdict_word = held(same and lookup_wins and draft_loses, same and (lookup_wins or draft_loses))
    tail = "" if same else "; SOME SPECULATIVE ANSWERS DIFFERED FROM PLAIN DECODING"
    return f"{verdict_word}: " + "; ".join(parts) + tail + "."
