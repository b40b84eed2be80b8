"""`kvlab check`'s runs (check.py): each path decodes the same prompts greedily, its logits recorded.

    Run = {prompt index: (generated token ids, logits rows [steps, V])}
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from kvlab.config import EngineConfig
from kvlab.engine import LLMEngine
from kvlab.kernels import ThreadPolicy
from kvlab.model.loader import load_model
from kvlab.quality.text import text_ids
from kvlab.reference import ReferenceEngine
from kvlab.sampling import SamplingParams
from kvlab.tokenizer import load_tokenizer

Run = dict[int, tuple[list[int], torch.Tensor]]
BATCHES = (1, 16)  # batch sizes each path runs at (the prompts together, or one at a time)


@dataclass
class Comparison:
    path: str  # "modules", "cpu-c"
    kv: str
    batch: int
    against: str  # what it was compared with
    agree: bool  # the greedy tokens of every prompt
    first_difference: int | None  # the earliest position (generated token) where some prompt's differ
    max_logit_diff: float  # largest |Δ logit| before the first difference

    def row(self) -> str:
        tokens = "same" if self.agree else f"differ from token {self.first_difference}"
        return (f"  {self.path:8} {self.kv:9} {self.batch:5}   {self.against:22} {tokens:24} "
                f"{self.max_logit_diff:.2e}")  # fmt: skip


def run_checks(args, formats: list[str]) -> list[Comparison]:
    from kvlab import hub

    loaded = load_model(hub.resolve_model(str(args.model)), dtype="auto", device=args.device)
    threads = args.threads or torch.get_num_threads()
    prompts = _prompts(loaded, args.num_prompts, args.prompt_tokens)
    length = args.prompt_tokens + args.max_tokens + 1
    dtype = str(loaded.model.dtype).removeprefix("torch.")
    reference = _reference(loaded, prompts, args.max_tokens, threads)
    comparisons, notes = [], []
    backend_reason = None
    for kv in formats:
        lossy = kv != dtype  # not the activations' own numbers: the backend is held against the modules
        for batch in sorted({min(b, len(prompts)) for b in BATCHES}):
            runs = {}
            for path, fused in (("modules", False), ("cpu-c", True)):
                engine = _engine(loaded, kv, length, len(prompts), ThreadPolicy(threads=threads, fused_decode=fused))
                if fused and engine.decode_path.backend is None:
                    backend_reason = engine.decode_path.reason
                    continue
                runs[path] = _serve(engine, prompts, args.max_tokens, batch)
                against = ("modules " + kv, runs["modules"]) if lossy and path == "cpu-c" else ("reference", reference)
                if lossy and path == "modules":
                    continue  # the format's own loss: kvlab quality measures it
                comparisons.append(_compare(path, kv, batch, against[0], runs[path], against[1]))
            print(f"kvlab check: {kv} at batch {batch} done", file=sys.stderr, flush=True)
    if backend_reason:
        notes.append(f"cpu-c: not run here: {backend_reason}")
    title = (f"kvlab check {args.model}: {len(prompts)} prompts × {args.max_tokens} greedy tokens "
             f"({args.prompt_tokens}-token prompts of Python's sources), {dtype} activations, {threads} threads")  # fmt: skip
    print_table(title, comparisons, notes)
    return comparisons


def _prompts(loaded, n: int, tokens: int) -> list[list[int]]:
    tokenizer = load_tokenizer(loaded)
    if tokenizer is None:  # a directory without a tokenizer: random ids, the same every run
        g = torch.Generator().manual_seed(0)
        return [torch.randint(3, loaded.config.vocab_size, (tokens,), generator=g).tolist() for _ in range(n)]
    ids, _ = text_ids(tokenizer, n * tokens)
    return [ids[i * tokens : (i + 1) * tokens] for i in range(n)]


def _reference(loaded, prompts: list[list[int]], steps: int, threads: int) -> Run:
    """The single-sequence oracle, one prompt at a time, its logits kept."""
    engine = ReferenceEngine(loaded, policy=ThreadPolicy(threads=threads))
    out: Run = {}
    for i, prompt in enumerate(prompts):
        session = engine.new_session(len(prompt) + steps + 1)
        logits = engine.forward(prompt, session.cache)
        tokens, rows = [], []
        for _ in range(steps):
            rows.append(logits.float())
            tokens.append(int(logits.argmax()))
            logits = engine.forward([tokens[-1]], session.cache)
        out[i] = (tokens, torch.stack(rows))
    return out


def _engine(loaded, kv: str, length: int, num_prompts: int, policy: ThreadPolicy) -> LLMEngine:
    from kvlab.kv.paged import PagedKVCache

    per_token = PagedKVCache.bytes_per_token_for(loaded.config, torch.float32)  # the largest format's: a bound
    config = EngineConfig(max_model_len=length + 16, kv_memory_bytes=per_token * (length + 32) * num_prompts,
                          max_num_seqs=num_prompts, enable_prefix_caching=False, kv_cache_dtype=kv)  # fmt: skip
    return LLMEngine(loaded, None, config, policy=policy)


def _serve(engine: LLMEngine, prompts: list[list[int]], steps: int, batch: int) -> Run:
    """Greedy tokens of every prompt, `batch` requests at a time, with each request's logits rows."""
    rows: dict[str, list[torch.Tensor]] = {}
    forward = engine.runner.forward

    def recording(inputs):
        logits = forward(inputs)
        for i, request in enumerate(inputs.sampling):
            rows.setdefault(request.request_id, []).append(logits[i].float().clone())
        return logits

    engine.runner.forward = recording
    greedy = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)
    out: Run = {}
    for lo in range(0, len(prompts), batch):
        ids = {engine.add_request(p, greedy): lo + j for j, p in enumerate(prompts[lo : lo + batch])}
        while engine.has_unfinished_requests:
            for o in engine.step():
                if o.finished:
                    out[ids[o.request_id]] = (list(o.output.token_ids), torch.stack(rows.pop(o.request_id)))
    return out


def _compare(path: str, kv: str, batch: int, against: str, mine: Run, theirs: Run) -> Comparison:
    first, worst = None, 0.0
    for i, (tokens, logits) in mine.items():
        ref_tokens, ref_logits = theirs[i]
        same = next((j for j, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), None)
        upto = len(tokens) if same is None else same + 1  # the first differing position's logits still compare
        worst = max(worst, float((logits[:upto] - ref_logits[:upto]).abs().max()))
        if same is not None:
            first = same if first is None else min(first, same)
    return Comparison(path, kv, batch, against, first is None, first, worst)


def print_table(title: str, comparisons: list[Comparison], notes: list[str], file=None) -> None:
    file = file or sys.stdout
    print(title, file=file)
    print(f"  {'path':8} {'KV':9} {'batch':>5}   {'against':22} {'greedy tokens':24} max |Δ logit|", file=file)
    for c in comparisons:
        print(c.row(), file=file)
    for note in notes:
        print(f"  {note}", file=file)
    if any(c.against.startswith("modules") for c in comparisons):
        print("  (with a lossy format a last-bit difference upstream can round a stored code the other way: the "
              "logits may differ by a code's worth; the tokens must agree)", file=file)  # fmt: skip
    bad = [c for c in comparisons if not c.agree]
    print(f"  {'every path agrees' if not bad else f'{len(bad)} comparison(s) differ'}", file=file)
