"""decode.c's side of the CPU decode backend (kvlab/backends/cpu.py): its structs and functions.

A decoder layer is described once per model in C structs (`LayerDesc`: sizes, norm weights, each
matrix's parts and formats, biases, the q·k scale, the window, the activation) that point at the
model's own tensors; each step passes only the new tokens' RoPE angles, slots, block tables, key
counts and the cache's storage tensors (`StepDesc`). The structs are written here and in decode.c;
`struct_mismatch` compares their sizes at load, and the KV formats' ids are asked of decode.c by name
(`kv_format_ids`). Nothing here knows the model or the cache classes: the backend builds the structs.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kvlab.kernels import gemv

MAX_PARTS = 4
FLOAT_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
BLOCKS = 3
MXFP4_BLOCKS = 4  # mxfp4.c's format (not one of quant.c's)
ROUTINGS = {"softmax_topk": 0, "topk_softmax": 1}  # MoE.routing → step.h's ROUTE_*
EXPERT_ACTIVATIONS = {"silu": 0, "clamped_swiglu": 1}  # MoE.activation → step.h's EXPERT_*


class Part(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int32), ("fmt", ctypes.c_int32), ("w", ctypes.c_void_p),
                ("ldw", ctypes.c_int64), ("rows", ctypes.c_int64)]  # fmt: skip


class LinearDesc(ctypes.Structure):
    _fields_ = [("num_parts", ctypes.c_int32), ("parts", Part * MAX_PARTS), ("bias", ctypes.c_void_p),
                ("in_features", ctypes.c_int64), ("out_features", ctypes.c_int64)]  # fmt: skip


class ReduceDesc(ctypes.Structure):
    """A tensor-parallel rank's shared-memory all-reduce (kvlab/parallel/shm.py's segment and call counter)."""

    _fields_ = [("segment", ctypes.c_void_p), ("rank", ctypes.c_int32), ("world", ctypes.c_int32),
                ("capacity", ctypes.c_int64), ("calls", ctypes.c_void_p), ("timeout_s", ctypes.c_double)]  # fmt: skip


class MoeDesc(ctypes.Structure):
    """A mixture of experts as the layer's MLP (step.h's Moe): expert e's parts are expert 0's + e · stride."""

    _fields_ = [("num_experts", ctypes.c_int64), ("top_k", ctypes.c_int64), ("expert_size", ctypes.c_int64),
                ("shared_size", ctypes.c_int64), ("routing", ctypes.c_int32), ("norm_topk_prob", ctypes.c_int32),
                ("activation", ctypes.c_int32), ("swiglu_limit", ctypes.c_float), ("swiglu_alpha", ctypes.c_float),
                ("router", LinearDesc), ("gate_up", LinearDesc), ("down", LinearDesc),
                ("gate_up_stride", ctypes.c_int64 * MAX_PARTS), ("down_stride", ctypes.c_int64 * MAX_PARTS),
                ("gate_up_bias", ctypes.c_void_p), ("down_bias", ctypes.c_void_p),
                ("shared_gate_up", LinearDesc), ("shared_down", LinearDesc), ("shared_gate", LinearDesc)]  # fmt: skip


class DeltaNetDesc(ctypes.Structure):
    """A Gated DeltaNet mixer (step.h's DeltaNet): its sizes, in_proj's four parts (conv input, z, b, a), out_proj,
    the conv taps, A_log, dt_bias and the per-head output norm."""

    _fields_ = [("key_heads", ctypes.c_int64), ("value_heads", ctypes.c_int64), ("key_dim", ctypes.c_int64),
                ("value_dim", ctypes.c_int64), ("conv_kernel", ctypes.c_int64), ("tiled", ctypes.c_int32),
                ("norm_eps", ctypes.c_float), ("in_proj", LinearDesc), ("out", LinearDesc),
                ("conv_weight", ctypes.c_void_p), ("A_log", ctypes.c_void_p), ("dt_bias", ctypes.c_void_p),
                ("norm", ctypes.c_void_p)]  # fmt: skip


class LayerDesc(ctypes.Structure):
    _fields_ = [("hidden", ctypes.c_int64), ("heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("intermediate", ctypes.c_int64), ("eps", ctypes.c_float),
                ("qk_scale", ctypes.c_float), ("activation", ctypes.c_int32), ("window", ctypes.c_int64),
                ("attn_norm", ctypes.c_void_p), ("mlp_norm", ctypes.c_void_p), ("attn_out_norm", ctypes.c_void_p),
                ("mlp_out_norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p),
                ("qkv", LinearDesc), ("o", LinearDesc), ("gate_up", LinearDesc), ("down", LinearDesc),
                ("reduce", ctypes.POINTER(ReduceDesc)), ("qk_norm_whole", ctypes.c_int32),
                ("sinks", ctypes.c_void_p), ("moe", ctypes.POINTER(MoeDesc)), ("gate", LinearDesc),
                ("rotary_dim", ctypes.c_int64), ("deltanet", ctypes.POINTER(DeltaNetDesc))]  # fmt: skip


class KVStore(ctypes.Structure):
    """One layer's keys (or values) in the cache: the format's id and its codes' and scales' tensors."""

    _fields_ = [("fmt", ctypes.c_int32), ("codes", ctypes.c_void_p), ("scales", ctypes.c_void_p)]


class StepDesc(ctypes.Structure):
    _fields_ = [("batch", ctypes.c_int64), ("cos", ctypes.c_void_p), ("signed_sin", ctypes.c_void_p),
                ("k", KVStore), ("v", KVStore), ("block_size", ctypes.c_int64),
                ("slots", ctypes.c_void_p), ("block_tables", ctypes.c_void_p), ("table_stride", ctypes.c_int64),
                ("num_keys", ctypes.c_void_p), ("first_key", ctypes.c_void_p), ("max_keys", ctypes.c_int64),
                ("scratch", ctypes.c_void_p),
                ("rotate_k", ctypes.c_int32), ("rotate_v", ctypes.c_int32), ("moe_scratch", ctypes.c_void_p),
                ("conv_state", ctypes.c_void_p), ("ssm_state", ctypes.c_void_p), ("state_slots", ctypes.c_void_p),
                ("mixer_scratch", ctypes.c_void_p), ("phase_seconds", ctypes.c_void_p)]  # fmt: skip


class Angles(ctypes.Structure):
    """One rotary table's angles at a step's positions (step.h's Angles)."""

    _fields_ = [("cos", ctypes.c_void_p), ("signed_sin", ctypes.c_void_p)]


class KVView(ctypes.Structure):
    """One KV group's tables as a layer with one window reads them (step.h's KVView: StepDesc's fields)."""

    _fields_ = [("slots", ctypes.c_void_p), ("block_tables", ctypes.c_void_p), ("table_stride", ctypes.c_int64),
                ("num_keys", ctypes.c_void_p), ("first_key", ctypes.c_void_p)]  # fmt: skip


class LayerStep(ctypes.Structure):
    """What differs from layer to layer in a step (step.h's LayerStep): the layer, its K/V storage, its
    angles and KV view (indices into the step's tables, -1: none), a DeltaNet's states."""

    _fields_ = [("layer", ctypes.POINTER(LayerDesc)), ("k", KVStore), ("v", KVStore), ("angles", ctypes.c_int32),
                ("view", ctypes.c_int32), ("conv_state", ctypes.c_void_p), ("ssm_state", ctypes.c_void_p)]  # fmt: skip


MAX_HEAD_DIM = 512  # decode.c's row buffers


def kv_format_ids() -> dict[str, int]:
    """KV storage format name (kv/formats.py's `name`) → decode.c's id, as decode.c names them
    (kvlab_kv_format): no table of numbers is copied between the two sides. {} without the library."""
    return _names("kv_format")


@functools.cache
def activation_ids() -> dict[str, int]:
    """A gated MLP's activation (DenseMLP.activation) → decode.c's id (kvlab_decode_activation); asked once
    (the modules' decode passes read it every layer)."""
    return _names("activation")


def _names(what: str) -> dict[str, int]:
    lib = library()
    if lib is None:
        return {}
    ids = {}
    for i in range(64):
        name = lib[what](i)
        if name is None:
            break
        ids[name.decode()] = i
    return ids


def kv_write(fmt_name: str, rotate: bool, x: torch.Tensor, slots: torch.Tensor, parts: list[torch.Tensor]) -> bool:
    """x [N, Hkv, D] (float32, D contiguous) → one layer's storage tensors `parts` (kv/formats.py's storage,
    [blocks, block size, Hkv, ...] each) at the token slots `slots` [N], encoded as the format `fmt_name`
    encodes them (rotated by H first with `rotate`): kv_codec.c's kvlab_kv_write, the bytes that
    formats.py's encode and index_copy_ write. False where it does not take the call (no library, a
    format or head size it does not know, other dtypes or layouts, a slot outside the storage)."""
    lib, ids = library(), kv_format_ids()
    if lib is None or fmt_name not in ids or x.dim() != 3 or not parts:
        return False
    N, Hkv, D = x.shape
    codes, scales = parts[0], parts[1] if len(parts) > 1 else None
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.stride(-1) != 1 or N == 0:
        return False
    if slots.dtype != torch.int64 or slots.device.type != "cpu" or slots.shape != (N,) or not slots.is_contiguous():
        return False
    if any(not t.is_contiguous() or t.device.type != "cpu" or t.dim() < 3 or t.shape[2] != Hkv for t in parts):
        return False
    if int(slots.min()) < 0 or int(slots.max()) >= codes.shape[0] * codes.shape[1]:
        return False  # index_copy_ says what is wrong
    status = lib["kv_write"](ids[fmt_name], int(rotate), x.data_ptr(), x.stride(0), x.stride(1), N, Hkv, D,
                             slots.data_ptr(), codes.data_ptr(), scales.data_ptr() if scales is not None else None)  # fmt: skip
    return status == 0


def kv_gather(fmt_name: str, rotate: bool, parts: list[torch.Tensor], blocks: torch.Tensor,
              threads: int) -> torch.Tensor | None:
    """Whole blocks of one layer's storage `parts` (kv/formats.py's storage, [blocks, block size, Hkv, ...]
    each, in the format `fmt_name`), the blocks `blocks` [n] in that order, decoded to float32 [n · block
    size, Hkv, D] (rotated back by H with `rotate`): kv_codec.c's kvlab_kv_gather, the values formats.py's
    index_select and decode give. None where it does not take the call (no library, a format or head
    size it does not know, other layouts, a block id outside the storage)."""
    lib, ids = library(), kv_format_ids()
    if lib is None or fmt_name not in ids or not parts or blocks.dim() != 1:
        return None
    codes, scales = parts[0], parts[1] if len(parts) > 1 else None
    if any(not t.is_contiguous() or t.device.type != "cpu" or t.dim() < 3 or t.shape[:3] != codes.shape[:3] for t in parts):
        return None
    if blocks.dtype != torch.int64 or blocks.device.type != "cpu" or not blocks.is_contiguous():
        return None
    from kvlab.kv.formats import KV_FORMATS

    num_blocks, bs, hkv = codes.shape[:3]
    D = codes.shape[3] * (2 if fmt_name == "q4_0" else 1) if codes.dim() == 4 else 0
    storage = KV_FORMATS[fmt_name].storage(D) if D else []  # each part's shape past [blocks, bs, Hkv], dtype
    if len(storage) != len(parts) or any(tuple(t.shape[3:]) != shape or t.dtype != dtype
                                         for t, (shape, dtype) in zip(parts, storage)):  # fmt: skip
        return None
    n = blocks.numel()
    if n and (int(blocks.min()) < 0 or int(blocks.max()) >= num_blocks):
        return None  # index_select says what is wrong
    out = torch.empty(n * bs, hkv, D)
    status = lib["kv_gather"](ids[fmt_name], int(rotate), codes.data_ptr(), scales.data_ptr() if scales is not None else None,
                              blocks.data_ptr(), n, bs * hkv, D, out.data_ptr(), threads)  # fmt: skip
    return out if status == 0 else None


def attention_rows(on: bool) -> bool | None:
    """Whether the decode step's attention may read float32 / bfloat16 / float16 rows in place
    (attention.c's attend_rows: the same bits as its general form, faster); returns the setting it
    replaces, None where this build has no such form (no AVX-512) or no library. The tests' seam."""
    lib = library()
    was = lib["attention_rows"](int(on)) if lib else -1
    return None if was < 0 else bool(was)


STRUCTS = {"Part": Part, "LinearDesc": LinearDesc, "LayerDesc": LayerDesc, "KVStore": KVStore, "StepDesc": StepDesc,
           "ReduceDesc": ReduceDesc, "MoeDesc": MoeDesc, "DeltaNetDesc": DeltaNetDesc, "Angles": Angles, "KVView": KVView,
           "LayerStep": LayerStep}  # fmt: skip


def struct_mismatch(lib) -> str | None:
    """Which struct decode.c and this file lay out differently (a size differs), None when all agree."""
    sizes = (ctypes.c_int64 * len(STRUCTS))()
    lib["struct_sizes"](sizes)
    for (name, struct), size in zip(STRUCTS.items(), sizes):
        if ctypes.sizeof(struct) != size:
            return f"decode.c's {name} is {size} bytes, decode.py's {ctypes.sizeof(struct)}"
    return None


def library():
    """decode.c's bound functions, None where the library could not be built (gemv.build_error says why)."""
    gemv._ensure_loaded()
    lib = gemv._state.get("lib")
    if gemv._decode and lib is not None and "moe_scratch_floats" not in gemv._decode:  # moe.c's, deltanet.c's
        gemv._decode["moe_scratch_floats"] = gemv._bind(lib, "kvlab_moe_scratch_floats",
                                                        [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64], ctypes.c_int64)  # fmt: skip
        gemv._decode["deltanet_scratch_floats"] = gemv._bind(lib, "kvlab_deltanet_scratch_floats",
                                                             [ctypes.c_void_p, ctypes.c_int64], ctypes.c_int64)  # fmt: skip
    return gemv._decode or None
