"""Engine-wide counters and histograms: what `/metrics` and `kvlab bench serve` report.

The engine records every step (time per phase, tokens) and every finished request (TTFT, TPOT,
queue time, end-to-end latency). Live gauges — requests running and waiting, KV blocks in use — are
read from the scheduler and the block pool when asked, not kept here.
"""

from __future__ import annotations

import bisect
import resource
import threading
from dataclasses import dataclass, field

STEP_PHASES = ("schedule", "prepare_inputs", "forward", "sample", "detokenize")

# seconds; spans CPU decode steps (tens of ms) to long prompts (tens of s)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
PHASE_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass
class Histogram:
    """Cumulative-style histogram as Prometheus wants it: counts per upper bound, plus sum and count."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; last = above every bound
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, count of observations <= le) for every bucket and +Inf."""
        out, total = [], 0
        for bound, n in zip([*map(repr, self.buckets), "+Inf"], self.counts):
            total += n
            out.append((bound, total))
        return out


@dataclass
class EngineStats:
    steps: int = 0
    step_tokens: int = 0
    prompt_tokens: int = 0  # prompt tokens of finished requests
    generation_tokens: int = 0  # tokens sampled
    prompt_step_seconds: float = 0.0  # wall time of the steps that computed prompt tokens (the rest: decode rows only)
    finished: dict[str, int] = field(default_factory=dict)  # by finish reason
    phase_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STEP_PHASES, 0.0))
    phase_hist: dict[str, Histogram] = field(default_factory=lambda: {p: Histogram(PHASE_BUCKETS) for p in STEP_PHASES})
    step_hist: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    ttft: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    tpot: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    queue: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record_step(self, phases: dict[str, float], num_tokens: int, num_sampled: int, prompt: bool = False) -> None:
        with self.lock:
            self.steps += 1
            self.step_tokens += num_tokens
            self.generation_tokens += num_sampled
            if prompt:
                self.prompt_step_seconds += sum(phases.values())
            for name, seconds in phases.items():
                self.phase_seconds[name] += seconds
                self.phase_hist[name].observe(seconds)
            self.step_hist.observe(sum(phases.values()))

    def record_finished(self, reason: str, metrics) -> None:
        with self.lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1
            self.prompt_tokens += metrics.prompt_tokens
            if metrics.generated_tokens:
                self.ttft.observe(metrics.ttft_s)
                self.queue.observe(metrics.queue_s)
            if metrics.generated_tokens > 1:
                self.tpot.observe(metrics.tpot_s)
            self.e2e.observe(metrics.ttft_s + metrics.decode_s)


def peak_memory_bytes(device) -> int:
    """The process's peak resident memory on a CPU; the peak allocated on a CUDA device (a torch.device)."""
    if device.type == "cuda":
        import torch

        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
