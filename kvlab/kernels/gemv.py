"""Linear layers: a streaming GEMV kernel for decode on CPUs, BLAS for everything else.

A decode step multiplies one activation row per sequence by every weight matrix, so its time is
the time to read the weights. PyTorch's CPU matmul reads them at well under the memory's speed
when only one row comes in; `gemv.c` reads each matrix once, in order, on all threads. It is
compiled at first use with the machine's C compiler (`-march=native`, with the thread pool of
`pool.c`) into $KVLAB_HOME/kernels and loaded with ctypes. Whether a call uses it, and on how many
threads, is the caller's thread policy (`kernels.policy`). Without a compiler, or with KVLAB_KERNELS=0,
every call goes to `torch.nn.functional.linear`. Only the CPU's ops call these functions (kvlab/backends/
ops.py): they take CPU tensors and never ask which device one is on. A build that fails is never silent:
`build_error()` says why (and the decode backend names it as the reason it is off), one warning line
goes to stderr, and with KVLAB_KERNELS=require (`make test`, CI) the failure is an error.

The pool serves one call at a time; a call from another thread meanwhile computes on its own
thread, with the same result (no output value depends on the number of threads).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

from kvlab.kernels.policy import current

_SOURCES = [Path(__file__).with_name(name) for name in ("gemv.c", "quant.c", "decode.c", "attention.c", "prompt_attention.c",
                                                        "kv_codec.c", "pool.c")]  # fmt: skip
_SOURCES.append(Path(__file__).with_name("quant_i8.c"))  # 8-bit activations over interleaved rows (opt-in)
_SOURCES.append(Path(__file__).with_name("linear.c"))  # the decode step's products, part by part
_SOURCES.append(Path(__file__).parents[1] / "parallel" / "allreduce.c")  # the shared-memory all-reduce, beside its user
_SOURCES.append(Path(__file__).with_name("mxfp4.c"))  # MXFP4 blocks (gpt-oss's experts), bound by kernels/mxfp4.py
_SOURCES.append(Path(__file__).with_name("moe.c"))  # the decode step's mixture-of-experts MLP (decode.c calls it)
_SOURCES.append(Path(__file__).with_name("deltanet.c"))  # Gated DeltaNet's decode step, bound by kernels/deltanet.py
_SOURCES.append(Path(__file__).with_name("probe.c"))  # the vector units' multiply-add rate, bound by kernels/probe.py
_HEADERS = [Path(__file__).with_name(name) for name in ("pool.h", "step.h", "kv_codec.h", "quant_i8.h", "vec8.h",
                                                        "attention.h", "amx.h")]  # fmt: skip
_FLAGS = ["-O3", "-march=native", "-pthread", "-shared", "-fPIC", "-std=gnu11", "-lm"]
_MAX_OUT = 2**31  # output rows: the pool numbers work items (4 rows each) in 32 bits
_NAMES = {torch.float32: "kvlab_gemv_f32", torch.bfloat16: "kvlab_gemv_bf16", torch.float16: "kvlab_gemv_f16"}
# weight dtype → compiled function; {} until first use, stays {} when disabled or unavailable
_kernels: dict[torch.dtype, object] = {}
_ops: dict[str, object] = {}  # the small decode ops (rms_norm, rope), float32 only
_pool: dict[str, object] = {}  # the thread pool's hooks for tests and benchmarks (pool_stats, ...)
_quant: dict[str, object] = {}  # the block-format kernels of quant.c, for kernels/quant.py
_decode: dict[str, object] = {}  # decode.c's fused decoder layer, for kernels/decode.py
_comm: dict[str, object] = {}  # allreduce.c's shared-memory all-reduce, for kvlab/parallel/shm.py
_state: dict[str, object] = {"loaded": False, "error": None}
_load_lock = threading.Lock()  # a second thread waits for the first one's build instead of using BLAS


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
        sources = [str(path) for path in _SOURCES]
        subprocess.run([compiler, *_FLAGS, *sources, "-o", str(out)], check=True, capture_output=True)
        os.replace(out, target)  # atomic: a half-written library is never loaded


def _ensure_loaded() -> None:
    if not _state["loaded"]:
        with _load_lock:
            if not _state["loaded"]:
                _load()
                _state["loaded"] = True


class KernelBuildError(RuntimeError):
    """The C kernels could not be built or loaded while KVLAB_KERNELS=require asks for them."""


def build_error() -> str | None:
    """Why the kernels are not here (None: they are)."""
    _ensure_loaded()
    return _state["error"]


def _failed(why: str) -> None:
    """A build or load failure: an error under KVLAB_KERNELS=require, else one warning line and PyTorch."""
    import sys

    _state["error"] = why
    if os.environ.get("KVLAB_KERNELS") == "require":
        raise KernelBuildError(f"the C kernels could not be built ({why}); KVLAB_KERNELS=require makes that an error")
    print(f"kvlab: warning: the C kernels could not be built ({why}); every product runs on PyTorch, slower",
          file=sys.stderr)  # fmt: skip


def _load() -> None:
    """Compile (once per machine and source version) and load the kernels; say why when that fails."""
    from kvlab.hub import kvlab_home

    key = hashlib.sha256(b"".join(path.read_bytes() for path in _SOURCES + _HEADERS))
    key.update(" ".join(_FLAGS).encode() + _cpu_fingerprint().encode())
    target = kvlab_home() / "kernels" / f"gemv-{key.hexdigest()[:16]}.so"
    try:
        if not target.exists():
            _build(target)
        lib = ctypes.CDLL(str(target))
    except subprocess.CalledProcessError as e:
        lines = (e.stderr or b"").decode(errors="replace").strip().splitlines()
        return _failed(f"{Path(e.cmd[0]).name} exited with {e.returncode}" + (f": {lines[0]}" if lines else ""))
    except OSError as e:  # no compiler, or a library that does not load on this platform
        return _failed(str(e))
    int64, pointer = ctypes.c_int64, ctypes.c_void_p
    for dtype, name in _NAMES.items():
        _kernels[dtype] = _bind(lib, name, [pointer] * 4 + [int64] * 3 + [ctypes.c_int])
    _ops["rms_norm"] = _bind(lib, "kvlab_rms_norm_rows", [pointer] * 3 + [int64] * 2 + [ctypes.c_float, ctypes.c_int])
    _ops["rope"] = _bind(lib, "kvlab_rope_rows", [pointer] * 3 + [int64] * 4 + [ctypes.c_int])
    _ops["gated_act"] = _bind(lib, "kvlab_gated_act_rows", [pointer, int64, pointer, int64, pointer] + [int64] * 2 + [ctypes.c_int] * 2)
    _ops["prompt_attention"] = _bind(lib, "kvlab_prompt_attention", [pointer, pointer] * 3 + [pointer] * 4 + [int64] * 6
                                     + [ctypes.c_float, ctypes.c_int, ctypes.c_int], ctypes.c_int)  # fmt: skip
    _ops["argmax"] = _bind(lib, "kvlab_argmax_rows", [pointer, int64, int64, pointer, ctypes.c_int])
    _pool["stats"] = _bind(lib, "kvlab_pool_stats", [ctypes.POINTER(_PoolStats)])
    _pool["set_generation"] = _bind(lib, "kvlab_pool_set_generation", [ctypes.c_uint32], ctypes.c_int)
    _pool["hold"] = _bind(lib, "kvlab_pool_hold", [ctypes.c_int], ctypes.c_int)
    _pool["cover"] = _bind(lib, "kvlab_pool_cover", [ctypes.c_uint32, ctypes.c_uint32, ctypes.c_int, pointer, pointer])
    int_p = ctypes.POINTER(ctypes.c_int)
    _quant["format"] = _bind(lib, "kvlab_quant_format", [ctypes.c_int, int_p, int_p], ctypes.c_char_p)
    _quant["isa"] = _bind(lib, "kvlab_quant_isa", [], ctypes.c_char_p)
    _quant["bf16_rows"] = _bind(lib, "kvlab_i8_bf16_rows", [], ctypes.c_int)
    _quant["t16_available"] = _bind(lib, "kvlab_t16_available", [], ctypes.c_int)
    _quant["gated_rows"] = _bind(lib, "kvlab_i8_gated_rows", [], ctypes.c_int)
    _quant["matmul"] = _bind(lib, "kvlab_quant_matmul", [ctypes.c_int] + [pointer, int64] + [pointer] * 2 + [int64] * 4 + [ctypes.c_int], ctypes.c_int)
    _quant["matmul_parts"] = _bind(lib, "kvlab_quant_matmul_parts", [ctypes.c_int] + [pointer] * 6 + [int64] * 3 + [ctypes.c_int], ctypes.c_int)
    _quant["gated"] = _bind(lib, "kvlab_quant_gated", [pointer] * 2 + [int64] + [pointer] * 2 + [int64] * 2 + [ctypes.c_int] * 2, ctypes.c_int)
    _quant["interleave"] = _bind(lib, "kvlab_quant_interleave", [ctypes.c_int, pointer, int64, int64, int64, pointer], int64)
    rows_args = [ctypes.c_int, pointer, int64, int64, pointer, int64, pointer, int64]  # fmt, w, ldw, rows, ids, m, y, n
    _quant["dequantize_rows"] = _bind(lib, "kvlab_quant_dequantize_rows", rows_args, ctypes.c_int)
    _quant["dequantize"] = _bind(lib, "kvlab_quant_dequantize", [ctypes.c_int, pointer, int64, pointer] + [int64] * 3 + [ctypes.c_int], ctypes.c_int)
    _decode["layers"] = _bind(lib, "kvlab_decode_layers", [pointer, int64, pointer, pointer, pointer, pointer, ctypes.c_int,
                                                           pointer], ctypes.c_int)  # fmt: skip
    _decode["scratch_floats"] = _bind(lib, "kvlab_decode_scratch_floats", [int64] * 7, int64)
    _decode["head"] = _bind(lib, "kvlab_decode_head", [pointer, pointer, ctypes.c_float, pointer, int64, int64, pointer,
                                                       int64, pointer, pointer, ctypes.c_int], ctypes.c_int)  # fmt: skip
    _decode["kv_encode"] = _bind(lib, "kvlab_kv_encode", [ctypes.c_int, pointer, int64, int64, pointer, pointer], ctypes.c_int)
    _decode["kv_write"] = _bind(lib, "kvlab_kv_write", [ctypes.c_int, ctypes.c_int, pointer] + [int64] * 5 + [pointer] * 3,
                                ctypes.c_int)  # fmt: skip
    _decode["kv_decode"] = _bind(lib, "kvlab_kv_decode", [ctypes.c_int, pointer, pointer, int64, int64, pointer], ctypes.c_int)
    _decode["kv_gather"] = _bind(lib, "kvlab_kv_gather", [ctypes.c_int] * 2 + [pointer] * 3 + [int64] * 3 + [pointer, ctypes.c_int],
                                 ctypes.c_int)  # fmt: skip
    _decode["hadamard"] = _bind(lib, "kvlab_hadamard_f32", [pointer, int64, int64])
    _decode["paged_attention"] = _bind(lib, "kvlab_paged_attention", [pointer] * 3 + [int64] + [pointer] * 2 + [ctypes.c_int])
    _decode["paged_attention_scratch"] = _bind(lib, "kvlab_paged_attention_scratch_floats", [int64] * 4, int64)
    _decode["attention_rows"] = _bind(lib, "kvlab_attention_rows", [ctypes.c_int], ctypes.c_int)
    _decode["kv_format"] = _bind(lib, "kvlab_kv_format", [ctypes.c_int], ctypes.c_char_p)
    _decode["activation"] = _bind(lib, "kvlab_decode_activation", [ctypes.c_int], ctypes.c_char_p)
    _decode["struct_sizes"] = _bind(lib, "kvlab_decode_struct_sizes", [pointer])
    _comm["allreduce"] = _bind(lib, "kvlab_shm_allreduce", [pointer, ctypes.c_int, ctypes.c_int, int64, pointer,
                                                            int64, int64, ctypes.c_double], ctypes.c_int)  # fmt: skip
    _state["lib"] = lib  # for the kernels that bind their own functions (kernels/mxfp4.py)


def _bind(lib: ctypes.CDLL, name: str, argtypes: list, restype=None):
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = argtypes, restype
    return fn


def _new_load_lock_after_fork() -> None:
    global _load_lock
    _load_lock = threading.Lock()  # a parent's thread may have held it, and none of them is in the child


os.register_at_fork(after_in_child=_new_load_lock_after_fork)


def gemv_available() -> bool:
    """Whether the compiled kernels are here (whether a call uses them is the thread policy's say)."""
    _ensure_loaded()
    return bool(_kernels)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, threads: int | None = None
) -> torch.Tensor:
    """x [..., in] @ weight[out, in]ᵀ (+ bias [out]) → [..., out], CPU tensors (the CPU's ops call it).

    threads: the GEMV pool's threads for this call (None: the thread policy in force, kernels.policy).
    Raises ValueError where the shapes do not fit, on every path.
    """
    _check_shapes(x, weight, bias)
    if threads is not None and threads < 1:
        raise ValueError(f"linear: threads must be at least 1, got {threads}")
    out_features, in_features = weight.shape
    rows = x.numel() // max(in_features, 1)
    policy = current()
    if policy.kernel_sized(rows) and in_features > 0 and out_features < _MAX_OUT:
        _ensure_loaded()
        fn = _kernels.get(weight.dtype)
        if fn is not None and weight.is_contiguous():
            return _gemv(fn, x, weight, bias, threads or policy.threads)
    return F.linear(x, weight, bias)


def _check_shapes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if weight.dim() != 2:
        raise ValueError(f"linear: weight must be [out, in], got {list(weight.shape)}")
    out_features, in_features = weight.shape
    if x.dim() == 0 or x.shape[-1] != in_features:
        raise ValueError(f"linear: x {list(x.shape)} cannot be multiplied by weight {list(weight.shape)}ᵀ")
    if bias is not None and tuple(bias.shape) != (out_features,):
        raise ValueError(f"linear: bias {list(bias.shape)} does not fit weight {list(weight.shape)}")


def _gemv(fn, x, weight, bias, threads: int) -> torch.Tensor:
    out_features, in_features = weight.shape
    xf = x.reshape(-1, in_features)  # [rows, in]
    if xf.dtype != torch.float32 or not xf.is_contiguous():
        xf = xf.float().contiguous()
    y = torch.empty(xf.shape[0], out_features)
    _gemv_into(fn, y, xf, weight, bias, threads)
    if x.dtype != torch.float32:
        y = y.to(x.dtype)
    return y.view(*x.shape[:-1], out_features)


def _gemv_into(fn, y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias, threads: int) -> None:
    """y [rows, out] ← x [rows, in] @ weightᵀ (+ bias): float32 y and x, contiguous (the caller checks)."""
    if bias is not None:
        bias = bias.float().contiguous()  # the kernel reads out_features floats in a row
    rows, in_features = x.shape
    fn(weight.data_ptr(), x.data_ptr(), 0 if bias is None else bias.data_ptr(), y.data_ptr(),
       rows, in_features, weight.shape[0], threads)  # fmt: skip


# ---- the thread pool, for tests and benchmarks -------------------------------------------------


class _PoolStats(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("generation", "workers", "asleep", "wakeups", "solo_calls")]


def pool_stats() -> dict[str, int]:
    """The pool's counters: the last job's generation, workers started and asleep, worker wakeups, and
    calls that found the pool busy and ran on their own thread. {} without the kernel."""
    _ensure_loaded()
    if not _pool:
        return {}
    stats = _PoolStats()
    _pool["stats"](ctypes.byref(stats))
    return {name: getattr(stats, name) for name, _ in _PoolStats._fields_}


def _set_pool_generation(generation: int) -> None:
    """Start the pool's job counter at `generation` (tests of its wrap-around at 2³¹ and 2³²)."""
    if _pool["set_generation"](generation) != 0:
        raise RuntimeError("the kernel pool is busy")


def _pool_claims(num_items: int, chunk: int, threads: int) -> tuple[list[int], dict[int, int]]:
    """A job of num_items items on the pool: how many times each item was computed, and the claims as
    {first item: size} (tests of how the pool hands out work)."""
    counts = torch.zeros(num_items, dtype=torch.int32)
    sizes = torch.zeros(num_items, dtype=torch.int32)
    _pool["cover"](num_items, chunk, threads, counts.data_ptr(), sizes.data_ptr())
    return counts.tolist(), {b: s for b, s in enumerate(sizes.tolist()) if s}


@contextmanager
def _pool_held():
    """Hold the pool as another caller would: every kernel call meanwhile runs on its own thread (tests)."""
    if _pool["hold"](1) != 0:
        raise RuntimeError("the kernel pool is busy")
    try:
        yield
    finally:
        _pool["hold"](0)


# ---- the small ops around the products ----------------------------------------------------------
# Each is a handful of PyTorch kernels of a few microseconds apiece; at decode sizes that is most of
# their time. One C call instead, for float32 rows on a CPU (a prompt's rows split over the pool's
# threads, each row computed as alone: the same bits at any split); everything else keeps the PyTorch code.


def small_ops_apply(x: torch.Tensor, tokens: int) -> bool:
    """Whether the C versions of the small ops take a float32 tensor of `tokens` tokens: a decode step's
    (the fused step's own functions), and a prompt's, whose rows they split over the policy's threads.
    Measured on a 512-token pass of SmolLM2 at 2 threads, the gated activation 353 -> ~180 us, RoPE
    243 -> ~50, and PyTorch's OpenMP threads no longer woken between the pool's products."""
    if x.dtype != torch.float32 or not current().use_kernels or tokens <= 0:
        return False
    _ensure_loaded()
    return bool(_ops)


def _threads() -> int:
    return current().threads


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x²) + eps) · weight over the last dim (small_ops_apply(x) must hold)."""
    x = x.contiguous()
    y = torch.empty_like(x)
    n = x.shape[-1]
    _ops["rms_norm"](x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // n, n, eps, _threads())
    return y


def gated_act(gate: torch.Tensor, up: torch.Tensor, activation_id: int) -> torch.Tensor:
    """act(gate) · up, float32 on a CPU (small_ops_apply): gate and up [..., I] each, the halves of one
    fused product or two products. The C function the decode step's MLP calls, so the two paths give
    the same bits."""
    intermediate = gate.shape[-1]
    rows = gate.numel() // intermediate if intermediate else 0
    g, u = (t.reshape(rows, intermediate) for t in (gate, up))
    g, u = (t if t.stride(-1) == 1 else t.contiguous() for t in (g, u))
    y = torch.empty(*gate.shape[:-1], intermediate)
    _ops["gated_act"](g.data_ptr(), g.stride(0), u.data_ptr(), u.stride(0), y.data_ptr(), rows, intermediate,
                      activation_id, _threads())  # fmt: skip
    return y


def prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     scale: float, bf16: bool = False) -> torch.Tensor | None:
    """softmax(q · kᵀ · scale) · v [B, H, T, D] (laid out [B, T, H, D]) for a pass's T new queries per
    sequence (prompt_attention.c's kvlab_prompt_attention, on the kernels' pool): q [B, H, T, D], k and v
    [B, Hkv, L, D], query t at position L − T + t seeing the keys up to its own and, with `mask` ([1 or B,
    1, T, L] bool, True = may look: a causal one), only those. `bf16`: on AMX tiles with q, k, v and the
    weights rounded to bfloat16 (the int8 setting's prompt passes), where this machine has them and D is a
    multiple of 32 up to 256; else in float32. None where the C version does not take
    the call (not float32 tensors on a CPU, another layout, no kernels): the caller runs PyTorch's."""
    B, H, T, D = q.shape
    if k.dim() != 4 or v.shape != k.shape or k.shape[0] != B or k.shape[3] != D or H % k.shape[1]:
        return None
    if any(t.dtype != torch.float32 or t.device.type != "cpu" or t.stride(-1) != 1 for t in (q, k, v)):
        return None
    L = k.shape[2]
    if mask is not None:
        if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1:] != (1, T, L) or mask.shape[0] not in (1, B):
            return None
        mask = mask if mask.stride(-1) == 1 else mask.contiguous()
    if not small_ops_apply(q, B * T):
        return None
    strides = [(ctypes.c_int64 * 3)(t.stride(0), t.stride(1), t.stride(2)) for t in (q, k, v)]
    mask_strides = (ctypes.c_int64 * 2)(mask.stride(0) if mask is not None and mask.shape[0] > 1 else 0,
                                        mask.stride(2) if mask is not None else 0)  # fmt: skip
    # laid out [B, T, H, D]: a token's heads side by side, as the output projection reads them, so that the
    # caller's [B, T, H·D] is a view, not two copies (SmolLM2's 8 × 64-token pass: 118 us a layer, 1-2% of
    # the pass, on an Intel Xeon VM)
    out = torch.empty(B, T, H, D).transpose(1, 2)
    out_strides = (ctypes.c_int64 * 3)(out.stride(0), out.stride(1), out.stride(2))
    status = _ops["prompt_attention"](q.data_ptr(), strides[0], k.data_ptr(), strides[1], v.data_ptr(), strides[2],
                                      mask.data_ptr() if mask is not None else None, mask_strides, out.data_ptr(),
                                      out_strides, B, H, k.shape[1], T, L, D, scale, int(bf16), _threads())  # fmt: skip
    return out if status == 0 else None


def argmax_rows(x: torch.Tensor, threads: int) -> torch.Tensor | None:
    """Each row's argmax of x [rows, n] float32, as `x.max(dim=-1).indices` (the first of the largest, a
    NaN the largest); None where the kernels are off or x is not such a tensor."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] == 0:
        return None
    _ensure_loaded()
    if not _ops:
        return None
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.long)
    _ops["argmax"](x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), threads)
    return out


def rope_in_place(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> bool:
    """Rotate x [B, T, heads, D] in place (see model.rope.apply_rotary); False if the layout does not fit."""
    B, T, heads, D = x.shape
    if not (x.stride(3) == 1 and x.stride(2) == D and x.stride(0) == T * x.stride(1) and D <= 1024):
        return False
    if not (cos.is_contiguous() and signed_sin.is_contiguous() and cos.dtype == torch.float32):
        return False
    if cos.shape[0] != B or cos.shape[1] != T:
        return False
    _ops["rope"](x.data_ptr(), cos.data_ptr(), signed_sin.data_ptr(), B * T, heads, D, x.stride(1), _threads())
    return True
