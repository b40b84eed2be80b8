"""Weight-only quantization of a float model, as a transform of its layers (never a copy of the model).

    quantize_model(model, "q8_0")   every decoder Linear, the LM head and the embedding table become
                                    their packed forms, in blocks made by kvlab.quant.quantize; an MoE
                                    layer's stacked experts keep their stacks, in blocks

Norms and biases stay float. A tied model keeps one table: the packed embedding also serves as the
LM head. What was float is freed as each layer is replaced.
"""

from __future__ import annotations

from torch import nn

from kvlab.model.experts import Experts
from kvlab.model.layers import Embedding, Linear
from kvlab.quant.linear import PackedEmbedding, PackedLinear, PackedTensor
from kvlab.quant.quantize import QUANTIZATIONS, quantize


def _packed(weight, fmt: str) -> PackedTensor:
    return PackedTensor(fmt.upper(), tuple(weight.shape), quantize(weight, fmt))


def quantize_model(model: nn.Module, fmt: str) -> nn.Module:
    """Replace `model`'s float matrices by `fmt` blocks in place; returns the model."""
    if fmt not in QUANTIZATIONS:
        from kvlab.errors import KvlabError

        raise KvlabError(f"unknown --quantization {fmt!r}: choose one of {', '.join(QUANTIZATIONS)}")
    tied = model.lm_head.weight is model.embed_tokens.weight if isinstance(model.lm_head, Linear) else False
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Linear) and not (tied and child is model.lm_head):
                parts = [_packed(w, fmt) for w in child.weight.split(child.parts)]
                setattr(parent, name, PackedLinear(parts, bias=child.bias))
            elif isinstance(child, Embedding):
                setattr(parent, name, PackedEmbedding(_packed(child.weight, fmt), child.weight.dtype))
            elif isinstance(child, Experts):
                _quantize_experts(child, fmt)
    if tied:
        model.lm_head = model.embed_tokens.as_linear()
    return model


def _quantize_experts(experts: Experts, fmt: str) -> None:
    """Each stacked matrix [E, rows, in] as blocks [E, rows, row bytes] (gate_up in two parts: gate, up)."""
    for name in ("gate_up", "down"):
        if name in experts.formats:
            continue
        stacked = getattr(experts, name)  # [E, rows, in]
        E, rows, cols = stacked.shape
        parts = stacked.split(rows // 2, dim=1) if name == "gate_up" else (stacked,)
        packed = []
        for part in parts:
            blocks = quantize(part.reshape(-1, cols), fmt)
            packed.append(PackedTensor(fmt.upper(), (E, part.shape[1], cols), blocks.view(E, part.shape[1], -1)))
        experts.set_packed(name, packed)
