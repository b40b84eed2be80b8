"""Totals and fit: weights + workspace + KV cache + states against a device's memory.

    total(B, S) = weights + workspace(B, S) + kv_bytes(S, B) + state_bytes(B)
    usable      = device memory x utilization (the share the engine may take, as in vLLM)

The workspace allowance is computed, not guessed (docs/memory.md): the widest transient tensors of
one forward pass over the tokens in flight, plus float32 logits for one row per sequence. CUDA
context, allocator fragmentation and CUDA graphs are not modelled: the 1 - utilization headroom is
for them. max_batch and max_context search the exact total, so sliding caps and constant states
count as they really do.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvlab.errors import KvlabError
from kvlab.memory.kv import (
    MAX_BATCH, MAX_CONTEXT, KindUsage, breakdown, check_sizes, kv_bytes, kv_bytes_per_token,
    resolve_kv_dtype, state_bytes, window_bytes_per_token,
)
from kvlab.config import MLA, Attention, DenseMLP, GatedDeltaNet, Mamba2, ModelConfig, MoE
from kvlab.memory.units import kv_dtype_bits
from kvlab.memory.weights import weight_bytes

PREFILL_CHUNK = 2048  # tokens one prefill step processes (chunked prefill), for the workspace


@dataclass(frozen=True)
class Query:
    """What the user asks about one model."""

    context: int
    batch: int = 1
    kv_dtype: str = "auto"  # auto = the model's dtype
    kv_reason: str = ""  # why the KV is sized in this format, for the report's first note ("": the user chose)
    weights: str = "auto"  # auto = as stored / as the config says
    state_dtype: str = "auto"
    device_bytes: int | None = None
    utilization: float = 0.9
    prefill_chunk: int = PREFILL_CHUNK


@dataclass(frozen=True)
class MemoryReport:
    """Everything `kvlab mem` prints for one model; to_json() is the --json object."""

    name: str
    architecture: str
    source: str
    query: Query
    kv_dtype: str
    kv_bytes_per_token: int  # growing layers (full attention, MLA), one sequence
    window_bytes_per_token: int  # sliding layers, paid until their windows fill
    kv_bytes_per_sequence: int  # at query.context
    kv_bytes: int  # batch x per sequence
    state_bytes_per_sequence: int
    state_bytes: int
    weight_bytes: int | None
    weights_format: str
    weights_exact: bool
    params_total: int | None
    params_active: int | None
    workspace_bytes: int
    total_bytes: int | None  # None when the weights are unknown
    kinds: tuple[KindUsage, ...]
    usable_bytes: int | None  # device x utilization
    fits: bool | None
    max_batch: int | None  # sequences of query.context that fit (None: no device given)
    max_context: int | None  # tokens per sequence at query.batch; None: unbounded or no device
    context_unbounded: bool  # memory never limits the context (no growing layers)
    max_context_model: int | None
    notes: tuple[str, ...]

    def to_json(self) -> dict:
        """A plain dict: every byte count an int, the per-kind breakdown as a list."""
        q = self.query
        return {
            "model": self.name, "architecture": self.architecture, "source": self.source,
            "context": q.context, "batch": q.batch, "kv_dtype": self.kv_dtype,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "window_bytes_per_token": self.window_bytes_per_token,
            "kv_bytes_per_sequence": self.kv_bytes_per_sequence, "kv_bytes": self.kv_bytes,
            "state_bytes_per_sequence": self.state_bytes_per_sequence, "state_bytes": self.state_bytes,
            "weight_bytes": self.weight_bytes, "weights_format": self.weights_format,
            "weights_exact": self.weights_exact,
            "params_total": self.params_total, "params_active": self.params_active,
            "workspace_bytes": self.workspace_bytes, "total_bytes": self.total_bytes,
            "layer_kinds": [k.__dict__ for k in self.kinds],
            "device_bytes": q.device_bytes, "utilization": q.utilization if q.device_bytes else None,
            "usable_bytes": self.usable_bytes, "fits": self.fits,
            "max_batch": self.max_batch, "max_context": self.max_context,
            "context_unbounded": self.context_unbounded, "max_context_model": self.max_context_model,
            "notes": list(self.notes),
        }


def widest_activation(spec: ModelConfig) -> int:
    """Numbers per token of the widest transient output any layer produces (q/k/v, gate+up, in_proj)."""
    widest = spec.hidden_size
    for layer in spec.layers:
        m, mlp = layer.mixer, layer.mlp
        if isinstance(m, Attention):
            widest = max(widest, m.num_heads * m.head_dim * (2 if m.output_gate else 1)
                         + m.kv_heads * (m.head_dim + m.v_head_dim))
        elif isinstance(m, MLA):  # prefill expands the latent to per-head K and V
            widest = max(widest, m.num_heads * (2 * (m.qk_nope_head_dim + m.qk_rope_head_dim) + m.v_head_dim))
        elif isinstance(m, GatedDeltaNet):
            widest = max(widest, 2 * (m.num_key_heads * m.key_head_dim + m.num_value_heads * m.value_head_dim))
        elif isinstance(m, Mamba2):
            widest = max(widest, 2 * m.num_heads * m.head_dim + 2 * m.n_groups * m.state_size + m.num_heads)
        if isinstance(mlp, DenseMLP):
            widest = max(widest, 2 * mlp.intermediate_size)
        elif isinstance(mlp, MoE):  # every token visits top_k experts (+ the shared one)
            widest = max(widest, 2 * (mlp.top_k * mlp.expert_size + mlp.shared_size))
    return widest


def workspace_bytes(spec: ModelConfig, context: int, batch: int, chunk: int = PREFILL_CHUNK) -> int:
    """Activation allowance: tokens in flight x (residual + normed input + widest output) in the
    model dtype, plus float32 logits for the last position of each sequence."""
    tokens = min(batch * context, max(chunk, batch))  # a prefill chunk, or one token per sequence
    act_bits = kv_dtype_bits(spec.dtype)
    activations = tokens * (2 * spec.hidden_size + widest_activation(spec)) * act_bits // 8
    logits = batch * (spec.vocab_size or 0) * 4
    return int(activations) + logits


def total_bytes(spec: ModelConfig, q: Query, weights: int, context: int, batch: int) -> int:
    """Everything resident for `batch` sequences of `context` tokens."""
    return (weights + workspace_bytes(spec, context, batch, q.prefill_chunk)
            + kv_bytes(spec, context, batch, q.kv_dtype) + state_bytes(spec, batch, q.state_dtype))


def max_batch(spec: ModelConfig, q: Query, weights: int, usable: int) -> int:
    """Most sequences of q.context tokens that fit in `usable` bytes (0 if not even one)."""
    return _largest(lambda b: total_bytes(spec, q, weights, q.context, b) <= usable, MAX_BATCH)


def max_context(spec: ModelConfig, q: Query, weights: int, usable: int) -> int | None:
    """Longest context for q.batch sequences that fits; None when memory never limits it."""
    fits = lambda s: total_bytes(spec, q, weights, s, q.batch) <= usable  # noqa: E731
    if fits(MAX_CONTEXT):
        return None
    return _largest(fits, MAX_CONTEXT)


def _largest(ok, top: int) -> int:
    """Largest x in 1..top with ok(x), for a monotone ok; 0 when ok(1) is false."""
    if not ok(1):
        return 0
    lo, hi = 1, 2
    while hi <= top and ok(hi):  # gallop, then bisect between the last good and first bad
        lo, hi = hi, hi * 2
    hi = min(hi, top + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def estimate(spec: ModelConfig, q: Query) -> MemoryReport:
    """The full answer for one model: KV, states, weights, workspace, total, and the fit."""
    check_sizes(context=q.context, batch=q.batch)
    if not 0 < q.utilization <= 1:
        raise KvlabError(f"utilization must be in (0, 1], got {q.utilization}")
    if not 1 <= q.prefill_chunk <= MAX_CONTEXT:
        raise KvlabError(f"prefill chunk must be at least 1 token, got {q.prefill_chunk}")
    kv_dtype = resolve_kv_dtype(spec, q.kv_dtype)
    q = dataclasses.replace(q, kv_dtype=kv_dtype)
    notes = ([f"KV sized in {kv_dtype}: {q.kv_reason}"] if q.kv_reason else []) + list(spec.notes)
    w = weight_bytes(spec, q.weights)
    workspace = workspace_bytes(spec, q.context, q.batch, q.prefill_chunk)
    kv, state = kv_bytes(spec, q.context, q.batch, kv_dtype), state_bytes(spec, q.batch, q.state_dtype)
    total = None if w.bytes is None else w.bytes + workspace + kv + state
    if spec.mtp_layers:
        extra = kv_bytes_per_token(spec.with_mtp(), kv_dtype) - kv_bytes_per_token(spec, kv_dtype)
        notes.append(f"the config has {len(spec.mtp_layers)} MTP layer(s), not counted: --mtp adds "
                     f"{extra:,} B per token and their weights")
    if spec.max_position_embeddings and q.context > spec.max_position_embeddings:
        notes.append(f"context {q.context:,} is beyond the model's trained {spec.max_position_embeddings:,} tokens")
    usable = fits = best_batch = best_context = None
    unbounded = not any(layer.mixer is not None and getattr(layer.mixer, "window", None) is None
                        and layer.mixer.kind in ("attention", "mla") for layer in spec.layers)
    if q.device_bytes is not None:
        usable = int(q.device_bytes * q.utilization)
        if w.bytes is None:
            notes.append("weights unknown, so the fit is not answered")
        else:
            fits = total <= usable
            best_batch = max_batch(spec, q, w.bytes, usable)
            best_context = max_context(spec, q, w.bytes, usable)
            if best_context and spec.max_position_embeddings and best_context > spec.max_position_embeddings:
                notes.append(f"memory allows {best_context:,} tokens, but the model was trained for "
                             f"{spec.max_position_embeddings:,}")
    params = w.params
    return MemoryReport(
        name=spec.name, architecture=spec.architecture, source=spec.source, query=q, kv_dtype=kv_dtype,
        kv_bytes_per_token=kv_bytes_per_token(spec, kv_dtype),
        window_bytes_per_token=window_bytes_per_token(spec, kv_dtype),
        kv_bytes_per_sequence=kv_bytes(spec, q.context, 1, kv_dtype), kv_bytes=kv,
        state_bytes_per_sequence=state_bytes(spec, 1, q.state_dtype), state_bytes=state,
        weight_bytes=w.bytes, weights_format=w.format, weights_exact=w.exact,
        params_total=params.total if params else None, params_active=params.active if params else None,
        workspace_bytes=workspace, total_bytes=total,
        kinds=tuple(breakdown(spec, q.context, q.batch, kv_dtype, q.state_dtype)),
        usable_bytes=usable, fits=fits, max_batch=best_batch, max_context=best_context,
        context_unbounded=unbounded, max_context_model=spec.max_position_embeddings, notes=tuple(notes),
    )
