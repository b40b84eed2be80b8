"""ThreadPolicy: how an engine's passes use the CPU — its own object, handed down, never a process global.

    policy = ThreadPolicy(threads=2)               # an engine's (LLM(threads=...), --threads)
    with ops.applied(policy, num_rows):            # around one forward: the driver does this (backends/ops.py)
        model(...)                                 # kernels read `current()`: threads, kernel on/off

A decode-sized pass (at most `max_kernel_rows` rows) runs its products on the kernels' pool with
`threads` threads (with `fused_decode`, each decoder layer of a paged decode step is one C call) and
PyTorch's own small ops on one thread: at several threads each small op wakes
PyTorch's OpenMP workers, which then spin on the cores the pool needs (measured on SmolLM2: 96 ms a
step with both at 2 threads, 56 ms this way). A prompt-sized pass gives PyTorch `threads` for BLAS.

The policy in force is carried by a context variable, per thread: two engines in two threads, or a
draft model and a target model, each run under their own. PyTorch's thread count is the one
process-wide setting underneath; it is set for each pass and put back after it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch

DEFAULT_MAX_KERNEL_ROWS = 32  # up to a batched decode step of 32 sequences; prompt-sized inputs go to BLAS


def _kernels_default() -> bool:
    return os.environ.get("KVLAB_KERNELS", "1") != "0"


@dataclass
class ThreadPolicy:
    threads: int = field(default_factory=torch.get_num_threads)  # CPU threads of this engine's passes
    use_kernels: bool = field(default_factory=_kernels_default)  # False: every product through PyTorch
    max_kernel_rows: int = DEFAULT_MAX_KERNEL_ROWS  # the kernels' crossover with BLAS, in rows
    fused_decode: bool = True  # a decode step's layers one C call each (kernels/decode.c) where they fit
    # prompt-sized products over GGUF blocks in the kernels too: their tiles decode each block once per 32
    # rows (up to the build's quant.PROMPT_TILE_ROWS, past which dequantizing the matrix for BLAS wins)
    packed_prompts: bool = True

    def __post_init__(self) -> None:
        if self.threads is None:
            self.threads = torch.get_num_threads()
        if self.threads < 1 or self.max_kernel_rows < 0:
            raise ValueError(f"a thread policy needs threads ≥ 1 and max_kernel_rows ≥ 0, got {self}")

    def kernel_sized(self, num_rows: int) -> bool:
        """Whether a product over `num_rows` rows is one for the kernels (decode-sized)."""
        return self.use_kernels and 0 < num_rows <= self.max_kernel_rows

    def packed_sized(self, num_rows: int) -> bool:
        """Whether a product over GGUF blocks with `num_rows` rows goes to the block kernels."""
        return self.kernel_sized(num_rows) or (self.use_kernels and self.packed_prompts and num_rows > 0)

    @contextmanager
    def active(self) -> Iterator[ThreadPolicy]:
        """Make this the policy the kernels read, in this thread, for the block's duration."""
        token = _current.set(self)
        try:
            yield self
        finally:
            _current.reset(token)

    @contextmanager
    def applied(self, torch_threads: int | None = None) -> Iterator[ThreadPolicy]:
        """Around a forward: this policy active, and PyTorch's thread count set to `torch_threads`
        (None: `threads`). Which count a pass wants is its device's ops' say
        (kvlab/backends/ops.py: one on a CPU whose kernels' pool takes the pass's products: a decode step,
        or a short prompt over GGUF blocks)."""
        torch_threads = torch_threads or self.threads
        before = torch.get_num_threads()
        if before != torch_threads:
            torch.set_num_threads(torch_threads)
        try:
            with self.active():
                yield self
        finally:
            if torch.get_num_threads() != before:
                torch.set_num_threads(before)


_current: ContextVar[ThreadPolicy | None] = ContextVar("kvlab_thread_policy", default=None)


def current() -> ThreadPolicy:
    """The policy in force in this thread; outside any, one made from torch's thread count and KVLAB_KERNELS."""
    return _current.get() or ThreadPolicy()

