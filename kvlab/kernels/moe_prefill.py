"""A prompt's routed experts in one C call (moe.c's kvlab_moe_experts): rows already routed, grouped by
expert, each chosen expert's rows in tiles of 32 over the pool's threads, every row's experts summed in
ascending order. kvlab/model/experts.py calls it for a CPU pass over experts in GGUF blocks; its own
per-expert loop is the same computation, one expert and one PyTorch op at a time.

    experts(desc, x, weights, ids)    out [N, hidden] float32; desc: backends/cpu_moe.py's describe_experts
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kvlab.kernels import gemv
from kvlab.kernels.policy import current


@functools.cache
def _library() -> dict[str, object] | None:
    gemv._ensure_loaded()
    lib = gemv._state.get("lib")
    if lib is None:
        return None
    int64, pointer = ctypes.c_int64, ctypes.c_void_p
    return {"run": gemv._bind(lib, "kvlab_moe_experts", [pointer] * 5 + [int64] * 2 + [pointer, ctypes.c_int]),
            "scratch_floats": gemv._bind(lib, "kvlab_moe_experts_scratch_floats", [pointer, int64, int64, ctypes.c_int],
                                         int64)}  # fmt: skip


def available() -> bool:
    """Whether the C library (with moe.c) is built and loaded here."""
    return _library() is not None


def experts(desc, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """x [N, hidden] float32, weights [N, k] float32, ids [N, k] → Σ weight · expert(x) [N, hidden] float32,
    on the thread policy's threads."""
    lib, threads = _library(), current().threads
    x, weights, ids = x.contiguous(), weights.contiguous(), ids.to(torch.int64).contiguous()
    N, hidden = x.shape
    out = torch.empty(N, hidden)
    scratch = torch.empty(lib["scratch_floats"](ctypes.byref(desc), N, hidden, threads))
    lib["run"](ctypes.byref(desc), x.data_ptr(), weights.data_ptr(), ids.data_ptr(), out.data_ptr(), N, hidden,
               scratch.data_ptr(), threads)  # fmt: skip
    return out
