"""Linear layers: a streaming GEMV kernel for decode on CPUs, BLAS for everything else.

A decode step multiplies one activation row per sequence by every weight matrix, so its time is
the time to read the weights. PyTorch's CPU matmul reads them at well under the memory's speed
when only one row comes in; `gemv.c` reads each matrix once, in order, on all threads. It is
compiled at first use with the machine's C compiler (`-march=native`, OpenMP) into
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
from pathlib import Path

import torch
import torch.nn.functional as F

MAX_ROWS = 8  # beyond this many activation rows the BLAS matmul is compute-efficient enough
_SOURCE = Path(__file__).with_name("gemv.c")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]
_FUNCTIONS = {torch.float32: "kvlab_gemv_f32", torch.bfloat16: "kvlab_gemv_bf16", torch.float16: "kvlab_gemv_f16"}
_state: dict = {}  # "lib" → loaded library or None (compile failed), filled once per process


def kernels_enabled() -> bool:
    return os.environ.get("KVLAB_KERNELS", "1") != "0"


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


def _library():
    if "lib" in _state:
        return _state["lib"]
    _state["lib"] = None
    from kvlab.hub import kvlab_home

    key = hashlib.sha256(_SOURCE.read_bytes() + " ".join(_FLAGS).encode() + _cpu_fingerprint().encode())
    target = kvlab_home() / "kernels" / f"gemv-{key.hexdigest()[:16]}.so"
    try:
        if not target.exists():
            _build(target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.CalledProcessError):
        return None  # no compiler or an odd platform: BLAS serves every call
    for name in _FUNCTIONS.values():
        fn = getattr(lib, name)
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3
        fn.restype = None
    _state["lib"] = lib
    return lib


def gemv_available() -> bool:
    return kernels_enabled() and _library() is not None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ weight[out, in]ᵀ (+ bias) → [..., out]."""
    out_features, in_features = weight.shape
    rows = x.numel() // in_features
    if (
        rows > MAX_ROWS
        or x.device.type != "cpu"
        or weight.dtype not in _FUNCTIONS
        or not weight.is_contiguous()
        or not kernels_enabled()
        or _library() is None
    ):
        return F.linear(x, weight, bias)
    xf = x.reshape(rows, in_features).to(torch.float32).contiguous()
    bf = None if bias is None else bias.to(torch.float32).contiguous()
    y = torch.empty(rows, out_features, dtype=torch.float32)
    getattr(_state["lib"], _FUNCTIONS[weight.dtype])(
        weight.data_ptr(), xf.data_ptr(), 0 if bf is None else bf.data_ptr(), y.data_ptr(),
        rows, in_features, out_features,
    )  # fmt: skip
    return y.to(x.dtype).view(*x.shape[:-1], out_features)
