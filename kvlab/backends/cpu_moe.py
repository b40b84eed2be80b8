"""The CPU decode backend's description of a mixture-of-experts MLP (kernels/moe.c; step.h's Moe).

    describe_moe(block)          MoeDesc for a kvlab.model.moe.MoEBlock, or why the C step cannot run it
    describe_experts(experts)    the routed experts alone (a prompt's, kvlab/kernels/moe_prefill.py)

The router, the shared expert and its gate are linear layers like any other (backends/cpu.py's
`describe_linear`); the routed experts are one LinearDesc for expert 0 with, per part, the bytes from one
expert's matrix to the next one's: the stacked tensors are read in place, whatever their format.
"""

from __future__ import annotations

import torch

from kvlab.backends.cpu_linear import describe_linear
from kvlab.kernels.decode import (
    BLOCKS,
    EXPERT_ACTIVATIONS,
    FLOAT_KINDS,
    MAX_PARTS,
    MXFP4_BLOCKS,
    ROUTINGS,
    LinearDesc,
    MoeDesc,
    Part,
)


def describe_moe(block) -> MoeDesc | str:
    """decode.c's description of a mixture of experts (moe.c), or why it cannot take it."""
    m = block.moe
    if m.routing not in ROUTINGS or m.activation not in EXPERT_ACTIVATIONS:
        return f"experts routed by {m.routing} with {m.activation}"
    desc = describe_experts(block.experts)
    if isinstance(desc, str):
        return desc
    desc.shared_size, desc.routing, desc.norm_topk_prob = m.shared_size, ROUTINGS[m.routing], int(m.norm_topk_prob)
    linears = {"router": block.router}
    if block.shared_expert is not None:
        linears |= {"shared_gate_up": block.shared_expert.gate_up_proj, "shared_down": block.shared_expert.down_proj}
    if block.shared_expert_gate is not None:
        linears["shared_gate"] = block.shared_expert_gate
    for field, module in linears.items():
        d = describe_linear(module)
        if isinstance(d, str):
            return d
        setattr(desc, field, d)
    return desc


def describe_experts(experts) -> MoeDesc | str:
    """The routed experts alone (kvlab.model.experts.Experts) as moe.c reads them: their sizes, activation,
    stacked matrices and biases; no router or shared expert (a prompt's experts, kvlab_moe_experts, take rows
    already routed). Or why moe.c cannot take them."""
    if experts.activation not in EXPERT_ACTIVATIONS:
        return f"experts with {experts.activation}"
    limit, alpha = experts.swiglu
    desc = MoeDesc(num_experts=experts.num_experts, top_k=experts.top_k, expert_size=experts.expert_size,
                   activation=EXPERT_ACTIVATIONS[experts.activation], swiglu_limit=limit or 0.0,
                   swiglu_alpha=alpha or 0.0)  # fmt: skip
    for name, in_features in (("gate_up", experts.hidden), ("down", experts.expert_size)):
        stacked = _stacked(experts, name, in_features)
        if isinstance(stacked, str):
            return stacked
        linear, strides = stacked
        setattr(desc, name, linear)
        getattr(desc, f"{name}_stride")[:] = strides
    for name in ("gate_up_bias", "down_bias"):
        bias = getattr(experts, name)
        if bias is not None:
            if bias.dtype != torch.float32 or not bias.is_contiguous():
                return "expert biases not float32"
            setattr(desc, name, bias.data_ptr())
    return desc


def _stacked(experts, name: str, in_features: int):
    """Expert 0's `name` matrix (gate_up or down) as a LinearDesc and the byte strides to the next expert's
    parts, or why the C step cannot read them."""
    from kvlab.kernels import quant

    linear, strides = LinearDesc(in_features=in_features), [0] * MAX_PARTS
    if name not in experts.formats:  # float [E, rows, in]
        w = getattr(experts, name)
        if w.dtype not in FLOAT_KINDS or not w.is_contiguous() or w.device.type != "cpu":
            return f"experts' {str(w.dtype).removeprefix('torch.')} weights the C products do not read"
        linear.num_parts, linear.out_features = 1, w.shape[1]
        linear.parts[0] = Part(FLOAT_KINDS[w.dtype], 0, w.data_ptr(), in_features * w.element_size(), w.shape[1])
        strides[0] = w.stride(0) * w.element_size()
        return linear, strides
    ids = quant._format_ids()
    for i, fmt in enumerate(experts.formats[name]):
        data = getattr(experts, f"{name}_{i}")
        if not data.is_contiguous() or (fmt != "MXFP4" and fmt not in ids):
            return f"experts in {fmt} blocks the C products do not read"
        kind, fmt_id = (MXFP4_BLOCKS, 0) if fmt == "MXFP4" else (BLOCKS, ids[fmt])
        rows = experts.part_shape(name, i)[0]  # data [E, rows, row bytes], or [E, items of 16 rows, item bytes]
        linear.parts[i] = Part(kind, fmt_id, data.data_ptr(), data.shape[2], rows)
        strides[i] = data.stride(0)
        linear.out_features += rows
    linear.num_parts = len(experts.formats[name])
    return linear, strides
