"""Weight-only quantization of a float model, as a transform of its layers (never a copy of the model).

    quantize_model(model, "q8_0")   every decoder Linear, the LM head and the embedding table become
                                    their packed forms, in blocks made by kvlab.quant.quantize

Norms and biases stay float. A tied model keeps one table: the packed embedding also serves as the
LM head. What was float is freed as each layer is replaced.
"""

from __future__ import annotations

from torch import nn

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
    if tied:
        model.lm_head = model.embed_tokens.as_linear()
    return model
