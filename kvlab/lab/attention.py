"""Experiment `attention`: prefill with materialised scores against PyTorch's fused SDPA.

Both backends prefill the same prompt of 1,000, 4,000 and 8,000 tokens (see kvlab.model.attention).
Recorded per run: time, the size of one layer's [H, T, T] score matrix, the peak memory, and the
largest difference between the two backends' logits (at the first, middle and last positions).

Peak memory is the highest resident set size (RSS) above the level just before the pass, read from
/proc/self/statm every millisecond by a background thread (PyTorch releases the GIL while it computes);
free heap pages are returned to the OS first (malloc_trim), so reused memory counts too.
A length is skipped for the materialised backend when one score matrix would take more than a third
of the free RAM.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from dataclasses import dataclass, field

import torch

from kvlab.lab.common import Lab, Timing, forward, meminfo_bytes
from kvlab.lab.report import faster, held, md_table, num, ratio, spread
from kvlab.lab.sources import BLOG_POST
from kvlab.model.attention import score_matrix_bytes

NAME = "attention"
TITLE = "Long prompts: materialised attention against fused SDPA"
CLAIM = (
    "Textbook attention builds the whole [heads × tokens × tokens] score matrix, so at long prompts "
    "its time and memory explode; fused attention works tile by tile and never holds the matrix, so it "
    "stays far faster while computing the same result."
)
SOURCE = BLOG_POST
MEASURED = "Qwen2.5-0.5B: 843 vs 634 ms at 1,000 tokens, 87,942 vs 8,709 ms at 8,000 (10×); logits within 0.0001"

LENGTHS, QUICK_LENGTHS = (1000, 4000, 8000), (16, 32)
BACKENDS = ("sdpa", "materialized")


class PeakRSS:
    """`with PeakRSS() as p: ...` → p.delta_bytes: the highest RSS seen inside, minus RSS at entry."""

    def __init__(self, interval_s: float = 0.001):
        self.interval_s = interval_s
        self.base = self.peak = 0
        self._stop = threading.Event()

    @staticmethod
    def rss_bytes() -> int:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            return 0  # not Linux: no sampling, the delta stays 0

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss_bytes())
            time.sleep(self.interval_s)

    @staticmethod
    def release_free_memory() -> None:
        """Hand the allocator's free pages back to the OS (glibc's malloc_trim), so that memory freed
        by earlier passes and reused now shows up as new RSS instead of hiding in the baseline."""
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass  # not glibc: the baseline may hide reused memory

    def __enter__(self) -> "PeakRSS":
        self.release_free_memory()
        self.base = self.peak = self.rss_bytes()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss_bytes())

    @property
    def delta_bytes(self) -> int:
        return self.peak - self.base


@dataclass
class BackendRun:
    timing: Timing  # seconds per prefill
    peak_rss_delta_bytes: int  # highest over the runs


@dataclass
class AttentionPoint:
    prompt_tokens: int
    score_matrix_bytes: int  # one layer's [1, H, T, T] scores in the model's dtype
    sdpa: BackendRun | None
    materialized: BackendRun | None  # None when skipped for memory
    max_logit_diff: float | None  # largest |sdpa − materialized| over the compared positions
    speedup: float | None  # materialized time ÷ SDPA time


@dataclass
class AttentionResult:
    points: list[AttentionPoint]
    notes: list[str] = field(default_factory=list)


@torch.inference_mode()
def run(lab: Lab) -> AttentionResult:
    lengths, notes = lab.sizes(LENGTHS, QUICK_LENGTHS)
    points = []
    bar = lab.progress(len(lengths) * len(BACKENDS), NAME)
    try:
        for n in lengths:
            points.append(measure_length(lab, n, bar, notes))
            bar.save(AttentionResult(points, notes))
    finally:
        lab.model.set_attention("sdpa")
        bar.close()
    notes.append("peak memory: the highest resident memory (RSS) above its level just before the pass, "
                 "sampled every 1 ms after returning free heap pages to the OS; the largest of the runs")  # fmt: skip
    return AttentionResult(points, notes)


def measure_length(lab: Lab, n: int, bar, notes: list[str]) -> AttentionPoint:
    c = lab.config
    scores = score_matrix_bytes(c.num_heads, n, n, lab.model.dtype)
    ids, cache = lab.prompt(n), lab.new_cache(n)
    for t in cache.k + cache.v:
        t.fill_(0)  # touch the cache's pages now, so they do not count towards a run's peak
    positions = torch.tensor(sorted({0, n // 2, n - 1}), device=ids.device)
    runs, logits = {}, {}
    for backend in BACKENDS:
        bar.set_postfix_str(f"{backend} {n}")
        free = meminfo_bytes("MemAvailable")
        if backend == "materialized" and free and scores > free / 3:
            notes.append(f"materialized skipped at {n:,} tokens: one score matrix ({scores / 1e9:.2f} GB) would "
                         f"need more than a third of the free RAM ({free / 1e9:.1f} GB)")  # fmt: skip
            bar.update()
            continue
        lab.model.set_attention(backend)
        peaks: list[int] = []

        def once(backend=backend):
            with PeakRSS() as peak:
                logits[backend] = forward(lab.model, cache, ids, logits_index=positions)  # [1, 3, V]
            peaks.append(peak.delta_bytes)

        timing = lab.measure(once, setup=lambda: cache.truncate(0))
        runs[backend] = BackendRun(timing, max(peaks))
        bar.update()
    both = len(runs) == 2
    diff = float((logits["sdpa"] - logits["materialized"]).abs().max()) if both else None
    speedup = runs["materialized"].timing.median_s / runs["sdpa"].timing.median_s if both else None
    return AttentionPoint(n, scores, runs.get("sdpa"), runs.get("materialized"), diff, speedup)


def table(data: dict) -> str:
    head = ["prompt tokens", "score matrix per layer MB", "SDPA ms (min–max)", "materialised ms (min–max)",
            "speedup", "SDPA peak MB", "materialised peak MB", "max logit diff"]  # fmt: skip
    rows = []
    for p in data["points"]:
        s, m = p["sdpa"], p["materialized"]
        rows.append([
            num(p["prompt_tokens"]), num(p["score_matrix_bytes"] / 1e6),
            spread(s["timing"], digits=0) if s else "–", spread(m["timing"], digits=0) if m else "skipped",
            ratio(p["speedup"]) if p["speedup"] else "–",
            num(s["peak_rss_delta_bytes"] / 1e6, 0) if s else "–",
            num(m["peak_rss_delta_bytes"] / 1e6, 0) if m else "–",
            f"{p['max_logit_diff']:.1e}" if p["max_logit_diff"] is not None else "–",
        ])  # fmt: skip
    return md_table(head, rows)


def verdict(data: dict) -> str:
    both = [p for p in data["points"] if p["speedup"] is not None]
    if not both:
        return "No length ran with both backends: nothing to compare."
    first, last = both[0], both[-1]
    diff = max(p["max_logit_diff"] for p in both)
    text = (
        f"at {num(last['prompt_tokens'])} tokens SDPA ran {faster(last['speedup'], 'materialised attention')} "
        f"({SOURCE.short} measured 10× faster at 8,000) and peaked {num(last['sdpa']['peak_rss_delta_bytes'] / 1e6, 0)} MB "
        f"above the baseline against {num(last['materialized']['peak_rss_delta_bytes'] / 1e6, 0)} MB"
    )
    grew = None
    if len(both) > 1:
        grow = {k: last[k]["timing"]["median_s"] / first[k]["timing"]["median_s"] for k in BACKENDS}
        grew = grow["materialized"] > grow["sdpa"]
        text += (
            f"; from {num(first['prompt_tokens'])} to {num(last['prompt_tokens'])} tokens the materialised time "
            f"grew {ratio(grow['materialized'])}, SDPA's {ratio(grow['sdpa'])}"
        )
    ok = last["speedup"] > 1.5 and grew is not False and diff < 1e-3
    return f"{held(ok, last['speedup'] > 1.1)}: {text}; the logits agreed within {diff:.1e}."
