"""Experiment `batching`: what one weight read buys when a pass carries more than one token.

1. One forward over 1, 2, 4, 8, 16, 32 new tokens of one sequence (from an empty cache): cost per token.
2. N sequences decoding together (one cache with batch_size=N, one [N, 1] pass per step) against the
   same N sequences decoded one after another (N caches of batch 1), 4 steps after 16-token prompts.
kvlab's linear layers use a GEMV kernel up to 8 rows and the BLAS matrix product beyond, so the cost
curve can bend at 8.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvlab.lab.common import Lab, Timing, forward, greedy
from kvlab.lab.report import faster, held, md_table, num, ratio, spread
from kvlab.lab.sources import BLOG_POST

NAME = "batching"
TITLE = "Batching: many tokens for the price of one weight read"
CLAIM = (
    "A decode step reads every weight to produce one token; the same read can serve many tokens in one "
    "pass, so a pass over N tokens, or over N users' next tokens, costs far less than N single steps."
)
SOURCE = BLOG_POST
MEASURED = "Qwen2.5-0.5B: one token 28 ms, 10 tokens in one pass 52 ms (1.9×)"

TOKENS = (1, 2, 4, 8, 16, 32)
SEQUENCES, QUICK_SEQUENCES = (1, 2, 4, 8, 16), (1, 2, 4)
PROMPT, QUICK_PROMPT = 16, 4
STEPS, QUICK_STEPS = 4, 2
HEADLINE_TOKENS = 16  # the verdict compares a pass over this many tokens with a single-token pass


@dataclass
class PassPoint:
    tokens: int  # new tokens in the pass
    timing: Timing  # seconds per pass
    ms_per_token: float
    relative_cost: float  # pass time ÷ the one-token pass's time


@dataclass
class SequencePoint:
    sequences: int
    steps: int  # decode steps per sequence
    together: Timing  # seconds for `steps` batched steps
    one_at_a_time: Timing  # seconds for the N sequences' `steps` steps, one sequence after another
    together_tok_s: float
    one_at_a_time_tok_s: float
    speedup: float
    same_tokens: bool  # batched and one-at-a-time decoding chose the same tokens


@dataclass
class BatchingResult:
    passes: list[PassPoint]
    sequences: list[SequencePoint]
    notes: list[str] = field(default_factory=list)


@torch.inference_mode()
def run(lab: Lab) -> BatchingResult:
    counts = SEQUENCES if not lab.quick else QUICK_SEQUENCES
    bar = lab.progress(len(TOKENS) + len(counts), NAME)
    passes: list[PassPoint] = []
    for n in TOKENS:
        bar.set_postfix_str(f"{n} tokens in one pass")
        cache, ids = lab.new_cache(n), lab.prompt(n)
        timing = lab.measure(lambda: forward(lab.model, cache, ids), setup=lambda: cache.truncate(0))
        one = passes[0].timing.median_s if passes else timing.median_s
        passes.append(PassPoint(n, timing, timing.median_s * 1e3 / n, timing.median_s / one))
        bar.update(BatchingResult(passes, []))
    sequences = []
    for n in counts:
        bar.set_postfix_str(f"{n} sequences")
        sequences.append(decode_sequences(lab, n))
        bar.update(BatchingResult(passes, sequences))
    bar.close()
    notes = [f"sequences: {sequences[0].steps} decode steps each after a "
             f"{QUICK_PROMPT if lab.quick else PROMPT}-token prompt (prefilled untimed)"]  # fmt: skip
    if not all(s.same_tokens for s in sequences):
        notes.append("batched and single passes add their products in a different order (BLAS against the "
                     "GEMV kernel), so a near-tie between two tokens can go either way")  # fmt: skip
    return BatchingResult(passes, sequences, notes)


def decode_sequences(lab: Lab, n: int) -> SequencePoint:
    prompt, steps = (QUICK_PROMPT, QUICK_STEPS) if lab.quick else (PROMPT, STEPS)
    prompts = lab.prompt(prompt, batch=n)  # [N, P]: a different prompt per sequence
    batch = lab.new_cache(prompt + steps, batch=n)
    first = forward(lab.model, batch, prompts).argmax(-1, keepdim=True)  # [N, 1]
    singles = [lab.new_cache(prompt + steps) for _ in range(n)]
    firsts = [forward(lab.model, c, prompts[i : i + 1]).argmax(-1, keepdim=True) for i, c in enumerate(singles)]
    out: dict[str, torch.Tensor] = {}

    def together():
        out["together"] = greedy(lab.model, batch, first, steps)  # [N, steps]

    def one_at_a_time():
        out["single"] = torch.cat([greedy(lab.model, c, f, steps) for c, f in zip(singles, firsts)])

    def rewind():
        for c in [batch, *singles]:
            c.truncate(prompt)

    t_together = lab.measure(together, setup=rewind)
    t_single = lab.measure(one_at_a_time, setup=rewind)
    tokens = n * steps
    same = torch.equal(first, torch.cat(firsts)) and torch.equal(out["together"], out["single"])
    return SequencePoint(n, steps, t_together, t_single, tokens / t_together.median_s,
                         tokens / t_single.median_s, t_single.median_s / t_together.median_s, same)  # fmt: skip


def table(data: dict) -> str:
    passes = md_table(
        ["tokens in the pass", "ms per pass (min–max)", "ms per token", "pass cost vs 1 token"],
        [[num(p["tokens"]), spread(p["timing"]), num(p["ms_per_token"]), ratio(p["relative_cost"])]
         for p in data["passes"]],
    )  # fmt: skip
    sequences = md_table(
        ["sequences", "together tok/s", "one at a time tok/s", "together is", "same tokens"],
        [[num(s["sequences"]), num(s["together_tok_s"]), num(s["one_at_a_time_tok_s"]),
          faster(s["speedup"]), "yes" if s["same_tokens"] else "no (see notes)"]
         for s in data["sequences"]],
    )  # fmt: skip
    return passes + "\n\n" + sequences


def verdict(data: dict) -> str:
    passes, seqs = data["passes"], data["sequences"]
    p = next((x for x in passes if x["tokens"] == HEADLINE_TOKENS), passes[-1])
    s = seqs[-1]
    ok_pass, ok_seq = p["relative_cost"] < p["tokens"] / 2, s["speedup"] > 2 or s["sequences"] < 4
    return (
        f"{held(ok_pass and ok_seq, ok_pass or ok_seq)}: one pass over {num(p['tokens'])} tokens cost "
        f"{ratio(p['relative_cost'])} a single-token pass, {ratio(p['tokens'] / p['relative_cost'])} cheaper per "
        f"token ({SOURCE.short}: 10 tokens for 1.9× one), and {num(s['sequences'])} sequences decoding together made "
        f"{num(s['together_tok_s'])} tok/s against {num(s['one_at_a_time_tok_s'])} one at a time "
        f"({ratio(s['speedup'])})."
    )
