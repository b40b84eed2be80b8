"""Speculative decoding against plain decoding, in the same run: decode tok/s, α, mean acceptance length,
the measured cost ratios and the speedup Leviathan's formula predicts beside the measured one.

    .venv/bin/python benchmarks/bench_speculative.py --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b
    .venv/bin/python benchmarks/bench_speculative.py --model smollm2-135m --threads 2 --json

Workloads (greedy, chat template): `copying` asks for a given function back with two names changed
(the answer copies the prompt: prompt lookup's case), `free` for a new story (nothing to copy).
For each proposer — prompt lookup (ngram) and, with --draft, the draft model — and each workload, one
engine without speculation and one with it share the loaded target; runs alternate between them,
after a warm-up each; the measured speedup is the median of each speculative run's rate over the plain
run just before it (tok/s columns: medians). The greedy answers must be equal token for token
(the benchmark stops if not). `--batch 16`: sixteen copying requests in one batch, plain vs ngram,
tokens per second of the whole batch. `--adaptive` adds prompt lookup with adaptive speculation (each
step's k chosen from the step times measured so far, SpecDecoder._step_k).

Cost ratios, measured on the engines' own steps: `c` is one draft step over one plain target decode
step (prompt lookup: its lookup time, ≈ 0); `r` is one verification step's target pass (k + 1 rows of
every speculating request) over one plain decode step. Leviathan's prediction assumes r = 1; the
cost-aware one divides the tokens a round yields by k·c + r.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvlab import LLM, SamplingParams  # noqa: E402
from kvlab.config import EngineConfig  # noqa: E402
from kvlab.engine import LLMEngine  # noqa: E402
from kvlab.lab import speculative as lab_speculative  # noqa: E402
from kvlab.spec_decode.metrics import expected_tokens_per_round  # noqa: E402

# the lab's function to edit, and one more: a longer answer to copy
FUNCTION = lab_speculative.FUNCTION + '''

def count_words(text):
    """Count how often each word occurs in text."""
    counts = {}
    for word in text.lower().split():
        word = word.strip(".,;:!?")
        if word:
            counts[word] = counts.get(word, 0) + 1
    return counts
'''
WORKLOADS = {
    "copying": "Rename merge_sorted to merge_lists and result to merged. Reply with the whole code, nothing else.\n\n"
    + FUNCTION,
    "free": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}
BATCH_EDITS = [("merge_sorted", "merge_lists"), ("count_words", "word_counts"), ("result", "merged"), ("counts", "tally")]


def messages(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def engine_for(llm: LLM, speculative: dict | None) -> LLMEngine:
    config = EngineConfig(max_model_len=4096, speculative_config=speculative)
    return LLMEngine(llm.loaded, llm.tokenizer, config, policy=llm.policy)


def run(llm: LLM, engine: LLMEngine, prompts: list[list[dict]], max_tokens: int) -> tuple[float, list, list]:
    """(tok/s, token ids, outputs): one prompt → its decode tok/s; several → the batch's tokens over its wall time."""
    llm.engine = engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    streams = [llm.chat_stream(m, params) for m in prompts]
    for s in streams:
        s.start()
    outs = [s.finish() for s in streams]
    wall = time.perf_counter() - t0
    tok_s = outs[0].metrics.decode_tok_s if len(outs) == 1 else sum(o.metrics.generated_tokens for o in outs) / wall
    return tok_s, [o.token_ids for o in outs], outs


def compare(llm: LLM, speculative: dict, prompts, max_tokens: int, repeat: int) -> dict:
    plain, spec = engine_for(llm, None), engine_for(llm, speculative)
    run(llm, plain, prompts, 8)  # warm-ups (kernels built, pages touched)
    run(llm, spec, prompts, 8)
    spec.spec.reset()  # counts and timings from the measured runs only
    plain_rates, spec_rates, plain_steps = [], [], []
    for _ in range(repeat):
        rate, want, outs = run(llm, plain, prompts, max_tokens)
        plain_rates.append(rate)
        last = outs[-1].metrics  # the last admitted request decodes after every prompt is in: pure decode steps
        plain_steps.append(last.decode_s / max(last.decode_steps - 1, 1))
        rate, got, _ = run(llm, spec, prompts, max_tokens)
        spec_rates.append(rate)
        if got != want:
            raise SystemExit(f"speculation changed the greedy output ({speculative})")
    report = spec.spec.report()
    s = report.stats
    k = s.mean_draft_length or speculative["num_speculative_tokens"]
    verify_s = (spec.spec.spec_steps.seconds - spec.spec.propose_s) / max(spec.spec.spec_steps.steps, 1)
    plain_s = statistics.median(plain_steps)
    if spec.spec.draft is not None:
        c = spec.spec.draft.pass_s / max(spec.spec.draft.num_passes, 1) / plain_s
    else:
        c = spec.spec.propose_s / max(spec.spec.spec_steps.steps, 1) / k / plain_s
    r = verify_s / plain_s
    tokens = expected_tokens_per_round(s.acceptance_rate, k)
    # each speculative run against the plain run just before it: the machine's drift (other programs on
    # its cores) moves both alike; the median of those ratios
    measured = statistics.median(b / a for a, b in zip(plain_rates, spec_rates))
    return dict(
        speculative=speculative, plain_tok_s=statistics.median(plain_rates), spec_tok_s=statistics.median(spec_rates),
        plain_runs=plain_rates, spec_runs=spec_rates, measured_speedup=measured,
        alpha=s.acceptance_rate, mean_acceptance_length=s.mean_acceptance_length, mean_draft_length=k,
        per_position=s.per_position_acceptance_rate, c=c, r=r, plain_step_s=plain_s, verify_step_s=verify_s,
        predicted_speedup=tokens / (k * c + 1), predicted_speedup_cost_aware=tokens / (k * c + r),
        generated_tokens=sum(len(o.token_ids) for o in outs),
    )  # fmt: skip


def row_costs(llm: LLM, max_rows: int, repeat: int) -> dict[int, float]:
    """A decode pass of one request with 0..max_rows − 1 drafted tokens (1..max_rows decode rows), in seconds
    (the fastest of three, the median over `repeat` sweeps): what a verification costs against one decode."""
    engine = engine_for(llm, None)
    engine.add_request(list(range(100, 164)), SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True))
    for _ in range(3):
        engine.step()
    request = engine.scheduler.running[0]
    seconds: dict[int, list[float]] = {}
    for _ in range(repeat):
        for rows in range(1, max_rows + 1):
            request.spec_token_ids = [5] * (rows - 1)
            inputs = engine.runner.prepare_inputs(engine.scheduler.schedule())
            engine.runner.forward(inputs)
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                engine.runner.forward(inputs)
                times.append(time.perf_counter() - t0)
            seconds.setdefault(rows, []).append(min(times))
            engine.kv.truncate(request, request.num_computed_tokens)  # the drafted slots back to the pool
            request.spec_token_ids = []
    return {rows: statistics.median(v) for rows, v in seconds.items()}


def batch_prompts(n: int) -> list[list[dict]]:
    out = []
    for i in range(n):
        a, b = BATCH_EDITS[i % len(BATCH_EDITS)]
        # the code first: the sixteen prompts share it in the prefix cache, and only the request differs
        out.append(messages(f"{FUNCTION}\nRename {a} to {b} in the code above (request {i}). Reply with the whole code, "
                            "nothing else."))  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--draft", help="a draft model with the same tokenizer (the draft_model rows)")
    ap.add_argument("-k", type=int, default=3, help="num_speculative_tokens of prompt lookup (default 3)")
    ap.add_argument("--adaptive", action="store_true",
                    help="also prompt lookup with adaptive speculation (each step's k from the measured costs)")
    ap.add_argument("--proposers", nargs="+", default=["ngram", "draft_model"], help="which proposers to run")
    ap.add_argument("--draft-k", type=int, default=3, help="num_speculative_tokens of the draft model (default 3)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--batch", type=int, default=16, help="requests of the batch comparison (0: skip it)")
    ap.add_argument("--workloads", nargs="*", default=list(WORKLOADS))
    ap.add_argument("--rows", type=int, default=0, help="first time a decode pass of 1..ROWS rows (the verification's cost)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    llm = LLM(args.model, threads=args.threads, max_model_len=4096)
    costs = {}
    if args.rows:
        costs = row_costs(llm, args.rows, args.repeat)
        print(f"{args.model} decode pass by rows: " + ", ".join(f"{n}: {t * 1000:.1f} ms ({t / costs[1]:.2f})"
                                                             for n, t in costs.items()), file=sys.stderr, flush=True)  # fmt: skip
    proposers = []
    if "ngram" in args.proposers:
        proposers.append(("ngram", {"method": "ngram", "num_speculative_tokens": args.k}))
    if args.adaptive:
        proposers.append(("ngram adaptive", {"method": "ngram", "num_speculative_tokens": args.k, "adaptive": True}))
    if args.draft and "draft_model" in args.proposers:
        proposers.append(("draft_model", {"method": "draft_model", "model": args.draft,
                                          "num_speculative_tokens": args.draft_k}))  # fmt: skip
    rows = []
    for name, speculative in proposers:
        for workload in args.workloads:
            row = compare(llm, speculative, [messages(WORKLOADS[workload])], args.max_tokens, args.repeat)
            row.update(model=args.model, proposer=name, workload=workload, batch=1)
            rows.append(row)
            print(line(row), file=sys.stderr, flush=True)
    for name, speculative in proposers if args.batch else []:
        if not name.startswith("ngram"):
            continue
        row = compare(llm, speculative, batch_prompts(args.batch), args.max_tokens // 2, args.repeat)
        row.update(model=args.model, proposer=name, workload="copying", batch=args.batch)
        rows.append(row)
        print(line(row), file=sys.stderr, flush=True)
    meta = dict(machine=platform.processor() or platform.machine(), threads=llm.policy.threads,
                torch=torch.__version__, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))  # fmt: skip
    if args.json:
        print(json.dumps(dict(meta=meta, rows=rows, pass_seconds_by_rows=costs)))
    else:
        print(table(rows, meta))


def line(row: dict) -> str:
    return (f"{row['model']} {row['proposer']} {row['workload']} batch {row['batch']}: plain {row['plain_tok_s']:.2f}, "
            f"speculative {row['spec_tok_s']:.2f} tok/s → {row['measured_speedup']:.2f}×; α {row['alpha']:.2f}, mean "
            f"acceptance length {row['mean_acceptance_length']:.2f}, c {row['c']:.3f}, r {row['r']:.2f}; predicted "
            f"{row['predicted_speedup']:.2f}× (Leviathan), {row['predicted_speedup_cost_aware']:.2f}× (with r)")  # fmt: skip


def table(rows: list[dict], meta: dict) -> str:
    out = [f"{meta['date']}, {meta['machine']}, {meta['threads']} threads, torch {meta['torch']}", "",
           "| model | proposer | workload | batch | plain tok/s | spec tok/s | measured | α | mean acc. len | c | r | "
           "predicted (Leviathan) | predicted (with r) |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        out.append(f"| {r['model']} | {r['proposer']} | {r['workload']} | {r['batch']} | {r['plain_tok_s']:.2f} | "
                   f"{r['spec_tok_s']:.2f} | {r['measured_speedup']:.2f}× | {r['alpha']:.2f} | "
                   f"{r['mean_acceptance_length']:.2f} | {r['c']:.3f} | {r['r']:.2f} | {r['predicted_speedup']:.2f}× | "
                   f"{r['predicted_speedup_cost_aware']:.2f}× |")  # fmt: skip
    return "\n".join(out)


if __name__ == "__main__":
    main()
