"""Experiment `phases`: prefill (time to first token) against decode, in tokens per second.

Prefill: one forward over a prompt of 16, 64, 256, 1,024 random tokens into an empty cache.
Decode: 32 greedy steps after a prompt of 64, 512, 1,024 tokens (the prompt is prefilled untimed).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvlab.lab.common import Lab, Timing, time_decode, time_prefill
from kvlab.lab.report import held, md_table, num, ratio, spread
from kvlab.lab.sources import COURSE

NAME = "phases"
TITLE = "Prefill and decode"
CLAIM = (
    "Prefill pushes the whole prompt through the model as one big matrix product, so it is limited by "
    "arithmetic and gets more tokens per second as prompts grow; decode makes one token per pass, is "
    "limited by reading the weights, and runs far fewer tokens per second."
)
SOURCE = COURSE
MEASURED = "Qwen3-0.6B, float32, 8 CPU cores: prefill 54.8 tok/s at 16 tokens and 139.7 at 1,024; decode 8.1 tok/s at context 64"

PREFILL_TOKENS, QUICK_PREFILL_TOKENS = (16, 64, 256, 1024), (4, 8, 16)
DECODE_CONTEXTS, QUICK_DECODE_CONTEXTS = (64, 512, 1024), (8, 16)
DECODE_STEPS, QUICK_DECODE_STEPS = 32, 4


@dataclass
class PrefillPoint:
    prompt_tokens: int
    timing: Timing  # seconds for the whole prompt = time to first token
    tok_s: float  # prompt tokens / median seconds


@dataclass
class DecodePoint:
    context: int  # tokens in the cache when decoding starts
    new_tokens: int
    timing: Timing  # seconds for all `new_tokens` steps
    tok_s: float
    token_ids: list[int]  # the first token (from the prompt's logits) and the decoded ones


@dataclass
class PhasesResult:
    prefill: list[PrefillPoint]
    decode: list[DecodePoint]
    notes: list[str] = field(default_factory=list)


@torch.inference_mode()
def run(lab: Lab) -> PhasesResult:
    prompts, notes = lab.sizes(PREFILL_TOKENS, QUICK_PREFILL_TOKENS)
    steps = QUICK_DECODE_STEPS if lab.quick else DECODE_STEPS
    contexts, decode_notes = lab.sizes(DECODE_CONTEXTS, QUICK_DECODE_CONTEXTS, room=steps)
    result = PhasesResult([], [], notes + decode_notes)
    bar = lab.progress(len(prompts) + len(contexts), NAME)
    for n in prompts:
        bar.set_postfix_str(f"prefill {n}")
        timing = time_prefill(lab, n)
        result.prefill.append(PrefillPoint(n, timing, n / timing.median_s))
        bar.update(result)
    for context in contexts:
        bar.set_postfix_str(f"decode at {context}")
        timing, ids = time_decode(lab, context, steps)
        result.decode.append(DecodePoint(context, steps, timing, steps / timing.median_s, ids))
        bar.update(result)
    bar.close()
    return result


def table(data: dict) -> str:
    hf = data.get("transformers")
    head = ["prompt tokens", "TTFT ms (min–max)", "prefill tok/s"]
    head += ["transformers tok/s", "kvlab ÷ transformers"] if hf else []
    rows = []
    for i, p in enumerate(data["prefill"]):
        row = [num(p["prompt_tokens"]), spread(p["timing"]), num(p["tok_s"])]
        if hf:
            other = hf["prefill"][i]["tok_s"]
            row += [num(other), ratio(p["tok_s"] / other)]
        rows.append(row)
    prefill = md_table(head, rows)
    head = ["context", "new tokens", "ms per token (min–max)", "decode tok/s"]
    head += ["transformers tok/s", "kvlab ÷ transformers"] if hf else []
    rows = []
    for i, d in enumerate(data["decode"]):
        per_token_ms = spread(d["timing"], scale=1e3 / d["new_tokens"])
        row = [num(d["context"]), num(d["new_tokens"]), per_token_ms, num(d["tok_s"])]
        if hf:
            other = hf["decode"][i]["tok_s"]
            row += [num(other), ratio(d["tok_s"] / other)]
        rows.append(row)
    return prefill + "\n\n" + md_table(head, rows)


def verdict(data: dict) -> str:
    prefill, decode = data["prefill"], data["decode"]
    if len(prefill) < 2 or not decode:
        return "Not enough sizes fitted the model or --max-prompt to judge."
    first, last = prefill[0], prefill[-1]
    gain = last["tok_s"] / first["tok_s"]
    gap = last["tok_s"] / decode[0]["tok_s"]
    decode_text = f"{num(decode[0]['tok_s'])} tok/s at context {num(decode[0]['context'])}"
    if len(decode) > 1:
        decode_text += f" and {num(decode[-1]['tok_s'])} at {num(decode[-1]['context'])}"
    return (
        f"{held(gain > 1.2 and gap > 2, gain > 1.2 or gap > 2)}: prefill ran at {num(first['tok_s'])} tok/s "
        f"for {num(first['prompt_tokens'])} tokens and {num(last['tok_s'])} for {num(last['prompt_tokens'])}, "
        f"{ratio(gain)} as many tokens per second ({SOURCE.short} measured 2.5×); decode made {decode_text}, "
        f"{ratio(gap)} fewer tokens per second than the longest prefill."
    )
