"""Decode backends: what runs a decode step of the model, chosen once per model at load.

    path = choose_decode_path(model)        # DecodePath: the backend, or None and the reason why not
    if path.backend and path.backend.applies(input_ids, cache, meta, policy):
        logits = path.backend.run(input_ids, cache, meta, logits_index, policy)

The model's modules are the description of every layer (its norms, products, rotary table, attention
window and scale, MLP) and the oracle: they run prefill, every pass a backend does not take, and every
device without a backend. A backend reads the same description once and runs whole decode steps of it.
Today there is one, the CPU's (`cpu.py`: each decoder layer one C call, `kernels/decode.c`); which
one a device gets is its ops' say (`ops.py`: `decode_backend`, a name `_backend_class` knows), so a
CUDA backend is another file here, named by `CudaOps`. Where none applies, `DecodePath.reason` says why in one phrase, which
`kvlab run` prints (and `--json` carries) instead of falling off the fast path silently.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DecodePath:
    """The path a model's decode steps take: `backend` (None: the modules) and, without one, why."""

    backend: object | None
    reason: str | None = None

    @property
    def name(self) -> str:
        return self.backend.name if self.backend is not None else "modules"

    def to_dict(self) -> dict:
        return {"decode_path": self.name, "decode_path_reason": self.reason}

    def describe(self) -> str:
        """One line for a footer or a log: which path, and why not the backend."""
        return f"decode on {self.name}" + (f" ({self.reason})" if self.reason else "")


# the MLP activations decode.c computes (asked of it at load: kernels/decode.activation_ids; a test keeps this equal)
C_STEP_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
C_STEP_MAX_HEAD_DIM = 512
C_STEP_ROUTINGS = ("softmax_topk", "topk_softmax")  # moe.c's (kernels/decode.py's ROUTINGS)
C_STEP_EXPERTS = ("silu", "clamped_swiglu")  # moe.c's expert activations (kernels/decode.py's EXPERT_ACTIVATIONS)


def expected_decode_path(config) -> DecodePath:
    """What a CPU load of `config` will run decode steps on, from the description alone (no torch: for
    `kvlab show`); the load's own choice (`choose_decode_path`) also checks weights, dtype and cache."""
    from kvlab.config.layers import Attention, DenseMLP, GatedDeltaNet, MoE

    for i, layer in enumerate(config.layers):
        mixer, mlp = layer.mixer, layer.mlp
        recurrent = isinstance(mixer, GatedDeltaNet) and mixer.value_head_dim <= 1024
        if not recurrent and (not isinstance(mixer, Attention) or mixer.clip_qkv is not None):
            return DecodePath(None, f"layer {i}: a {type(mixer).__name__} mixer the C step does not compute")
        if not recurrent and (mixer.head_dim % 8 or mixer.head_dim > C_STEP_MAX_HEAD_DIM):
            return DecodePath(None, f"layer {i}: head_dim {mixer.head_dim}")
        dense = isinstance(mlp, DenseMLP) and mlp.gated and mlp.activation in C_STEP_ACTIVATIONS
        moe = isinstance(mlp, MoE) and mlp.routing in C_STEP_ROUTINGS and mlp.activation in C_STEP_EXPERTS
        if not (dense or moe):
            return DecodePath(None, f"layer {i}: an MLP the C step does not compute")
    return DecodePath(_Named("cpu-c"))


@dataclass(frozen=True)
class _Named:
    name: str


def choose_decode_path(model, cache=None, ops=None) -> DecodePath:
    """The decode backend for `model` run with `ops` (by default its device's, backends/ops.py) and
    `cache`, when given (its formats and sizes), or the modules with the reason."""
    from kvlab.backends.ops import ops_for

    ops = ops or ops_for(model.device)
    if ops.decode_backend is None:
        return DecodePath(None, f"no decode backend for {ops.name} ops yet: the modules run every step")
    backend = _backend_class(ops.decode_backend).build(model)
    if isinstance(backend, str):
        return DecodePath(None, backend)
    reason = backend.cache_reason(cache) if cache is not None else None
    return DecodePath(None, reason) if reason else DecodePath(backend)


def _backend_class(name: str):
    """The decode backends by name (imported when first chosen: each reads the model's modules)."""
    from kvlab.backends.cpu import CpuDecodeBackend

    return {CpuDecodeBackend.name: CpuDecodeBackend}[name]
