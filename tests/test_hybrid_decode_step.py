"""The C decode step on hybrid models (Qwen3.5, Qwen3-Next) against their own modules, pass for pass.

A Gated DeltaNet layer is one more layer of the step (kernels/deltanet.c: in_proj, the conv, the delta rule
on the state pool's slots, the gated norm, out_proj), and the gated attention layers take their output gate
and partial rotary there. Served together with chunked prompts of different lengths, the decode steps'
logits stay within 1e-5 of the layer-by-layer path and the greedy tokens are the same; float32 folders and
Q8_0 GGUF files (qwen35's value heads tiled by key head, in_proj in four block parts) alike.
"""

from __future__ import annotations

import pytest
import torch
from test_fused_decode import prompts, serve
from tiny_hybrid import HYBRID_ARCHS, build_tiny_hybrid, build_tiny_hybrid_gguf

from kvlab.backends.cpu import CpuDecodeBackend
from kvlab.kernels.decode import library
from kvlab.model.deltanet import GatedDeltaNet
from kvlab.model.loader import load_model

pytestmark = [pytest.mark.skipif(not library(), reason="no C compiler: the fused step is not built"),
              pytest.mark.usefixtures("one_thread")]  # fmt: skip


@pytest.fixture(scope="module", params=[(kind, fmt) for kind in HYBRID_ARCHS for fmt in ("folder", "Q8_0")])
def model(request, tmp_path_factory):
    kind, fmt = request.param
    root = tmp_path_factory.mktemp(f"{kind}-{fmt}")
    folder = build_tiny_hybrid(kind, root / "hf")
    return load_model(folder if fmt == "folder" else build_tiny_hybrid_gguf(folder, root / "m.gguf", kind, fmt))


def test_every_layer_is_described_to_the_c_step(model):
    backend = CpuDecodeBackend.build(model.model)
    assert isinstance(backend, CpuDecodeBackend), backend
    recurrent = [isinstance(layer.attn, GatedDeltaNet) for layer in model.model.layers]
    assert [bool(d.deltanet) for d in backend.layers] == recurrent and any(recurrent) and not all(recurrent)
    attention = [d for d in backend.layers if not d.deltanet]
    assert all(d.gate.num_parts for d in attention)  # the output gate
    assert all(d.rotary_dim < d.head_dim for d in attention)  # partial rotary


def test_greedy_tokens_and_logits_agree_with_the_modules(model, monkeypatch):
    calls = []
    run = CpuDecodeBackend.run
    monkeypatch.setattr(CpuDecodeBackend, "run", lambda self, *a: calls.append(a[0].shape[1]) or run(self, *a))
    batch = prompts(5, seed=3)
    fused_logits, plain_logits = [], []
    fused = serve(model, batch, fused=True, record=fused_logits)
    assert calls and max(calls) <= len(batch)  # the decode steps ran on the C step
    plain = serve(model, batch, fused=False, record=plain_logits)
    assert fused == plain
    assert len(fused_logits) == len(plain_logits)
    worst = 0.0
    for a, b in zip(fused_logits, plain_logits):
        if a.numel():
            worst = max(worst, (a - b).abs().max().item() / max(b.abs().max().item(), 1.0))
    assert worst <= 1e-5, worst
