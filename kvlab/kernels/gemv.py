"""Linear layers: a streaming GEMV kernel for decode on CPUs, BLAS for everything else.

A decode step multiplies one activation row per sequence by every weight matrix, so its time is
the time to read the weights. PyTorch's CPU matmul reads them at well under the memory's speed
when only one row comes in; `gemv.c` reads each matrix once, in order, on all threads. It is
compiled at first use with the machine's C compiler (`-march=native`, its own thread pool) into
$KVLAB_HOME/kernels and loaded with ctypes. Without a compiler, on CUDA, or with
KVLAB_KERNELS=0, every call goes to `torch.nn.functional.linear`.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

MAX_ROWS = 32  # up to a batched decode step of 32 sequences; prefill-sized inputs go to BLAS
_SOURCE = Path(__file__).with_name("gemv.c")
_FLAGS = ["-O3", "-march=native", "-pthread", "-shared", "-fPIC", "-std=gnu11", "-lm"]
_NAMES = {torch.float32: "kvlab_gemv_f32", torch.bfloat16: "kvlab_gemv_bf16", torch.float16: "kvlab_gemv_f16"}
# weight dtype → compiled function; {} until first use, stays {} when disabled or unavailable
_kernels: dict[torch.dtype, object] = {}
_ops: dict[str, object] = {}  # the small decode ops (rms_norm, rope), float32 only
_state = {"enabled": os.environ.get("KVLAB_KERNELS", "1") != "0", "loaded": False, "threads": None}


def set_kernel_threads(threads: int | None) -> None:
    """Threads the GEMV pool uses (None: torch's own thread count)."""
    _state["threads"] = threads


def set_kernels_enabled(enabled: bool) -> None:
    """Turn the GEMV path on or off for this process (off: every call uses BLAS)."""
    _state["enabled"] = enabled


@contextmanager
def decode_threads(num_rows: int):
    """Around a forward of `num_rows` tokens: if they go through the GEMV kernel, run PyTorch's own
    ops on one thread and give the kernel's pool every thread.

    A decode step's other ops are tiny; at several threads each wakes PyTorch's OpenMP workers, which
    then spin on the cores the GEMV pool needs (measured here on SmolLM2: 96 ms a step with both at 2
    threads, 56 ms this way). Prefill-sized passes keep PyTorch's threads for BLAS.
    """
    threads = torch.get_num_threads()
    if num_rows > MAX_ROWS or threads == 1 or not gemv_available():
        yield
        return
    previous = _state["threads"]
    _state["threads"] = previous or threads
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        _state["threads"] = previous


def kernels_enabled() -> bool:
    return _state["enabled"]


def _cpu_fingerprint() -> str:
    """The CPU's feature flags: a library built with -march=native runs only where they match."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() + platform.machine()


def _build(target: Path) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler found")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        subprocess.run([compiler, *_FLAGS, str(_SOURCE), "-o", str(out)], check=True, capture_output=True)
        os.replace(out, target)  # atomic: a half-written library is never loaded


def _load() -> None:
    """Compile (once per machine and source version) and load the kernels; silently stay empty on failure."""
    _state["loaded"] = True
    from kvlab.hub import kvlab_home

    key = hashlib.sha256(_SOURCE.read_bytes() + " ".join(_FLAGS).encode() + _cpu_fingerprint().encode())
    target = kvlab_home() / "kernels" / f"gemv-{key.hexdigest()[:16]}.so"
    try:
        if not target.exists():
            _build(target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.CalledProcessError):
        return  # no compiler or an odd platform: BLAS serves every call
    for dtype, name in _NAMES.items():
        fn = getattr(lib, name)
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]
        fn.restype = None
        _kernels[dtype] = fn
    _ops["rms_norm"] = lib.kvlab_rms_norm_f32
    _ops["rms_norm"].argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 2 + [ctypes.c_float]
    _ops["rope"] = lib.kvlab_rope_f32
    _ops["rope"].argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 4
    for fn in _ops.values():
        fn.restype = None


def gemv_available() -> bool:
    if not _state["loaded"]:
        _load()
    return kernels_enabled() and bool(_kernels)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ weight[out, in]ᵀ (+ bias) → [..., out]."""
    out_features, in_features = weight.shape
    rows = x.numel() // in_features
    if rows <= MAX_ROWS and _state["enabled"] and x.device.type == "cpu":
        if not _state["loaded"]:
            _load()
        fn = _kernels.get(weight.dtype)
        if fn is not None and weight.is_contiguous():
            return _gemv(fn, x, weight, bias, rows, in_features, out_features)
    return F.linear(x, weight, bias)


def _gemv(fn, x, weight, bias, rows: int, in_features: int, out_features: int) -> torch.Tensor:
    xf = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
    if bias is not None and bias.dtype != torch.float32:
        bias = bias.float()
    y = torch.empty(rows, out_features)
    fn(weight.data_ptr(), xf.data_ptr(), 0 if bias is None else bias.data_ptr(), y.data_ptr(),
       rows, in_features, out_features, _state["threads"] or torch.get_num_threads())  # fmt: skip
    if x.dtype != torch.float32:
        y = y.to(x.dtype)
    return y.view(*x.shape[:-1], out_features)


# ---- the small ops of a decode step ------------------------------------------------------------
# Each is a handful of PyTorch kernels of a few microseconds apiece; at decode sizes that is most of
# their time. One C call instead, for float32 rows on a CPU; everything else keeps the PyTorch code.


def small_ops_apply(x: torch.Tensor, tokens: int) -> bool:
    """Whether the C versions of the small ops take a float32 CPU tensor of `tokens` tokens (decode-sized)."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or not _state["enabled"] or tokens > MAX_ROWS:
        return False
    if not _state["loaded"]:
        _load()
    return bool(_ops)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x²) + eps) · weight over the last dim (small_ops_apply(x) must hold)."""
    x = x.contiguous()
    y = torch.empty_like(x)
    n = x.shape[-1]
    _ops["rms_norm"](x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // n, n, eps)
    return y


def rope_in_place(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> bool:
    """Rotate x [B, T, heads, D] in place (see model.rope.apply_rotary); False if the layout does not fit."""
    B, T, heads, D = x.shape
    if not (x.stride(3) == 1 and x.stride(2) == D and x.stride(0) == T * x.stride(1) and D <= 1024):
        return False
    if not (cos.is_contiguous() and signed_sin.is_contiguous() and cos.dtype == torch.float32):
        return False
    if cos.shape[0] != B or cos.shape[1] != T:
        return False
    _ops["rope"](x.data_ptr(), cos.data_ptr(), signed_sin.data_ptr(), B * T, heads, D, x.stride(1))
    return True
