"""What the OpenAI API's features cost on this machine, side by side in one run (issues 15 and 16).

    .venv/bin/python benchmarks/bench_api.py --model smollm2-135m --threads 2 --repeat 5 --json api.json

  1. sampling      decode tok/s of one request, greedy against temperature 0.8 + top-p 0.95 (issue 15's
                   target: within 5%), alternating run by run; and the engine's sample phase per step
  2. the sampler   BatchSampler.sample alone on 64 logits rows the model produced: µs per token for
                   steps of 1 and 16 rows, greedy, temperature + top-p, with penalties and logit_bias
  3. grammar       decode tok/s with and without a json_schema response format (the llguidance mask)
  4. n = 8         one request with n=8 against 8 separate requests (same prompt, submitted together):
                   prompt tokens through the model and wall time

Medians over --repeat (min–max beside them); a warm-up run of each kind is excluded.
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

from kvlab import LLM
from kvlab.sampling.params import SamplingParams, StructuredOutputs
from kvlab.sampling.sampler import BatchSampler

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
          "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "age", "tags"]}  # fmt: skip
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def stats(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def show(name: str, s: dict, unit: str) -> None:
    print(f"  {name:<44} {s['median']:10.2f} {unit}  ({s['min']:.2f}–{s['max']:.2f})")


def decode_rates(llm: LLM, kinds: dict[str, SamplingParams], repeat: int, prompt=PROMPT) -> dict:
    """Each kind once per round, in turn (so drift in the machine's load hits every kind alike)."""
    rates = {k: [] for k in kinds}
    sample_ms = {k: [] for k in kinds}
    for r in range(repeat + 1):
        for kind, params in kinds.items():
            stats_ = llm.engine.stats
            before_s, before_n = stats_.phase_seconds["sample"], stats_.steps
            out = llm.generate(prompt, params)
            if r:  # round 0 warms up
                rates[kind].append(out.decode_tok_s)
                sample_ms[kind].append((stats_.phase_seconds["sample"] - before_s) / (stats_.steps - before_n) * 1e3)
    return {k: {"decode_tok_s": stats(rates[k]), "sample_ms_per_step": stats(sample_ms[k])} for k in kinds}


class _Row:
    """What the sampler reads of a request."""

    def __init__(self, rid: str, params: SamplingParams):
        self.request_id, self.params, self.prompt_token_ids = rid, params, []
        self.index, self.fork_ids, self.num_output_tokens = 0, (), 0


def model_rows(llm: LLM, n: int = 64) -> torch.Tensor:
    """[n, V] logits rows the model really produced (a sampled answer's decode steps)."""
    rows, sampler = [], llm.engine.runner.sampler
    original = sampler.sample

    def keep(requests, logits):
        rows.append(logits.clone())
        return original(requests, logits)

    sampler.sample = keep
    try:
        llm.generate(PROMPT, SamplingParams(max_tokens=n, temperature=0.8, top_p=0.95, seed=0, ignore_eos=True))
    finally:
        sampler.sample = original
    return torch.cat(rows)


def sampler_cost(rows: torch.Tensor, repeat: int) -> dict:
    """BatchSampler.sample on the model's own logits rows, one thread, caches evicted between calls (as a
    forward leaves them): µs per token, for a step of 1 and of 16 requests."""
    torch.set_num_threads(1)  # the engine samples under its thread policy: one thread for a few rows
    kinds = {
        "greedy": SamplingParams(temperature=0),
        "temperature 0.8 + top-p 0.95": SamplingParams(temperature=0.8, top_p=0.95, seed=0),
        "+ penalties and logit_bias": SamplingParams(temperature=0.8, top_p=0.95, seed=0, presence_penalty=0.5,
                                                     frequency_penalty=0.5, logit_bias={1: 5.0, 2: -100.0}),
    }  # fmt: skip
    junk = torch.randn(4_000_000)  # 16 MB: more than the caches
    out = {}
    for size in (1, 16):
        for kind, params in kinds.items():
            sampler = BatchSampler(rows.shape[1])
            reqs = [_Row(f"r{i}", params) for i in range(size)]
            times = []
            for _ in range(repeat):
                for start in range(0, rows.shape[0] - size + 1, size):
                    batch = rows[start : start + size].clone()
                    junk.mul_(1.0)
                    t0 = time.perf_counter()
                    sampler.sample(reqs, batch)
                    times.append((time.perf_counter() - t0) / size * 1e6)
            out[f"{size} rows, {kind}"] = stats(times)
    return out


def n_against_separate(llm: LLM, repeat: int, n: int = 8) -> dict:
    prompt = llm.encode(PROMPT * 8)  # ~150 tokens
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=1, ignore_eos=True)
    eng = llm.engine
    result = {
        "n": {"wall_s": [], "prompt_tokens_computed": []},
        "separate": {"wall_s": [], "prompt_tokens_computed": []},
    }
    for r in range(repeat + 1):
        for kind in ("n", "separate"):
            before = eng.stats.step_tokens
            t0 = time.perf_counter()
            salt = f"run-{r}-{kind}"  # every run misses the prefix cache
            if kind == "n":
                eng.add_request(prompt, SamplingParams(**{**params.__dict__, "n": n}), cache_salt=salt)
            else:
                for i in range(n):
                    eng.add_request(prompt, SamplingParams(**{**params.__dict__, "seed": 1 + i}), cache_salt=salt)
            while eng.has_unfinished_requests:
                eng.step()
            wall = time.perf_counter() - t0
            if r:
                result[kind]["wall_s"].append(wall)
                result[kind]["prompt_tokens_computed"].append(eng.stats.step_tokens - before - n * 15)
    return {k: {m: stats(v) for m, v in d.items()} for k, d in result.items()} | {"prompt_tokens": len(prompt)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    llm = LLM(args.model, threads=args.threads, max_model_len=2048)
    m = args.max_tokens
    report = {"machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads",
              "command": " ".join(sys.argv), "model": args.model}  # fmt: skip
    print(f"kvlab API features, {args.model}, {args.threads} threads, medians of {args.repeat}")
    kinds = {"greedy": SamplingParams(max_tokens=m, temperature=0, ignore_eos=True),
             "temperature 0.8 + top-p 0.95": SamplingParams(max_tokens=m, temperature=0.8, top_p=0.95, seed=0, ignore_eos=True)}  # fmt: skip
    report["sampling"] = decode_rates(llm, kinds, args.repeat)
    print("1. sampling: decode tok/s")
    for k, v in report["sampling"].items():
        show(k, v["decode_tok_s"], "tok/s")
        show(f"  sample phase per step ({k})", v["sample_ms_per_step"], "ms")
    g, s = (report["sampling"][k]["decode_tok_s"]["median"] for k in kinds)
    print(f"  sampled / greedy: {s / g:.3f}")
    report["sampler_us_per_token"] = sampler_cost(model_rows(llm), args.repeat)
    print("2. the sampler alone, µs per token")
    for k, v in report["sampler_us_per_token"].items():
        show(k, v, "µs")
    grammar = {
        "no format": SamplingParams(max_tokens=m, temperature=0),
        "json_schema": SamplingParams(max_tokens=m, temperature=0, structured_outputs=StructuredOutputs(json=SCHEMA)),
    }
    ask = {"prompt_token_ids": llm.encode_chat([{"role": "user", "content": "Describe a person as a JSON object "
                                                 "with a name, an age and a list of tags."}])}  # fmt: skip
    report["grammar"] = decode_rates(llm, grammar, args.repeat, ask)
    print("3. structured output: decode tok/s")
    for k, v in report["grammar"].items():
        show(k, v["decode_tok_s"], "tok/s")
        show(f"  sample phase per step ({k})", v["sample_ms_per_step"], "ms")
    report["n8"] = n_against_separate(llm, args.repeat)
    print(f"4. n=8 against 8 requests ({report['n8']['prompt_tokens']} prompt tokens, 16 out each)")
    for k in ("n", "separate"):
        show(f"{k}: prompt tokens through the model", report["n8"][k]["prompt_tokens_computed"], "")
        show(f"{k}: wall time", report["n8"][k]["wall_s"], "s")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
