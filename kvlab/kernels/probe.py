"""The machine's arithmetic roof, measured (probe.c): float32 multiply-adds a second on the vector units.

    mac_rate(threads, seconds)   the most G MAC/s a loop of independent FMA chains reached on `threads`
                                 of the kernels' pool threads over about `seconds` (None: no library)

A decode step of one sequence is bound by the bytes it reads; a step of B sequences makes B float
multiply-adds per weight on the exact path, so B × the model's multiply-adds per token ÷ this rate is
the least time such a step can take here, whatever the kernel (the lab's batching experiment says so).
Two threads reach twice one thread's rate only where they run on two cores: on a VM whose two vCPUs
share one core's vector units (hyperthreads, or a neighbour's work on the sibling), they reach one's.
"""

from __future__ import annotations

import ctypes
import functools

from kvlab.kernels import gemv


@functools.cache
def _probe():
    gemv._ensure_loaded()
    lib = gemv._state.get("lib")
    return None if lib is None else gemv._bind(lib, "kvlab_mac_rate", [ctypes.c_int, ctypes.c_double], ctypes.c_double)


def mac_rate(threads: int = 1, seconds: float = 0.2) -> float | None:
    """G MAC/s (1e9 float32 multiply-adds a second): the best job over about `seconds`, on `threads`
    threads (at least 1). None where the kernels are not built (no compiler)."""
    probe = _probe()
    if probe is None:
        return None
    rate = probe(max(1, int(threads)), float(seconds))
    if rate < 0:
        raise MemoryError("no memory left for the multiply-add probe")
    return rate
