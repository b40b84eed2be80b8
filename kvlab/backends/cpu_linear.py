"""A linear layer as the C decode step's products see it (kernels/step.h's LinearDesc): float matrices,
GGUF blocks (interleaved for int8 activations too) and MXFP4, shared by the dense layer's description
(backends/cpu.py) and the experts' (backends/cpu_moe.py)."""

from __future__ import annotations

import torch

from kvlab.kernels.decode import BLOCKS, FLOAT_KINDS, MAX_PARTS, MXFP4_BLOCKS, LinearDesc, Part


def describe_linear(module) -> LinearDesc | str:
    """A linear layer as the C kernels see it, or why one of its matrices is not theirs."""
    from kvlab.kernels import quant
    from kvlab.model.layers import Linear
    from kvlab.quant.linear import PackedLinear

    if not isinstance(module, (Linear, PackedLinear)):  # another implementation of the linear seam
        return f"a {type(module).__name__} product (the C step multiplies float matrices and GGUF blocks)"
    desc = LinearDesc(in_features=module.in_features, out_features=module.out_features)
    bias = module.bias
    if bias is not None:
        if not (bias.dtype == torch.float32 and bias.is_contiguous() and bias.device.type == "cpu"):
            return "a bias not float32"
        desc.bias = bias.data_ptr()
    if isinstance(module, Linear):
        w = module.weight
        if w.dtype not in FLOAT_KINDS or not w.is_contiguous() or w.device.type != "cpu":
            return f"a {str(w.dtype).removeprefix('torch.')} weight matrix the C products do not read"
        desc.num_parts = 1
        desc.parts[0] = Part(FLOAT_KINDS[w.dtype], 0, w.data_ptr(), module.in_features * w.element_size(), w.shape[0])
        return desc
    ids = quant._format_ids()
    packed = module.packed()
    unknown = [p.fmt for p in packed if p.fmt not in ids and p.fmt != "MXFP4"]
    if unknown or len(packed) > MAX_PARTS or not all(p.data.is_contiguous() for p in packed):
        return f"weights in {', '.join(unknown) or 'parts'} the C products do not read"
    desc.num_parts = len(packed)
    for i, p in enumerate(packed):
        kind, fmt_id = (MXFP4_BLOCKS, 0) if p.fmt == "MXFP4" else (BLOCKS, ids[p.fmt])
        desc.parts[i] = Part(kind, fmt_id, p.data.data_ptr(), p.data.shape[1], p.shape[0])
    return desc
