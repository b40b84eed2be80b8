"""Gated DeltaNet's decode step in C (deltanet.c): the conv, the norms and the delta rule of B sequences, one
token each, their states updated in place in the state pool (kvlab/kv/state_pool.py). Float32 states only;
kvlab/model/deltanet.py computes everything else (and everything when `applies` says no)."""

from __future__ import annotations

import ctypes
import functools

import torch

from kvlab.kernels import gemv
from kvlab.kernels.policy import current


@functools.cache
def _library():
    gemv._ensure_loaded()
    lib = gemv._state.get("lib")
    if lib is None:
        return None
    int64, pointer = ctypes.c_int64, ctypes.c_void_p
    return gemv._bind(lib, "kvlab_deltanet_decode_f32", [pointer] * 8 + [int64] * 7 + [ctypes.c_int] * 2, ctypes.c_int)


def applies(conv: torch.Tensor, ssm: torch.Tensor, rows: int) -> bool:
    """Whether the C step takes a decode batch of `rows` sequences over these state tensors."""
    return (conv.dtype == ssm.dtype == torch.float32 and conv.is_contiguous()
            and ssm.is_contiguous() and ssm.shape[-1] <= 1024 and current().kernel_sized(rows)
            and _library() is not None)  # fmt: skip


def decode(mixed, g, beta, weight, conv, ssm, slots: torch.Tensor, num_k_heads: int, tiled: bool) -> torch.Tensor:
    """mixed [B, C], g, beta [B, H] float32, conv taps [C, K] → o [B, H, Dv]; conv [slots, C, K − 1] and
    ssm [slots, H, Dk, Dv] updated in place at `slots` [B]."""
    mixed, g, beta = (t.float().contiguous() for t in (mixed, g, beta))
    weight, slots = weight.float().contiguous(), slots.to(torch.int64).contiguous()
    B, C = mixed.shape
    _, H, Dk, Dv = ssm.shape
    out = torch.empty(B, H, Dv)
    status = _library()(mixed.data_ptr(), g.data_ptr(), beta.data_ptr(), weight.data_ptr(), conv.data_ptr(),
                        ssm.data_ptr(), slots.data_ptr(), out.data_ptr(), B, C, weight.shape[1], H, num_k_heads, Dk, Dv,
                        int(tiled), current().threads)  # fmt: skip
    if status:
        raise ValueError(f"deltanet: the C step refused {H} value heads of {Dv} for {num_k_heads} key heads")
    return out
