"""The reference and the chosen settings over the same token windows, position by position.

    for each window of up to `window` tokens (a fresh cache each, [BOS] first when the model wants it):
        for each chunk of `chunk` tokens (or a first   the cache carries everything before the chunk
        one of `chunk`, then chunks of `then`):
            reference logits [T, V]                   float32 KV, the model's own weights
            each candidate's logits [T, V]            its own model (when the weights differ) and cache
            per position: KL(p_ref ‖ p), top tokens equal?, −log p(next token) under both

Feeding a window in chunks through the cache is what decode does: every position attends to keys and
values that went through the cache's format (its own included, written before they are read), so a
quantized cache's error reaches every position as it would while generating. The statistics are
llama.cpp's `--kl-divergence` ones: mean, median, 99th percentile and maximum KLD, the share of
positions whose most likely token is the same ("same top p"), and perplexity under both.

The verdict's thresholds (see docs/quality.md for where they come from):
    ok       mean KLD ≤ 0.005 and same top ≥ 97 %   about q6_K weights on LLaMA-3-8B, or better
    caution  mean KLD ≤ 0.03  and same top ≥ 90 %   up to Q4_K_M weights' loss (KLD ≈ 0.03)
    unsafe   anything worse (q4_0 weights on LLaMA-3-8B: 0.072)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from kvlab.kernels import ThreadPolicy
from kvlab.kv.cache import ContiguousKVCache
from kvlab.kv.formats import KVFormats
from kvlab.runner.driver import ModelDriver

OK_MEAN_KLD, OK_SAME_TOP = 0.005, 0.97
CAUTION_MEAN_KLD, CAUTION_SAME_TOP = 0.03, 0.90
SCORE_ROWS = 128  # positions scored at once (float64 log-softmax over the vocabulary)


def verdict(mean_kld: float, same_top_p: float) -> str:
    if mean_kld <= OK_MEAN_KLD and same_top_p >= OK_SAME_TOP:
        return "ok"
    if mean_kld <= CAUTION_MEAN_KLD and same_top_p >= CAUTION_SAME_TOP:
        return "caution"
    return "unsafe"


@dataclass
class Candidate:
    """One setting to measure: a model (its weights as loaded) and the formats of its cache."""

    name: str
    loaded: object  # kvlab.model.loader.LoadedModel
    formats: KVFormats
    policy: ThreadPolicy | None = None
    driver: ModelDriver = field(init=False)

    def __post_init__(self):
        self.driver = ModelDriver(self.loaded.model, self.policy)

    def new_cache(self, length: int) -> ContiguousKVCache:
        model = self.loaded.model
        return ContiguousKVCache.for_model(self.loaded.config, length, dtype=model.dtype, device=model.device,
                                           formats=self.formats)  # fmt: skip

    def logits(self, ids: list[int], cache: ContiguousKVCache) -> torch.Tensor:
        """ids appended to the cache: float32 logits [T, V] of every one of them."""
        device = self.loaded.model.device
        x = torch.tensor([ids], dtype=torch.long, device=device)
        every = torch.arange(len(ids), device=device)
        return self.driver.run(x, cache, logits_index=every)[0].float()


@dataclass
class QualityResult:
    setting: str
    tokens: int  # positions scored
    mean_kld: float
    median_kld: float
    p99_kld: float
    max_kld: float
    same_top_p: float
    ppl_ref: float
    ppl: float
    seconds: float
    verdict: str

    def to_dict(self) -> dict:
        return asdict(self)


class _Tally:
    def __init__(self):
        self.kld: list[torch.Tensor] = []
        self.same = 0
        self.nll = 0.0

    def add(self, ref_logp: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> None:
        logp = torch.log_softmax(logits.double(), dim=-1)
        self.kld.append((ref_logp.exp() * (ref_logp - logp)).sum(-1).float())
        self.same += int((ref_logp.argmax(-1) == logp.argmax(-1)).sum())
        self.nll -= float(logp.gather(-1, targets[:, None]).sum())


def windows_of(ids: list[int], window: int, bos: int | None) -> list[list[int]]:
    """The text cut into windows of `window` tokens ([bos] + window − 1 text tokens when bos is given)."""
    step = window - (bos is not None)
    out = []
    for start in range(0, len(ids), step):
        piece = ([bos] if bos is not None else []) + ids[start : start + step]
        if len(piece) >= 2:  # at least one position with a next token to score
            out.append(piece)
    return out


def passes(length: int, chunk: int, then: int | None = None) -> list[tuple[int, int]]:
    """(start, end) of the passes a window of `length` tokens is fed in: `chunk` tokens at a time; with
    `then`, a first pass of `chunk` (a prompt) and then passes of `then` tokens (a decode's size, where a
    setting computes a pass's rows by its size: --activation-quant's bfloat16 prompt passes)."""
    bounds = [0, min(chunk, length)]
    while bounds[-1] < length:
        bounds.append(min(bounds[-1] + (then or chunk), length))
    return list(zip(bounds, bounds[1:]))


def measure(
    reference: Candidate,
    candidates: list[Candidate],
    ids: list[int],
    window: int = 2048,
    chunk: int = 512,
    bos: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    then: int | None = None,
) -> list[QualityResult]:
    """Each candidate against the reference over `ids`; one result per candidate, in order. Each window is
    fed in `passes(len, chunk, then)`."""
    started = time.perf_counter()
    pieces = windows_of(ids, window, bos)
    tallies = [_Tally() for _ in candidates]
    ref_nll, scored = 0.0, 0
    for w, piece in enumerate(pieces):
        ref_cache = reference.new_cache(len(piece))
        caches = [c.new_cache(len(piece)) for c in candidates]
        for c0, c1 in passes(len(piece), chunk, then):
            part = piece[c0:c1]
            targets = torch.tensor(piece[c0 + 1 : c0 + 1 + len(part)], device=reference.loaded.model.device)
            m = len(targets)  # the window's last position has no next token to score
            ref_logits = reference.logits(part, ref_cache)[:m]
            outs = [c.logits(part, cache)[:m] for c, cache in zip(candidates, caches)]
            for r0 in range(0, m, SCORE_ROWS):
                rows = slice(r0, r0 + SCORE_ROWS)
                ref_logp = torch.log_softmax(ref_logits[rows].double(), dim=-1)
                ref_nll -= float(ref_logp.gather(-1, targets[rows, None]).sum())
                for tally, logits in zip(tallies, outs):
                    tally.add(ref_logp, logits[rows].to(ref_logp.device), targets[rows])
            scored += m
        if progress is not None:
            progress(w + 1, len(pieces))
    seconds = time.perf_counter() - started
    results = []
    for cand, tally in zip(candidates, tallies):
        kld = torch.cat(tally.kld) if tally.kld else torch.zeros(1)
        mean, same = float(kld.mean()), tally.same / max(scored, 1)
        results.append(QualityResult(
            setting=cand.name, tokens=scored, mean_kld=mean, median_kld=float(kld.median()),
            p99_kld=float(torch.quantile(kld.double(), 0.99)), max_kld=float(kld.max()), same_top_p=same,
            ppl_ref=math.exp(ref_nll / max(scored, 1)), ppl=math.exp(tally.nll / max(scored, 1)),
            seconds=seconds, verdict=verdict(mean, same),
        ))  # fmt: skip
    return results
