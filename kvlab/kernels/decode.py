"""A whole decode step's decoder layers in one C call each (decode.c): the step's fixed cost cut.

    step = FusedDecode.for_model(model)          # None where the model or the machine does not fit
    if step and step.applies(input_ids, cache, meta, policy):
        logits = step.run(input_ids, cache, meta, logits_index, policy)

What a layer holds (norm weights, each matrix's parts and formats, biases) is described once per
model in C structs that point at the model's own tensors; each step only passes the new tokens'
RoPE angles, slots, block tables, key counts and the cache's storage tensors. It takes decode-sized
passes (every token a sequence's next one) on a CPU in float32 under the thread policy's kernel
rows, with a paged cache whose keys and values are each stored as float32, q8_0, q4_0 or fp8_e4m3
(kv/formats.py; K and V may differ), each Hadamard-rotated or not (`Rotated`). The kernel writes
the new token's K and V in the cache's format, the same bytes as the format's `encode`, and attends
over the stored codes directly: each cached row is decoded to code × scale as it is read (the values
`decode` gives), so a quantized cache is read in its own bytes — 34 per 32 values for q8_0, not 128.
Every other pass runs the model's modules as usual.
"""

from __future__ import annotations

import ctypes

import torch

from kvlab.kernels import gemv
from kvlab.kernels.policy import ThreadPolicy

MAX_PARTS = 3
FLOAT_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
BLOCKS = 3


class Part(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int32), ("fmt", ctypes.c_int32), ("w", ctypes.c_void_p),
                ("ldw", ctypes.c_int64), ("rows", ctypes.c_int64)]  # fmt: skip


class LinearDesc(ctypes.Structure):
    _fields_ = [("num_parts", ctypes.c_int32), ("parts", Part * MAX_PARTS), ("bias", ctypes.c_void_p),
                ("in_features", ctypes.c_int64), ("out_features", ctypes.c_int64)]  # fmt: skip


class LayerDesc(ctypes.Structure):
    _fields_ = [("hidden", ctypes.c_int64), ("heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("intermediate", ctypes.c_int64), ("eps", ctypes.c_float),
                ("attn_norm", ctypes.c_void_p), ("mlp_norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("qkv", LinearDesc), ("o", LinearDesc), ("gate_up", LinearDesc),
                ("down", LinearDesc)]  # fmt: skip


class KVStore(ctypes.Structure):
    """One layer's keys (or values) in the cache: the format's id and its codes' and scales' tensors."""

    _fields_ = [("fmt", ctypes.c_int32), ("codes", ctypes.c_void_p), ("scales", ctypes.c_void_p)]


class StepDesc(ctypes.Structure):
    _fields_ = [("batch", ctypes.c_int64), ("cos", ctypes.c_void_p), ("signed_sin", ctypes.c_void_p),
                ("k", KVStore), ("v", KVStore), ("block_size", ctypes.c_int64),
                ("slots", ctypes.c_void_p), ("block_tables", ctypes.c_void_p), ("table_stride", ctypes.c_int64),
                ("num_keys", ctypes.c_void_p), ("max_keys", ctypes.c_int64), ("scratch", ctypes.c_void_p),
                ("rotate_k", ctypes.c_int32), ("rotate_v", ctypes.c_int32)]  # fmt: skip


MAX_HEAD_DIM = 512  # decode.c's row buffers
KV_F32, KV_Q8_0, KV_Q4_0, KV_FP8 = range(4)  # decode.c's ids of the cache's storage formats


def kv_format_id(fmt) -> int | None:
    """decode.c's id of a KV storage format (kv/formats.py; a Rotated one: its base's), None for one it
    does not read."""
    from kvlab.kv.formats import FP8E4M3, Q4_0, Q8_0, FloatFormat, unrotated

    fmt = unrotated(fmt)
    if isinstance(fmt, FloatFormat):
        return KV_F32 if fmt.dtype == torch.float32 else None
    return {Q8_0: KV_Q8_0, Q4_0: KV_Q4_0, FP8E4M3: KV_FP8}.get(type(fmt))


def _library():
    """decode.c's bound functions, None where the library could not be built."""
    gemv._ensure_loaded()
    return getattr(gemv, "_decode", None) or None


def _float32_vector(t) -> bool:
    return t is not None and t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu"


def _linear(module) -> LinearDesc | None:
    """A linear layer as the C kernels see it, or None when one of its matrices is not theirs."""
    from kvlab.kernels import quant
    from kvlab.model.layers import Linear
    from kvlab.quant.linear import PackedLinear

    if not isinstance(module, (Linear, PackedLinear)):
        return None  # another implementation of the linear seam (a tensor-parallel shard, ...)
    desc = LinearDesc(in_features=module.in_features, out_features=module.out_features)
    bias = module.bias
    if bias is not None:
        if not _float32_vector(bias):
            return None
        desc.bias = bias.data_ptr()
    if isinstance(module, Linear):
        w = module.weight
        if w.dtype not in FLOAT_KINDS or not w.is_contiguous() or w.device.type != "cpu":
            return None
        desc.num_parts = 1
        desc.parts[0] = Part(FLOAT_KINDS[w.dtype], 0, w.data_ptr(), module.in_features * w.element_size(), w.shape[0])
        return desc
    if isinstance(module, PackedLinear):
        ids = quant._format_ids()
        packed = module.packed()
        if len(packed) > MAX_PARTS or any(p.fmt not in ids or not p.data.is_contiguous() for p in packed):
            return None
        desc.num_parts = len(packed)
        for i, p in enumerate(packed):
            desc.parts[i] = Part(BLOCKS, ids[p.fmt], p.data.data_ptr(), p.data.shape[1], p.shape[0])
        return desc
    return None


class FusedDecode:
    """The C description of every decoder layer of one model, and the step that runs them."""

    def __init__(self, model, layers: list[LayerDesc], lib):
        self.model, self.layers, self.lib = model, layers, lib
        c = model.config
        self.geometry = (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size)

    @classmethod
    def for_model(cls, model) -> FusedDecode | None:
        """The fused step for `model`, or None where a layer is not one decode.c computes."""
        from kvlab.model.attention import sdpa_attention
        from kvlab.model.layers import RMSNorm, SwiGLU
        from kvlab.model.transformer import DecoderLayer

        lib = _library()
        if lib is None or model.dtype != torch.float32 or model.device.type != "cpu":
            return None
        if model.embed_scale is not None or model.logit_softcap is not None:
            return None  # Gemma's scaled embeddings and capped logits are not the step's
        c = model.config
        layers = []
        for layer in model.layers:
            attn, mlp = layer.attn, layer.mlp
            norms = [layer.input_norm, layer.post_attn_norm] + ([attn.q_norm, attn.k_norm] if attn.q_norm else [])
            if not isinstance(mlp, SwiGLU) or attn.attend is not sdpa_attention:
                return None  # another MLP, or the lab's materialized attention
            own = (attn.window, attn.scale, attn.rope)  # a sliding window, a q·k scale, a rotary table of its own
            if type(layer) is not DecoderLayer or own != (None, None, None):
                return None  # those, or Gemma's four norms: not what decode.c computes
            if not all(type(n) is RMSNorm and _float32_vector(n.weight) and n.eps == c.rms_norm_eps for n in norms):
                return None
            parts = [_linear(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            if any(p is None for p in parts):
                return None
            desc = LayerDesc(c.hidden_size, attn.num_heads, attn.num_kv_heads, attn.head_dim, mlp.intermediate_size,
                             c.rms_norm_eps, layer.input_norm.weight.data_ptr(), layer.post_attn_norm.weight.data_ptr(),
                             attn.q_norm.weight.data_ptr() if attn.q_norm else None,
                             attn.k_norm.weight.data_ptr() if attn.k_norm else None, *parts)  # fmt: skip
            layers.append(desc)
        return cls(model, layers, lib)

    def applies(self, input_ids: torch.Tensor, cache, meta, policy: ThreadPolicy) -> bool:
        """Whether this pass is a decode step it can run: one group of B sequences, one token each."""
        from kvlab.kv.paged import PagedKVCache, PagedMetadata
        from kvlab.model.attention import sdpa_attention

        if not isinstance(meta, PagedMetadata) or not isinstance(cache, PagedKVCache) or len(meta.groups) != 1:
            return False
        if any(layer.attn.attend is not sdpa_attention for layer in self.model.layers):  # set_attention since
            return False
        group, tokens = meta.groups[0], input_ids.shape[1]
        if not (group.batch_size == tokens and group.lo == 0 and group.hi == tokens and policy.kernel_sized(tokens)):
            return False
        formats, D = cache.formats, cache.head_dim
        if cache.dtype != torch.float32 or D > MAX_HEAD_DIM or D % 8:
            return False
        if kv_format_id(formats.k) is None or kv_format_id(formats.v) is None:
            return False
        return all(t.is_contiguous() for t in cache.tensors())

    def run(self, input_ids: torch.Tensor, cache, meta, logits_index: torch.Tensor, policy: ThreadPolicy):
        """Logits [1, S, V] of the rows at `logits_index`, as the model's own forward would give them."""
        model, group = self.model, meta.groups[0]
        x = model.embed_tokens(input_ids)[0].float().contiguous()  # [B, E]
        positions = meta.positions[0]
        cos, sin = model.rotary.cos[positions].contiguous(), model.rotary.sin[positions].contiguous()  # [B, D]
        num_keys = (positions + 1).contiguous()
        tables = group.block_tables.contiguous()
        B, max_keys = x.shape[0], int(group.num_keys)
        floats = self.lib["scratch_floats"](B, *self.geometry, max_keys)
        scratch = torch.empty(floats)
        step = StepDesc(B, cos.data_ptr(), sin.data_ptr(), KVStore(), KVStore(), cache.block_size,
                        meta.slot_mapping.data_ptr(), tables.data_ptr(), tables.shape[1], num_keys.data_ptr(),
                        max_keys, scratch.data_ptr(), int(cache.formats.rotate_k), int(cache.formats.rotate_v))  # fmt: skip
        k_fmt, v_fmt = kv_format_id(cache.formats.k), kv_format_id(cache.formats.v)
        run_layer = self.lib["layer"]
        for i, desc in enumerate(self.layers):
            step.k, step.v = _store(k_fmt, cache.k_parts[i]), _store(v_fmt, cache.v_parts[i])
            run_layer(ctypes.byref(desc), ctypes.byref(step), x.data_ptr(), policy.threads)
        x = x[logits_index]  # [S, E]
        return model.lm_head(model.norm(x[None])).float()  # [1, S, V]


def _store(fmt: int, parts: list[torch.Tensor]) -> KVStore:
    """A layer's storage tensors (codes, then scales where the format has them) as decode.c reads them."""
    return KVStore(fmt, parts[0].data_ptr(), parts[1].data_ptr() if len(parts) > 1 else None)
