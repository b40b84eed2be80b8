"""Experiment `batching`: what one weight read buys when a pass carries more than one token.

1. Decode steps of B sequences on the path `kvlab serve` uses: the serving engine (LLMEngine) over its
   paged cache, B requests prefilled (untimed), then consecutive steps in which each of the B
   sequences gains one token (one decode row each, not a B-token prompt chunk), run by the decode
   backend where the model takes it (kvlab/backends: each layer one C call), else the modules. Every
   timed step is checked to be exactly B one-token decodes, and which path ran it is counted. The
   verdict compares the 10-sequence step with the 1-sequence step, as the seed did (28 ms for one
   token, 52 ms for ten: 1.9×), and says why the numbers came out so: each step's bytes read (the
   weights it streams, every sequence's K/V) and multiply-adds, as rates, against the read bandwidth a
   plain sum gets here (the roofline experiment's probe), and the multiply-adds against the most a loop of
   FMAs makes here (kernels/probe.c, on the engine's threads and on one): the arithmetic roof, which puts
   a floor under a step of many sequences on the exact path whatever its kernel. Batching is nearly free
   only for a step that waits on memory; one whose read takes a small part of its time pays for each
   sequence's arithmetic.
2. One forward over 1, 2, 4, 8, 16, 32 new tokens of one sequence (from an empty cache): a prompt
   chunk's cost per token, for comparison.
3. N sequences decoding together through the modules (one contiguous cache with batch_size=N, one
   [N, 1] pass per step) against the same N decoded one after another, 4 steps after 16-token prompts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvlab.lab.common import Lab, Timing, forward, greedy
from kvlab.lab.decode_steps import DecodeStepPoint, decode_engine, time_decode_steps
from kvlab.lab.report import faster, held, md_table, num, pct, ratio, spread
from kvlab.lab.roofline import measure_bandwidth, measure_mac_roof
from kvlab.lab.sources import BLOG_POST
from kvlab.quant.activations import activation_setting_of

NAME = "batching"
TITLE = "Batching: many tokens for the price of one weight read"
CLAIM = (
    "A decode step reads every weight to produce one token; the same read can serve many tokens in one "
    "pass, so a pass over N tokens, or over N users' next tokens, costs far less than N single steps."
)
SOURCE = BLOG_POST
MEASURED = "Qwen2.5-0.5B: one token 28 ms, 10 tokens in one pass 52 ms (1.9×)"
SEED_ONE_MS, SEED_TEN_MS = 28.0, 52.0
SEED_SEQUENCES = 10
SEED_RATIO = SEED_TEN_MS / SEED_ONE_MS  # 1.86: the 10-sequence step ÷ the 1-sequence step
NOISE = 0.15  # a ratio this much above the seed's is still within this machine's run-to-run noise
ISSUE_TARGET = (16, 2.5)  # issue 30: a 16-sequence step ≤ 2.5× a 1-sequence step
# a 1-sequence step reading at this share of the bandwidth or more waits on memory: batching rides on its read
MEMORY_BOUND = 0.5

TOKENS = (1, 2, 4, 8, 16, 32)
SEQUENCES, QUICK_SEQUENCES = (1, 2, 4, 8, 16), (1, 2, 4)
PROMPT, QUICK_PROMPT = 16, 4
STEPS, QUICK_STEPS = 4, 2
HEADLINE_TOKENS = 16  # the prompt-chunk sentence compares a pass over this many tokens with a one-token pass
DECODE_BATCHES, QUICK_DECODE_BATCHES = (1, 2, 4, 8, 10, 16, 32), (1, 2, 10)
DECODE_CONTEXT, QUICK_DECODE_CONTEXT = 64, 8  # prompt tokens of each sequence before the timed steps


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
    decode_steps: list[DecodeStepPoint] = field(default_factory=list)  # the serving engine's steps (part 1)
    decode_path: str = ""  # the engine's decode path as it describes it ("decode on c-step", or why not)
    decode_context: int = 0  # prompt tokens of each sequence when the timed steps start
    bandwidth_gb_s: float = 0.0  # a plain sum's read rate on this machine (roofline's probe; 0: not measured)
    # the arithmetic roof: float32 multiply-adds a second an FMA loop reaches, in 1e9 (kernels/probe.py; 0: not
    # measured), on the engine's roof_threads threads and on one
    mac_roof_g: float = 0.0
    mac_roof_one_g: float = 0.0
    roof_threads: int = 0
    activation_quant: str = ""  # the model's --activation-quant setting ("": the exact float32 products)


@torch.inference_mode()
def run(lab: Lab) -> BatchingResult:
    counts = SEQUENCES if not lab.quick else QUICK_SEQUENCES
    batches = QUICK_DECODE_BATCHES if lab.quick else DECODE_BATCHES
    context = QUICK_DECODE_CONTEXT if lab.quick else DECODE_CONTEXT
    result = BatchingResult([], [], decode_context=context)
    bar = lab.progress(2 + len(batches) + len(TOKENS) + len(counts), NAME)
    bar.set_postfix_str("read bandwidth")
    result.bandwidth_gb_s = measure_bandwidth(lab).gb_s
    bar.update(result)
    bar.set_postfix_str("multiply-add rate")
    roof = measure_mac_roof(lab)
    result.roof_threads, result.mac_roof_g, result.mac_roof_one_g = roof.threads, roof.g_mac_s, roof.one_g_mac_s
    result.activation_quant = activation_setting_of(lab.model) or ""
    bar.update(result)
    engine = decode_engine(lab, max(batches), context)
    result.decode_path = engine.decode_path.describe()
    for b in batches:
        bar.set_postfix_str(f"engine decode step of {b} sequences")
        one_s = result.decode_steps[0].step.median_s if result.decode_steps else None
        result.decode_steps.append(time_decode_steps(lab, engine, b, context, one_s))
        bar.update(result)
    del engine
    for n in TOKENS:
        bar.set_postfix_str(f"{n} tokens in one pass")
        cache, ids = lab.new_cache(n), lab.prompt(n)
        timing = lab.measure(lambda: forward(lab.model, cache, ids), setup=lambda: cache.truncate(0))
        one = result.passes[0].timing.median_s if result.passes else timing.median_s
        result.passes.append(PassPoint(n, timing, timing.median_s * 1e3 / n, timing.median_s / one))
        bar.update(result)
    for n in counts:
        bar.set_postfix_str(f"{n} sequences")
        result.sequences.append(decode_sequences(lab, n))
        bar.update(result)
    bar.close()
    result.notes = notes(result, lab.quick)
    return result


def notes(result: BatchingResult, quick: bool) -> list[str]:
    out = [f"engine decode steps: {result.decode_path}; each of the B sequences had a "
           f"{num(result.decode_context)}-token prompt (prefilled untimed, as were the first tokens)"]  # fmt: skip
    mixed = [p.sequences for p in result.decode_steps if p.backend_steps not in (0, p.timed_steps)]
    modules = [p.sequences for p in result.decode_steps if p.backend_steps == 0]
    if modules and "modules" not in result.decode_path:
        out.append(f"the decode backend did not take the step at B = {', '.join(map(str, modules))} "
                   "(the modules ran it: more rows than the kernels' max_kernel_rows?)")  # fmt: skip
    if mixed:
        out.append(f"at B = {', '.join(map(str, mixed))} some steps ran on the backend and some on the modules")
    if not all(p.pure_decode for p in result.decode_steps):
        out.append("some timed engine steps were not pure B-row decode steps: their figures are not comparable")
    out.append(f"sequences: {result.sequences[0].steps if result.sequences else 0} decode steps each after a "
               f"{QUICK_PROMPT if quick else PROMPT}-token prompt (prefilled untimed), through the modules "
               "and a contiguous cache")  # fmt: skip
    if not all(s.same_tokens for s in result.sequences):
        out.append("batched and single passes add their products in a different order (BLAS against the "
                   "GEMV kernel), so a near-tie between two tokens can go either way")  # fmt: skip
    return out


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
    parts = []
    if data.get("decode_steps"):
        rows = [[num(p["sequences"]), spread(p["step"]), num(p["ms_per_token"]), num(p["tok_s"]),
                 ratio(p["relative_cost"]), f"{p['backend_steps']} of {p['timed_steps']}",
                 "yes" if p["pure_decode"] else "no"]
                for p in data["decode_steps"]]  # fmt: skip
        seed = f"{num(SEED_ONE_MS)} → {num(SEED_TEN_MS)} at 10"
        rows.append([f"seed ({SOURCE.short})", seed, "", "", ratio(SEED_RATIO), "", ""])
        head = ["sequences (one token each)", "ms per engine step (min–max)", "ms per token", "tok/s",
                "step cost vs 1 sequence", "steps on the backend", "pure decode steps"]  # fmt: skip
        if all(p.get("read_gb_s") for p in data["decode_steps"]):  # results from before the rates lack them
            head += ["MB read a step", "GB/s read", "G MAC/s"]
            for row, p in zip(rows, data["decode_steps"]):
                row += [num(p["read_bytes"] / 1e6), num(p["read_gb_s"]), num(p["gmac_s"])]
        parts.append(md_table(head, rows))
        if data.get("bandwidth_gb_s"):
            parts[-1] += (f"\n\nA plain sum reads {num(data['bandwidth_gb_s'])} GB/s here. A step reads the "
                          "weights it streams and every sequence's K/V; G MAC/s counts the matrices' "
                          "multiply-adds (B × those of one token).")  # fmt: skip
        if data.get("mac_roof_g"):
            parts[-1] += (f" A loop of float32 FMAs makes {num(data['mac_roof_g'])} G MAC/s here on "
                          f"{data['roof_threads']} threads ({num(data['mac_roof_one_g'])} on one).")  # fmt: skip
    parts.append(md_table(
        ["tokens in the pass", "ms per pass (min–max)", "ms per token", "pass cost vs 1 token"],
        [[num(p["tokens"]), spread(p["timing"]), num(p["ms_per_token"]), ratio(p["relative_cost"])]
         for p in data["passes"]],
    ))  # fmt: skip
    parts.append(md_table(
        ["sequences", "together tok/s", "one at a time tok/s", "together is", "same tokens"],
        [[num(s["sequences"]), num(s["together_tok_s"]), num(s["one_at_a_time_tok_s"]),
          faster(s["speedup"]), "yes" if s["same_tokens"] else "no (see notes)"]
         for s in data["sequences"]],
    ))  # fmt: skip
    return "\n\n".join(parts)


def decode_judgement(points: list[dict]) -> tuple[bool, bool, dict | None]:
    """(held, partly held, the 10-sequence point) from the engine's decode steps. Held: a step of 10
    sequences cost at most the seed's 1.9× a 1-sequence step (plus NOISE), every timed step being 10
    one-token decodes. Partly: it cost under 5×, half of ten single steps. Neither without a 10-point."""
    ten = next((p for p in points if p["sequences"] == SEED_SEQUENCES), None)
    one = next((p for p in points if p["sequences"] == 1), None)
    if ten is None or one is None:
        return False, False, None
    cost = ten["step"]["median_s"] / one["step"]["median_s"]
    pure = ten["pure_decode"] and one["pure_decode"]
    return pure and cost <= SEED_RATIO * (1 + NOISE), pure and cost < SEED_SEQUENCES / 2, ten


def verdict(data: dict) -> str:
    passes, seqs, steps = data["passes"], data["sequences"], data.get("decode_steps") or []
    p = next((x for x in passes if x["tokens"] == HEADLINE_TOKENS), passes[-1]) if passes else None
    chunk = (f"a prompt chunk of {num(p['tokens'])} tokens cost {ratio(p['relative_cost'])} a one-token pass"
             if p else "")  # fmt: skip
    if not steps:  # results from before the engine's decode steps were measured: the old judgement
        s = seqs[-1]
        ok_pass, ok_seq = p["relative_cost"] < p["tokens"] / 2, s["speedup"] > 2 or s["sequences"] < 4
        return (f"{held(ok_pass and ok_seq, ok_pass or ok_seq)}: {chunk}, and {num(s['sequences'])} sequences "
                f"decoding together made {num(s['together_tok_s'])} tok/s against {num(s['one_at_a_time_tok_s'])} "
                f"one at a time ({ratio(s['speedup'])}); no engine decode steps were measured.")  # fmt: skip
    ok, partly, ten = decode_judgement(steps)
    if ten is None:
        return (f"Not judged: no engine decode step of {SEED_SEQUENCES} sequences and of 1 was measured "
                f"({', '.join(str(x['sequences']) for x in steps)}).")  # fmt: skip
    one = next(x for x in steps if x["sequences"] == 1)
    text = (f"{held(ok, partly)}: on the serving engine's path ({data.get('decode_path') or 'decode path unknown'}), "
            f"a decode step of {SEED_SEQUENCES} sequences took {num(ten['step']['median_s'] * 1e3)} ms against "
            f"{num(one['step']['median_s'] * 1e3)} ms for one, {ratio(ten['relative_cost'])} "
            f"({SOURCE.short}: {num(SEED_ONE_MS)} → {num(SEED_TEN_MS)} ms, {ratio(SEED_RATIO)}), "
            f"{num(ten['tok_s'])} tok/s against {num(one['tok_s'])}")  # fmt: skip
    n, target = ISSUE_TARGET
    big = next((x for x in steps if x["sequences"] == n), None)
    if big is not None:
        text += f"; at {n} sequences {ratio(big['relative_cost'])} (issue 30's target ≤ {ratio(target)})"
    if not (ten["pure_decode"] and one["pure_decode"]):
        text += "; some timed steps were not pure decode steps, so the ratio is not judged"
    text += f"; {chunk}." if chunk else "."
    reason = why(data)
    return f"{text} {reason}" if reason else text


def why(data: dict) -> str:
    """Why the steps cost what they did, from the 1-sequence step's read rate against the machine's
    bandwidth: a step that waits on memory carries more sequences on the same read; one whose read is a
    small part of its time pays for each sequence's multiply-adds. "" where the rates were not measured."""
    steps, bandwidth = data.get("decode_steps") or [], data.get("bandwidth_gb_s") or 0.0
    one = next((p for p in steps if p["sequences"] == 1), None)
    if not bandwidth or one is None or not one.get("read_gb_s") or len(steps) < 2:
        return ""
    big = next((p for p in steps if p["sequences"] == ISSUE_TARGET[0]), steps[-1])
    share = one["read_gb_s"] / bandwidth
    read = (f"one sequence's step read {num(one['read_bytes'] / 1e6)} MB at {num(one['read_gb_s'])} GB/s, "
            f"{pct(share)} of the {num(bandwidth)} GB/s a plain sum reads here")  # fmt: skip
    rates = (f"at {big['sequences']} sequences the matrices ran {num(big['gmac_s'])} G MAC/s, "
             f"{ratio(big['gmac_s'] / one['gmac_s'])} one sequence's {num(one['gmac_s'])}")  # fmt: skip
    roof = roof_sentence(data, one, big)
    if share >= MEMORY_BOUND:
        return f"Why: {read}, so it waits on memory and more sequences ride on the same read; {rates}.{roof}"
    return (f"Why: {read}: the read is a small part of the step, whose time goes to arithmetic, and each "
            f"sequence brings its own ({rates}, the step {ratio(big['relative_cost'])}). Batching is nearly "
            f"free only for a step bound by its read.{roof}")  # fmt: skip


def roof_sentence(data: dict, one: dict, big: dict) -> str:
    """What the arithmetic roof says of the big step: on the exact path, the least time its multiply-adds
    take at the roof against the 1-sequence step; with --activation-quant, that the roof does not bind
    (integer or bfloat16 products). "" where the roof was not measured."""
    roof, threads = data.get("mac_roof_g") or 0.0, data.get("roof_threads") or 0
    if not roof or not big.get("gmac_s"):
        return ""
    one_roof = data.get("mac_roof_one_g") or 0.0
    rate = f"{num(roof)} G MAC/s on {threads} thread{'s' if threads > 1 else ''}"
    if threads > 1 and one_roof:
        rate += f" ({num(one_roof)} on one"
        rate += ": the threads shared one core's units)" if roof < 1.5 * one_roof else ")"
    setting = data.get("activation_quant")
    if setting:
        return (f" A loop of float32 FMAs makes {rate} here; the matrices' {num(big['gmac_s'])} G MAC/s are "
                f"{ratio(big['gmac_s'] / roof)} that, as --activation-quant {setting}'s products are integer or "
                "bfloat16 ones, which it does not bound.")  # fmt: skip
    floor_s = big["gmac_s"] * big["step"]["median_s"] / roof  # the step's multiply-adds at the roof
    one_s = one["step"]["median_s"]
    return (f" A loop of float32 FMAs makes {rate} here: the {num(big['gmac_s'] * big['step']['median_s'])} G "
            f"multiply-adds of a {big['sequences']}-sequence step take at least {num(floor_s * 1e3)} ms at that "
            f"rate, {ratio(floor_s / one_s)} the 1-sequence step before any other work, whatever the kernel; the "
            f"matrices ran at {pct(big['gmac_s'] / roof)} of it.")  # fmt: skip
