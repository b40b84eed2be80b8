"""A mixed pass's decode rows attend as the decode step does: straight from the paged cache's stored codes.

A step that carries prompt chunks beside the running sequences' next tokens runs the model's modules
(continuous batching: every step while prompts arrive). Their one-token rows used to gather every key
and value of their sequences into float32 tensors (`PagedKVCache.gather`) for PyTorch's attention; here
they go through the decode step's own attention (kernels/attention.c), which reads each stored row once,
decodes it in registers, and splits the (sequence, chunk of keys) pairs over the kernels' pool:

    out = attend_rows(cache, layer, q, group, g, positions, softmax)   # None: not taken, gather instead

The rows' numbers are then the decode step's: a sequence's token gets the same attention whether its
step was a pure decode step (the C step) or a mixed one. Taken where the C step would read the cache
(`unreadable_reason`: float32 activations, a format decode.c reads, head_dim a multiple of 8 up to 512).
"""

from __future__ import annotations

import ctypes
import weakref

import torch

from kvlab.backends.cpu_kv import GroupView, store, unreadable_reason
from kvlab.kernels.decode import LayerDesc, StepDesc, kv_format_ids, library
from kvlab.kernels.policy import current
from kvlab.kv.formats import unrotated


def attend_rows(cache, layer: int, q: torch.Tensor, group, g: int, positions: torch.Tensor,
                softmax) -> torch.Tensor | None:
    """q [H, B, D] (the group's B one-token rows, after RoPE; their K/V already in the cache) → [H, B, D]:
    softmax(q · kᵀ · scale) · v over the keys each sequence's window shows, `softmax` the layer's
    (model/attention.py's Softmax: scale, sinks). None where the kernels do not take the call."""
    lib = library()
    H, B, D = q.shape
    if lib is None or B == 0 or q.dtype != torch.float32 or D != cache.head_dim or H % cache.num_kv_heads:
        return None
    if not cache.v_parts[layer] or (softmax.sinks is not None and softmax.sinks.shape != (H,)):
        return None
    reads = _reads(cache)
    if reads is None:
        return None
    view = _view(cache, g, group, positions)
    window = cache.window(layer)
    rows = q.transpose(0, 1).contiguous()  # [B, H, D]: each row's heads side by side
    sinks = softmax.sinks.float().contiguous() if softmax.sinks is not None else None
    desc = LayerDesc(heads=H, kv_heads=cache.num_kv_heads, head_dim=D, qk_scale=softmax.scale,
                     sinks=sinks.data_ptr() if sinks is not None else None)  # fmt: skip
    k, v = store(reads[0], cache.k_parts[layer]), store(reads[1], cache.v_parts[layer])
    rotate = int(cache.formats.rotate_k), int(cache.formats.rotate_v)
    step = StepDesc(B, None, None, k, v, cache.block_size, None, view.tables_ptr, view.stride, view.num_keys_ptr,
                    view.first_key(window), view.max_keys, None, *rotate)  # fmt: skip
    scratch = torch.empty(lib["paged_attention_scratch"](B, H, D, view.max_keys))
    out = torch.empty(B, H, D)
    lib["paged_attention"](ctypes.byref(desc), ctypes.byref(step), rows.data_ptr(), H * D, out.data_ptr(),
                           scratch.data_ptr(), current().threads)  # fmt: skip
    return out.transpose(0, 1)  # [H, B, D]


# What a pass's layers share, worked out at its first layer: whether the cache can be read, and each KV
# group's view of the rows (the same group object from layer to layer of one pass)
_cache_of: tuple = (None, None)  # (a weak reference to the cache, its (k, v) format ids or None)
_view_of: dict[int, tuple] = {}  # KV group → (its attention group, the cache, its GroupView)


def _reads(cache) -> tuple[int, int] | None:
    """decode.c's ids of the cache's key and value formats, None where the C step cannot read it."""
    global _cache_of
    if _cache_of[0] is None or _cache_of[0]() is not cache:
        ids = kv_format_ids()
        names = unrotated(cache.formats.k).name, unrotated(cache.formats.v).name
        reads = None if unreadable_reason(cache) else (ids[names[0]], ids[names[1]])
        _cache_of = (weakref.ref(cache), reads)
    return _cache_of[1]


def _view(cache, g: int, group, positions: torch.Tensor) -> GroupView:
    """KV group g's view of the rows: once a pass (its first layer)."""
    held = _view_of.get(g)
    if held is None or held[0] is not group or held[1]() is not cache:
        view = GroupView(cache, g, group, positions)
        held = _view_of[g] = (group, weakref.ref(cache), view)
    return held[2]
