"""Tensor parallelism as a transform of a loaded model: each rank keeps its shard of every layer.

    config = shard_config(model_config, world_size)     # what one rank holds (heads, MLP width)
    loaded = shard_model(loaded, group)                  # the model's layers replaced by their shards

Query heads are split in contiguous ranges (q/k/v are column-parallel, o row-parallel with an
all-reduce); KV heads too, or, when there are fewer KV heads than ranks, each rank keeps the one its
query heads read (replicated, as vLLM does). The MLP's gate/up rows and down's matching columns are
split the same way; the embedding and the LM head by vocabulary ranges. A quantized matrix is split
along its rows freely, and along its inputs only at block boundaries: where a rank's columns do not
start and end on one, that shard is expanded to float32 (its values exact, its bytes larger); the
MLP's channels are cut at the down matrix's block boundaries, so its shards keep their blocks.
"""

from __future__ import annotations

import dataclasses

import torch

from kvlab.config.shard import kv_heads_per_rank, shard_config
from kvlab.errors import KvlabError
from kvlab.model.layers import Embedding, Linear
from kvlab.parallel.group import TPGroup
from kvlab.parallel.layers import RowParallel, VocabParallelEmbedding, VocabParallelHead
from kvlab.model.moe import MoEBlock
from kvlab.quant.formats import FORMATS
from kvlab.quant.linear import PackedEmbedding, PackedLinear, PackedTensor


# ---- splitting one matrix ------------------------------------------------------------------------


def _rows(module, ranges: list[tuple[int, int]], parts: tuple[int, ...]):
    """The module's output rows in `ranges` (one per part), as a module of the same kind."""
    if isinstance(module, PackedLinear):
        kept = [PackedTensor(p.fmt, (hi - lo, p.shape[1]), p.data[lo:hi].contiguous())
                for p, (lo, hi) in zip(module.packed(), ranges)]  # fmt: skip
        bias = _bias_rows(module.bias, ranges, module.parts)
        return PackedLinear(kept, bias=bias)
    offsets = [sum(module.parts[:i]) for i in range(len(module.parts))]
    rows = torch.cat([torch.arange(o + lo, o + hi) for o, (lo, hi) in zip(offsets, ranges)])
    new = Linear(module.in_features, len(rows), bias=module.bias is not None, parts=parts)
    new.weight = torch.nn.Parameter(module.weight.detach()[rows].contiguous(), requires_grad=False)
    if module.bias is not None:
        new.bias = torch.nn.Parameter(module.bias.detach()[rows].contiguous(), requires_grad=False)
    return new


def _bias_rows(bias, ranges, parts):
    if bias is None:
        return None
    offsets = [sum(parts[:i]) for i in range(len(parts))]
    return torch.cat([bias.detach()[o + lo : o + hi] for o, (lo, hi) in zip(offsets, ranges)]).contiguous()


def _columns(module, lo: int, hi: int, keep_bias: bool):
    """The module's input columns [lo, hi): a row-parallel shard. The ranks' outputs are summed, so one
    rank (`keep_bias`) adds the bias (gpt-oss's o_proj has one) and the others none."""
    bias = module.bias.detach().clone() if module.bias is not None and keep_bias else None
    if isinstance(module, PackedLinear):
        kept = []
        for p in module.packed():
            fmt = p.format
            if lo % fmt.block_values or hi % fmt.block_values:  # not on block boundaries: exact floats
                kept.append(PackedTensor("F32", (p.shape[0], hi - lo), _float_bytes(p.dequantize()[:, lo:hi])))
                continue
            start, end = lo // fmt.block_values * fmt.block_bytes, hi // fmt.block_values * fmt.block_bytes
            kept.append(PackedTensor(p.fmt, (p.shape[0], hi - lo), p.data[:, start:end].contiguous()))
        return PackedLinear(kept, bias=bias)
    new = Linear(hi - lo, module.out_features, bias=bias is not None)
    new.weight = torch.nn.Parameter(module.weight.detach()[:, lo:hi].contiguous(), requires_grad=False)
    if bias is not None:
        new.bias = torch.nn.Parameter(bias, requires_grad=False)
    return new


def _float_bytes(w: torch.Tensor) -> torch.Tensor:
    return w.float().contiguous().view(torch.uint8).reshape(w.shape[0], -1)


def _vocab_rows(module, lo: int, hi: int, padded: int):
    """Rows [lo, hi) of an embedding table or LM head, zero rows appended up to `padded` rows."""
    if isinstance(module, (PackedLinear, PackedEmbedding)):
        p = module.table() if isinstance(module, PackedEmbedding) else module.packed()[0]
        data = torch.zeros(padded, p.data.shape[1], dtype=torch.uint8)  # zero bytes: a zero block in every format
        data[: hi - lo] = p.data[lo:hi]
        table = PackedTensor(p.fmt, (padded, p.shape[1]), data)
        return PackedEmbedding(table, module.out_dtype) if isinstance(module, PackedEmbedding) else PackedLinear([table])
    weight = torch.zeros(padded, module.weight.shape[1], dtype=module.weight.dtype)
    weight[: hi - lo] = module.weight.detach()[lo:hi]
    new = Embedding(*weight.shape) if isinstance(module, Embedding) else Linear(weight.shape[1], padded)
    new.weight = torch.nn.Parameter(weight, requires_grad=False)
    return new


# ---- the model -------------------------------------------------------------------------------------


def shard_model(loaded, group: TPGroup):
    """`loaded` with every layer replaced by this rank's shard; its config says what the rank holds."""
    if group.world_size == 1:
        return loaded
    model, config, world, rank = loaded.model, loaded.config, group.world_size, group.rank
    if any(type(layer.attn).__name__ == "MLAttention" for layer in model.layers):
        raise KvlabError("multi-head latent attention (DeepSeek) cannot be split over tensor-parallel ranks yet")
    if any(type(layer.attn).__name__ == "GatedDeltaNet" for layer in model.layers):
        raise KvlabError("Gated DeltaNet layers (Qwen3.5, Qwen3-Next) cannot be split over tensor-parallel ranks yet")
    local = shard_config(config, world)
    widths = []
    for layer in model.layers:
        _shard_attention(layer.attn, group)
        if isinstance(layer.mlp, MoEBlock):
            widths.append(_shard_moe(layer.mlp, group))
            layer.mlp = RowParallel(layer.mlp, group)  # the experts' and the shared expert's sums: one all-reduce
        else:
            widths.append(_shard_mlp(layer.mlp, group))
    layers = tuple(dataclasses.replace(layer, mlp=_mlp_width(layer.mlp, w)) for layer, w in zip(local.layers, widths))
    local = dataclasses.replace(local, layers=layers)  # this rank's own MLP widths (cut at block boundaries)
    vocab = config.vocab_size
    per_rank = -(-vocab // world)
    lo, hi = rank * per_rank, min((rank + 1) * per_rank, vocab)
    tied = model.lm_head.weight_tensors()[0] is model.embed_tokens.weight_tensors()[0]
    table = _vocab_rows(model.embed_tokens, lo, hi, per_rank)
    model.embed_tokens = VocabParallelEmbedding(table, lo, per_rank, group)
    if tied:
        head = table.as_linear() if isinstance(table, PackedEmbedding) else _tied_head(table)
    else:
        head = _vocab_rows(model.lm_head, lo, hi, per_rank)
    model.lm_head = VocabParallelHead(head, vocab, group)
    return dataclasses.replace(loaded, config=local)


def _tied_head(table: Embedding) -> Linear:
    head = Linear(table.weight.shape[1], table.weight.shape[0])
    head.weight = table.weight
    return head


def _shard_attention(attn, group: TPGroup) -> None:
    H, Hkv, D, world, rank = attn.num_heads, attn.num_kv_heads, attn.head_dim, group.world_size, group.rank
    heads, kv_heads = kv_heads_per_rank(H, Hkv, world, "this model")
    kv_first = rank * kv_heads if Hkv % world == 0 else rank // (world // Hkv)  # replicated: the one it reads
    q = (rank * heads * D, (rank + 1) * heads * D)
    kv = (kv_first * D, (kv_first + kv_heads) * D)
    attn.qkv_proj = _rows(attn.qkv_proj, [q, kv, kv], (heads * D, kv_heads * D, kv_heads * D))
    attn.o_proj = RowParallel(_columns(attn.o_proj, *q, keep_bias=rank == 0), group)
    if getattr(attn, "sinks", None) is not None:  # gpt-oss: one sink logit per query head, this rank's heads'
        sinks = attn.sinks.weight.detach()[rank * heads : (rank + 1) * heads].contiguous()
        attn.sinks.weight = torch.nn.Parameter(sinks, requires_grad=False)
    attn.num_heads, attn.num_kv_heads = heads, kv_heads


def mlp_ranges(size: int, align: int, world: int) -> list[tuple[int, int]]:
    """Each rank's share of an MLP's `size` intermediate channels, cut at multiples of `align` (the
    down matrix's block: Qwen2.5's Q6_K down holds 256 per block, 4,864 = 19 of them, so two ranks get
    2,304 and 2,560 rather than 2,432 each, and keep their blocks as stored); as even as that allows."""
    if size % align:
        align = 1
    units = size // align
    counts = [units // world + (r < units % world) for r in range(world)]
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c * align)
    return list(zip(bounds[:-1], bounds[1:]))


def _shard_mlp(mlp, group: TPGroup) -> int:
    down = mlp.down_proj
    align = max((p.format.block_values for p in down.packed()), default=1) if isinstance(down, PackedLinear) else 1
    lo, hi = mlp_ranges(mlp.intermediate_size, align, group.world_size)[group.rank]
    if hi == lo:
        raise KvlabError(f"an MLP of {mlp.intermediate_size} channels cannot give {group.world_size} ranks a share each")
    mlp.gate_up_proj = _rows(mlp.gate_up_proj, [(lo, hi), (lo, hi)], (hi - lo, hi - lo))
    mlp.down_proj = RowParallel(_columns(mlp.down_proj, lo, hi, keep_bias=group.rank == 0), group)
    mlp.intermediate_size = hi - lo
    return hi - lo


# ---- a mixture of experts: every expert split like an MLP, the router whole -----------------------


def _mlp_width(mlp, width):
    """The layer's MLP description with this rank's widths: (expert, shared) for a mixture of experts."""
    if isinstance(width, tuple):
        return dataclasses.replace(mlp, expert_size=width[0], shared_size=width[1])
    return dataclasses.replace(mlp, intermediate_size=width)


def _shard_moe(block, group: TPGroup) -> tuple[int, int]:
    """Split every routed expert's channels (and the shared expert's) over the ranks, each rank's share cut
    at the down matrices' block boundaries; the router and the shared expert's gate stay whole, so every
    rank routes alike. The sum over ranks (one all-reduce after the block) adds the experts' down biases
    once: rank 0 keeps them. Returns this rank's (expert width, shared width)."""
    experts, world, rank = block.experts, group.world_size, group.rank
    align = max((FORMATS[f].block_values for f in experts.formats.get("down", [])), default=1)
    lo, hi = mlp_ranges(experts.expert_size, align, world)[rank]
    if hi == lo:
        raise KvlabError(f"experts of {experts.expert_size} channels cannot give {world} ranks a share each")
    experts.shard(lo, hi, keep_down_bias=rank == 0)
    block.intermediate_size = hi - lo
    shared = 0
    if block.shared_expert is not None:
        shared = _shard_mlp(block.shared_expert, group)
        block.shared_expert.down_proj = block.shared_expert.down_proj.inner  # summed with the experts', below
    block.moe = dataclasses.replace(block.moe, expert_size=hi - lo, shared_size=shared)  # what the rank holds
    return hi - lo, shared
