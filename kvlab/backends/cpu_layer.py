"""One decoder layer described to decode.c (`LayerDesc`), read from its modules: the CPU decode
backend's (backends/cpu.py) description of each layer, beside its products' (cpu_linear.py), its
experts' (cpu_moe.py) and a Gated DeltaNet mixer's (cpu_deltanet.py).

    desc = describe_layer(model, layer, keep)    # a LayerDesc, or a str: why the C step cannot run it

Its norms (Llama's and Qwen's two or Gemma's four, the x̂ · (1 + w) of Gemma's as the weights 1 + w),
q/k norms, the fused q/k/v and o products, the q·k scale and sliding window, a sigmoid output gate and
partial rotary (Qwen3.5), attention sinks (gpt-oss), the gated MLP or the mixture of experts, and a
tensor-parallel shard's all-reduces after o and after the MLP. `keep` receives whatever the
description points at that must live as long as it (a Gemma norm's 1 + w, the ctypes structs).
"""

from __future__ import annotations

import ctypes
import math

import torch

from kvlab.backends.cpu_deltanet import describe_deltanet
from kvlab.backends.cpu_linear import describe_linear
from kvlab.kernels.decode import LayerDesc, LinearDesc, ReduceDesc, activation_ids


def is_attention(mixer) -> bool:
    """A softmax-attention mixer (kvlab.model.transformer.Attention), not a recurrent one."""
    return hasattr(mixer, "qkv_proj")


def describe_layer(model, layer, keep: list) -> LayerDesc | str:
    """decode.c's description of one decoder layer, or why it cannot take it."""
    from kvlab.model.attention import sdpa_attention
    from kvlab.model.layers import GatedMLP
    from kvlab.backends.cpu_moe import describe_moe
    from kvlab.model.moe import MoEBlock
    from kvlab.model.transformer import DecoderLayer, SandwichDecoderLayer

    from kvlab.model.deltanet import GatedDeltaNet

    attn, mlp, eps = layer.attn, layer.mlp, model.config.rms_norm_eps
    deltanet = isinstance(attn, GatedDeltaNet)
    if not deltanet and not is_attention(attn):  # multi-head latent attention (kvlab.model.mla)
        return f"its {type(attn).__name__} mixer is not one decode.c computes"
    if not deltanet and attn.attend is not sdpa_attention:
        return "the lab's materialized attention"
    if not deltanet and attn.clip_qkv is not None:
        return "q, k and v clamped (OLMoE's clip_qkv)"
    activations = activation_ids()
    moe_reduce = getattr(mlp, "inner", None)  # a tensor-parallel shard's experts, summed over the ranks
    moe = isinstance(mlp, MoEBlock) or isinstance(moe_reduce, MoEBlock)
    if not moe and (not isinstance(mlp, GatedMLP) or mlp.activation not in activations):
        return f"its MLP is {type(mlp).__name__} (the C step runs {', '.join(activations)} gated MLPs and experts)"
    if type(layer) is DecoderLayer:
        norms = [layer.input_norm, layer.post_attn_norm, None, None]  # before attention, before the MLP
    elif type(layer) is SandwichDecoderLayer:  # Gemma: each one's output normalised too
        norms = [layer.input_norm, layer.pre_mlp_norm, layer.post_attn_norm, layer.post_mlp_norm]
    else:
        return f"a {type(layer).__name__}, not a layer decode.c computes"
    norms += [None, None] if deltanet else [attn.q_norm, attn.k_norm]
    weights = [_norm_weight(n, eps, keep) if n is not None else None for n in norms]
    if any(isinstance(w, str) for w in weights):
        return next(w for w in weights if isinstance(w, str))
    # the all-reduce after o_proj and after the MLP (down_proj, or the whole mixture of experts)
    reduce = _row_parallel(attn.out_proj if deltanet else attn.o_proj, mlp if moe else mlp.down_proj, keep)
    if isinstance(reduce, str):
        return reduce
    if deltanet and reduce:
        return "a tensor-parallel shard of a Gated DeltaNet layer"
    mixer = [] if deltanet else [attn.qkv_proj, attn.o_proj]
    if moe:
        mlp = moe_reduce if moe_reduce is not None else mlp
        products = mixer
    else:
        products = mixer + [mlp.gate_up_proj, mlp.down_proj]
    parts = [describe_linear(getattr(m, "inner", m) if reduce else m) for m in products]  # a shard's own matrices
    experts = describe_moe(mlp) if moe else None
    recurrent = describe_deltanet(attn) if deltanet else None
    gate = describe_linear(attn.gate_proj) if getattr(attn, "gate_proj", None) is not None else LinearDesc()
    for p in parts + [experts, recurrent, gate]:
        if isinstance(p, str):
            return p
    if deltanet:
        parts = [LinearDesc(), LinearDesc()] + parts  # no q/k/v or o
    if moe:
        parts += [LinearDesc(), LinearDesc()]  # the dense gate/up and down: none
    attn_norm, mlp_norm, attn_out, mlp_out, q_norm, k_norm = weights
    heads, kv_heads, head_dim = (0, 0, 0) if deltanet else (attn.num_heads, attn.num_kv_heads, attn.head_dim)
    scale = 0.0 if deltanet else attn.scale if attn.scale is not None else 1.0 / math.sqrt(head_dim)  # SDPA's default
    activation = 0 if moe else activations[mlp.activation]
    desc = LayerDesc(model.config.hidden_size, heads, kv_heads, head_dim, mlp.intermediate_size, eps, scale,
                     activation, 0 if deltanet else attn.window or 0,
                     attn_norm, mlp_norm, attn_out, mlp_out, q_norm, k_norm, *parts)  # fmt: skip
    desc.gate = gate
    if deltanet:
        keep.append(recurrent)
        desc.deltanet = ctypes.pointer(recurrent)
    else:
        desc.rotary_dim = model._rotary_of(attn.rope).cos.shape[-1]  # the table's width: head_dim, or partial rotary's
        desc.qk_norm_whole = int(attn.qk_norm_whole)
    if not deltanet and attn.sinks is not None:
        sinks = attn.sinks.weight
        if sinks.dtype != torch.float32 or not sinks.is_contiguous():
            return "attention sinks not float32"
        desc.sinks = sinks.data_ptr()
    if experts is not None:
        keep.append(experts)
        desc.moe = ctypes.pointer(experts)
    if reduce:
        desc.reduce = ctypes.pointer(reduce[0])
        desc._group = reduce[1]  # for the error a lost rank gives
    return desc


def _row_parallel(o_proj, down_proj, keep: list):
    """A tensor-parallel shard's all-reduce as decode.c makes it (the group's shared-memory segment and
    call counter) with its group; None for a whole model; or why the C step cannot sum over the ranks."""
    from kvlab.parallel.layers import RowParallel
    from kvlab.parallel.shm import CAPACITY_FLOATS

    wrapped = [isinstance(m, RowParallel) for m in (o_proj, down_proj)]
    if not any(wrapped):
        return None
    group = o_proj.group if wrapped[0] else down_proj.group
    if not all(wrapped) or down_proj.group is not group:
        return "a partly row-parallel layer"
    shm = group.shm
    if shm is None:
        return "its all-reduce runs over gloo (ranks on several hosts, or KVLAB_SHM_ALLREDUCE=0)"
    reduce = ReduceDesc(shm.address, shm.rank, shm.world, CAPACITY_FLOATS, shm.calls_address(), group.timeout_s)
    keep.append(reduce)
    return reduce, group


def describe_head(model, keep: list) -> tuple | str:
    """The final norm and the LM head as decode.c's kvlab_decode_head takes them: (the head's LinearDesc, the
    norm's weights' address, its eps), or why it cannot (a tensor-parallel shard's head, another norm)."""
    from kvlab.backends.cpu_linear import describe_linear

    head = describe_linear(model.lm_head)
    if isinstance(head, str):
        return head
    eps = getattr(model.norm, "eps", None)
    norm = _norm_weight(model.norm, eps, keep)
    return norm if isinstance(norm, str) else (head, norm, eps)


def embedding_format(model) -> int | None:
    """quant.c's id of the token table's format where the decode step looks its rows up in C
    (kvlab_quant_dequantize_rows: a GGUF table of float32 rows, the module's bits), else None (the module)."""
    from kvlab.kernels import quant
    from kvlab.quant.linear import PackedEmbedding

    emb = model.embed_tokens
    if type(emb) is not PackedEmbedding or emb.out_dtype != torch.float32:
        return None
    return quant._format_ids().get(emb.fmt)


def _norm_weight(norm, eps: float, keep: list[torch.Tensor]) -> int | str:
    """The address of the float32 weights decode.c multiplies x̂ by: w, or Gemma's offset + w."""
    from kvlab.model.layers import OffsetRMSNorm, RMSNorm

    if type(norm) not in (RMSNorm, OffsetRMSNorm):
        return f"a {type(norm).__name__}, not an RMSNorm"
    if norm.eps != eps:
        return f"a norm with eps {norm.eps}, not the layer's {eps}"
    w = norm.weight
    if w.dtype != torch.float32 or w.device.type != "cpu":
        return "norm weights not float32 on the CPU"
    if type(norm) is OffsetRMSNorm and norm.offset != 0.0:
        w = norm.offset + w.float()  # the module's (offset + w), rounded once to float32 as it rounds it
        keep.append(w)
    return w.contiguous().data_ptr() if w.is_contiguous() else "norm weights not contiguous"
