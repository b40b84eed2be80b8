"""The CPU decode backend's description of a Gated DeltaNet mixer (kernels/deltanet.c; step.h's DeltaNet).

    describe_deltanet(mixer)    DeltaNetDesc for a kvlab.model.deltanet.GatedDeltaNet, or why the C step cannot run it

in_proj's four parts (conv input, z, b, a) and out_proj are linear layers like any other (`describe_linear`);
the conv taps, A_log, dt_bias and the output norm's weights are pointed at where the module holds them.
"""

from __future__ import annotations

import torch

from kvlab.backends.cpu_linear import describe_linear
from kvlab.kernels.decode import DeltaNetDesc


def describe_deltanet(mixer) -> DeltaNetDesc | str:
    """deltanet.c's description of a Gated DeltaNet mixer (kvlab.model.deltanet), or why it cannot take it."""
    from kvlab.model.layers import RMSNorm

    if mixer.v_dim > 1024:
        return f"a Gated DeltaNet with value heads of {mixer.v_dim} (the C step takes up to 1,024)"
    if type(mixer.norm) is not RMSNorm:
        return f"a Gated DeltaNet whose output norm is a {type(mixer.norm).__name__}"
    in_proj, out = describe_linear(mixer.in_proj), describe_linear(mixer.out_proj)
    for p in (in_proj, out):
        if isinstance(p, str):
            return p
    small = [mixer.conv.weight, mixer.A_log.weight, mixer.dt_bias.weight, mixer.norm.weight]
    if not all(t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu" for t in small):
        return "a Gated DeltaNet's conv taps, A_log, dt_bias or norm not float32"
    return DeltaNetDesc(mixer.num_k_heads, mixer.num_v_heads, mixer.k_dim, mixer.v_dim, mixer.kernel, int(mixer.tiled),
                        mixer.norm.eps, in_proj, out, *(t.data_ptr() for t in small))  # fmt: skip
