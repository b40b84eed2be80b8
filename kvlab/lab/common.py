"""What every experiment shares: timing with warm-up and repeats, the machine's facts, the Lab handle.

Timings are wall-clock seconds from `time.perf_counter`; a point is run `repeat` times after a
warm-up and summarised as median, min and max. Prompts are random token ids from a seeded
generator: a forward pass costs the same whichever tokens it reads.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch

from kvlab.kv.cache import ContiguousKVCache, KVCache
from kvlab.model.loader import LoadedModel, load_model
from kvlab.runner.driver import ModelDriver

LONG_RUN_S = 5.0  # a warm-up run this long counts as a sample (see measure)


@dataclass
class Timing:
    """Seconds of `runs` timed runs of one point (warm-up excluded)."""

    median_s: float
    min_s: float
    max_s: float
    runs: int
    samples_s: list[float]

    @classmethod
    def of(cls, samples: list[float]) -> "Timing":
        return cls(statistics.median(samples), min(samples), max(samples), len(samples), samples)


def measure(
    run: Callable[[], object],
    repeat: int,
    setup: Callable[[], object] | None = None,
    warmup: int = 1,
    max_total_s: float = math.inf,
) -> Timing:
    """Time `run()` `repeat` times, each after an untimed `setup()`.

    The warm-up run is discarded unless it took LONG_RUN_S or more: then one-time costs (allocation,
    page faults, loading a kernel) are lost in it and it counts as the first sample. Runs stop early once
    the samples add up to more than `max_total_s` seconds (at least one always counts).
    """
    setup = setup or (lambda: None)
    samples: list[float] = []
    for _ in range(warmup):
        setup()
        start = time.perf_counter()
        run()
        if time.perf_counter() - start >= LONG_RUN_S:
            samples.append(time.perf_counter() - start)
            break
    while len(samples) < repeat and (not samples or sum(samples) <= max_total_s):
        setup()
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    return Timing.of(samples)


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# ---- the machine and the model ------------------------------------------------------------------


@dataclass
class MachineFacts:
    cpu_model: str
    cores: int  # logical CPUs the OS reports
    threads: int  # torch's intra-op threads during the run
    torch_version: str
    python_version: str
    platform: str
    ram_total_bytes: int
    ram_available_bytes: int  # at the start of the run
    load_average: float  # 1-minute load average at the start: other programs competing for the CPUs
    gemv_kernel: bool  # kvlab's decode GEMV kernel enabled (KVLAB_KERNELS != 0)
    cpu_others_busy: float | None = None  # cores' worth other programs used while the model loaded (lab/busy.py)


def meminfo_bytes(key: str) -> int:
    """A field of /proc/meminfo ("MemTotal", "MemAvailable") in bytes; 0 where there is none."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def load_average() -> float:
    """The 1-minute load average: how many programs wanted a CPU, on average (0 where unknown)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_facts() -> MachineFacts:
    return MachineFacts(
        cpu_model=cpu_model(),
        cores=os.cpu_count() or 1,
        threads=torch.get_num_threads(),
        torch_version=torch.__version__,
        python_version=platform.python_version(),
        platform=platform.platform(),
        ram_total_bytes=meminfo_bytes("MemTotal"),
        ram_available_bytes=meminfo_bytes("MemAvailable"),
        load_average=load_average(),
        gemv_kernel=os.environ.get("KVLAB_KERNELS", "1") != "0",
    )


@dataclass
class ModelFacts:
    name: str  # as given on the command line
    path: str
    architecture: str
    dtype: str  # of the activations (and of float weights)
    weight_format: str  # how the matrices are held: float32, Q4_1 + Q8_0 (as stored), q8_0 (quantized at load)
    params: int  # distinct parameters (a tied matrix counts once), as the calculator counts them
    weight_bytes: int
    decode_weight_bytes: int  # bytes one decode step streams (kvlab.model.loader)
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_positions: int  # longest sequence the model's position table covers


def model_facts(name: str, loaded: LoadedModel, dtype: str) -> ModelFacts:
    from kvlab.memory import count_params

    c = loaded.config
    return ModelFacts(
        name=name, path=str(loaded.path), architecture=c.architecture, dtype=dtype,
        weight_format=loaded.weight_format, params=count_params(c).total, weight_bytes=loaded.weight_bytes,
        decode_weight_bytes=loaded.decode_weight_bytes(), num_layers=c.num_layers, num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, hidden_size=c.hidden_size,
        vocab_size=c.vocab_size, max_positions=max_positions(loaded),
    )  # fmt: skip


def max_positions(loaded: LoadedModel) -> int:
    return loaded.model.rotary.cos.shape[0]


# ---- driving the model ---------------------------------------------------------------------------


def forward(model, cache: KVCache, ids: torch.Tensor, logits_index: torch.Tensor | None = None) -> torch.Tensor:
    """Append ids [B, T] to every sequence of `cache`: logits [B, V] of the last new token."""
    return ModelDriver(model).run(ids, cache, logits_index=logits_index)


def greedy(model, cache: KVCache, token: torch.Tensor, steps: int) -> torch.Tensor:
    """Decode `steps` tokens after token [B, 1], always taking the most likely: ids [B, steps]."""
    out = []
    for _ in range(steps):
        token = forward(model, cache, token).argmax(-1, keepdim=True)  # [B, 1]
        out.append(token)
    return torch.cat(out, dim=1)


@dataclass
class Lab:
    """The model under test, the run's settings, and the helpers every experiment uses."""

    loaded: LoadedModel
    model_name: str
    dtype: str = "float32"
    repeat: int = 3
    quick: bool = False  # tiny sizes, for the tests
    max_prompt: int | None = None  # longest prompt any experiment prefills (None: the model's limit)
    max_point_s: float = 120.0  # a point stops repeating once its timed runs took this long
    seed: int = 0
    show_progress: bool = True
    # called with a partial result (a dataclass), the points done and the total, as each point finishes
    on_point: Callable[[object, int, int], None] | None = None
    _other_dtypes: dict = field(default_factory=dict, repr=False)

    @property
    def model(self):
        return self.loaded.model

    @property
    def config(self):
        return self.loaded.config

    def sizes(self, full: Iterable[int], quick: Iterable[int], prefill: bool = True, room: int = 0):
        """(sizes to run, notes on the dropped ones). A size plus `room` tokens must fit the model's
        positions; a prompt (`prefill`) must also respect --max-prompt."""
        kept, notes = [], []
        limit = max_positions(self.loaded) - room
        for n in quick if self.quick else full:
            if n > limit:
                notes.append(f"{n:,} tokens skipped: beyond the model's {max_positions(self.loaded):,} positions")
            elif prefill and self.max_prompt and n > self.max_prompt:
                notes.append(f"{n:,} tokens skipped: longer than --max-prompt {self.max_prompt:,}")
            else:
                kept.append(n)
        return kept, notes

    def capped(self, full: int, quick: int) -> tuple[int, list[str]]:
        """One prompt length (quick or full), shortened to the model's limit and --max-prompt if need be."""
        n = quick if self.quick else full
        limit = min(max_positions(self.loaded), self.max_prompt or n)
        if n <= limit:
            return n, []
        return limit, [f"prompt shortened from {n:,} to {limit:,} tokens (the model's limit or --max-prompt)"]

    def prompt(self, length: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
        """Random token ids [batch, length], the same for the same arguments."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + length * 7919 + seed)
        return torch.randint(0, self.config.vocab_size, (batch, length), generator=g).to(self.model.device)

    def new_cache(self, max_len: int, batch: int = 1, loaded: LoadedModel | None = None) -> ContiguousKVCache:
        loaded = loaded or self.loaded
        return ContiguousKVCache.for_model(
            loaded.config, max_len, batch_size=batch, dtype=loaded.model.dtype, device=loaded.model.device
        )

    def measure(self, run, setup=None, repeat: int | None = None) -> Timing:
        """Time a point with this run's --repeat and --max-point-s."""
        return measure(run, repeat or self.repeat, setup, max_total_s=self.max_point_s)

    def load(self, dtype: str, quantization: str | None = None, stored: bool = False) -> LoadedModel:
        """The same model held another way (loaded once; `release` frees it): float weights in `dtype`
        (a GGUF file's blocks expanded), blocks made by `quantization` at load, or with `stored` the
        file's own blocks (activations in `dtype`)."""
        key = (dtype, quantization, stored)
        if self.loaded.weight_format == weight_format_name(dtype, quantization, stored, self.loaded):
            return self.loaded
        if key not in self._other_dtypes:
            self._other_dtypes[key] = load_model(self.loaded.path, dtype=dtype, device=self.model.device,
                                                 dequantize=not stored, quantization=quantization)  # fmt: skip
        return self._other_dtypes[key]

    def release(self, dtype: str, quantization: str | None = None, stored: bool = False) -> None:
        self._other_dtypes.pop((dtype, quantization, stored), None)

    def progress(self, total: int, desc: str) -> "Progress":
        """A progress bar on stderr; experiments call .update(partial) as each point finishes."""
        from tqdm import tqdm

        bar = tqdm(total=total, desc=desc, unit="pt", file=sys.stderr, leave=False,
                   disable=not self.show_progress, dynamic_ncols=True)  # fmt: skip
        return Progress(bar, total, self.on_point)


class Progress:
    """An experiment's points: a tqdm bar, and each partial result handed on to be saved (`Lab.on_point`),
    so that an interrupted or slow run keeps every point it finished."""

    def __init__(self, bar, total: int, on_point: Callable[[object, int, int], None] | None):
        self.bar, self.total, self.on_point = bar, total, on_point
        self.done = 0

    def set_postfix_str(self, text: str) -> None:
        self.bar.set_postfix_str(text)

    def update(self, partial: object | None = None) -> None:
        """One point finished; `partial`: the experiment's result so far (its dataclass), to save."""
        self.done += 1
        self.bar.update()
        if partial is not None:
            self.save(partial)

    def save(self, partial: object) -> None:
        """Hand the result so far on without advancing (a point made of several bar steps)."""
        if self.on_point is not None:
            self.on_point(partial, self.done, self.total)

    def close(self) -> None:
        self.bar.close()


def weight_format_name(dtype: str, quantization: str | None, stored: bool, loaded: LoadedModel) -> str:
    """The weight format a `Lab.load` of these settings gives (to reuse the lab's own model when it is that)."""
    if quantization:
        return f"{quantization} (quantized at load)"
    if stored:
        native = loaded.weight_format.endswith("(as stored)") and loaded.model.dtype == getattr(torch, dtype)
        return loaded.weight_format if native else f"the file's blocks, {dtype} activations"
    return dtype


# ---- workloads shared by several experiments -----------------------------------------------------


def time_prefill(lab: Lab, length: int, loaded: LoadedModel | None = None) -> Timing:
    """One forward over a `length`-token prompt into an empty cache: the time to first token."""
    loaded = loaded or lab.loaded
    cache = lab.new_cache(length, loaded=loaded)
    ids = lab.prompt(length)
    return lab.measure(lambda: forward(loaded.model, cache, ids), setup=lambda: cache.truncate(0))


def time_decode(lab: Lab, context: int, steps: int, loaded: LoadedModel | None = None):
    """`steps` greedy decode steps after a `context`-token prompt (prefilled, untimed), on the path
    `kvlab run` decodes on: the serving engine's steps over its paged cache, so the decode backend where
    the model takes it (kvlab/backends), else the modules.

    Returns (Timing of the `steps` steps together, the generated ids of the last run: first token + steps).
    """
    from kvlab.config import EngineConfig
    from kvlab.engine import LLMEngine
    from kvlab.kernels import ThreadPolicy
    from kvlab.kv.paged import PagedKVCache
    from kvlab.sampling import SamplingParams

    loaded = loaded or lab.loaded
    length = context + steps + 1
    per_token = PagedKVCache.bytes_per_token_for(loaded.config, loaded.model.dtype)
    config = EngineConfig(max_model_len=max(length + 16, 32), kv_memory_bytes=per_token * (length + 64),
                          enable_prefix_caching=False, max_num_batched_tokens=max(context, 512))  # fmt: skip
    engine = LLMEngine(loaded, None, config, policy=ThreadPolicy(threads=torch.get_num_threads()))
    prompt = lab.prompt(context)[0].tolist()
    params = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    out: list[list[int]] = []

    def prefill() -> None:  # untimed: the prompt, and its first token
        engine.add_request(prompt, params)
        while not any(o.output.token_ids for o in engine.step()):
            pass

    def decode() -> None:
        while engine.has_unfinished_requests:
            for o in engine.step():
                if o.finished:
                    out.append(list(o.output.token_ids))

    timing = lab.measure(decode, setup=prefill)
    return timing, out[-1]
