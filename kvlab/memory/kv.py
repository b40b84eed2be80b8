"""KV-cache and recurrent-state bytes, summed layer by layer.

Three behaviours, never folded into one product:
    grows with tokens        full attention (2 x kv_heads x head_dim numbers per token) and MLA
                             (kv_lora_rank + qk_rope_head_dim numbers per token: one latent, no V)
    capped per sequence      sliding-window attention: the same per token, but at most `window` tokens
    constant per sequence    Gated DeltaNet and Mamba-2: a conv window and an SSM state, whatever the length
docs/memory.md derives each formula.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from fractions import Fraction

from kvlab.errors import KvlabError
from kvlab.config import MLA, Attention, GatedDeltaNet, Mamba2, Mixer, ModelConfig
from kvlab.memory.units import canonical_dtype, ceil_bytes, kv_dtype_bits, kv_vector_scale_bytes

MAX_CONTEXT = 2**40  # tokens; a guard against typos, far beyond any model
MAX_BATCH = 10**9


def numbers_per_token(mixer: Mixer | None) -> int:
    """Numbers one token adds to one layer's cache (0 for layers without a per-token cache)."""
    if isinstance(mixer, Attention):
        return mixer.kv_heads * (mixer.head_dim + mixer.v_head_dim)  # one K and one V per KV head
    if isinstance(mixer, MLA):
        return mixer.kv_lora_rank + mixer.qk_rope_head_dim  # latent c_KV + shared RoPE key
    return 0


def window_of(mixer: Mixer | None) -> int | None:
    """Most tokens the layer keeps (sliding window), or None when it keeps them all."""
    return mixer.window if isinstance(mixer, Attention) else None


def cached_tokens(mixer: Mixer | None, context: int) -> int:
    """Tokens a layer holds for a sequence of `context` tokens."""
    window = window_of(mixer)
    return min(context, window) if window else context


def state_numbers(mixer: Mixer | None) -> tuple[int, int]:
    """(conv, ssm) numbers of the constant per-sequence state of a linear-attention / SSM layer."""
    if isinstance(mixer, GatedDeltaNet):
        # the conv runs over the concatenated q, k and v channels; it needs the last kernel-1 inputs
        conv_dim = 2 * mixer.num_key_heads * mixer.key_head_dim + mixer.num_value_heads * mixer.value_head_dim
        ssm = mixer.num_value_heads * mixer.key_head_dim * mixer.value_head_dim  # one dk x dv matrix per v head
        return conv_dim * (mixer.conv_kernel - 1), ssm
    if isinstance(mixer, Mamba2):
        d_inner = mixer.num_heads * mixer.head_dim
        conv_dim = d_inner + 2 * mixer.n_groups * mixer.state_size  # x, B and C go through the conv
        ssm = mixer.num_heads * mixer.head_dim * mixer.state_size  # head_dim x d_state per head
        return conv_dim * (mixer.conv_kernel - 1), ssm
    return 0, 0


def resolve_kv_dtype(spec: ModelConfig, kv_dtype: object) -> str:
    """'auto' (or None) means the model's own dtype; anything else is checked and normalised.

    A pair (K dtype, V dtype), or "K:V" as one string, stores keys and values apart (--cache-type-k/-v);
    it resolves to "K:V" (or to one name when both are the same)."""
    k, v = _kv_pair(kv_dtype)
    k, v = (spec.dtype if d is None or str(d).lower() == "auto" else d for d in (k, v))
    for d in (k, v):
        kv_dtype_bits(d)  # raises on an unknown name
    k, v = canonical_dtype(k), canonical_dtype(v)
    return k if k == v else f"{k}:{v}"


def _kv_pair(kv_dtype: object) -> tuple[object, object]:
    if isinstance(kv_dtype, (tuple, list)) and len(kv_dtype) == 2:
        return kv_dtype[0], kv_dtype[1]
    if isinstance(kv_dtype, str) and ":" in kv_dtype:
        k, v = kv_dtype.split(":", 1)
        return k, v
    return kv_dtype, kv_dtype


def token_bits(mixer: Mixer | None, kv_dtype: str) -> Fraction:
    """Bits one token adds to one layer's cache, keys and values each in their format (scales included)."""
    k, v = _kv_pair(kv_dtype)
    if isinstance(mixer, Attention):
        per_head = (mixer.head_dim * kv_dtype_bits(k) + 8 * kv_vector_scale_bytes(k)
                    + mixer.v_head_dim * kv_dtype_bits(v) + 8 * kv_vector_scale_bytes(v))  # fmt: skip
        return mixer.kv_heads * per_head
    if isinstance(mixer, MLA):  # one latent vector (and the shared RoPE key), in K's format
        return numbers_per_token(mixer) * kv_dtype_bits(k) + 8 * kv_vector_scale_bytes(k)
    return Fraction(0)


def kv_bytes_per_token(spec: ModelConfig, kv_dtype: object = "bfloat16") -> int:
    """Bytes one more token adds to one sequence's cache in the layers whose cache keeps growing.

    That is every full-attention and MLA layer. Sliding-window layers stop growing at their window:
    they are in `window_bytes_per_token` and `kv_bytes`. For Qwen3-0.6B in bfloat16 this is 114,688.
    """
    dtype = resolve_kv_dtype(spec, kv_dtype)
    return ceil_bytes(sum(token_bits(layer.mixer, dtype) for layer in spec.layers if window_of(layer.mixer) is None))


def window_bytes_per_token(spec: ModelConfig, kv_dtype: object = "bfloat16") -> int:
    """Bytes per token of the sliding-window layers, paid only until each window is full."""
    dtype = resolve_kv_dtype(spec, kv_dtype)
    return ceil_bytes(sum(token_bits(layer.mixer, dtype) for layer in spec.layers if window_of(layer.mixer)))


def kv_bytes(spec: ModelConfig, context: int, batch: int = 1, kv_dtype: object = "bfloat16") -> int:
    """Bytes of a cache holding `context` tokens for each of `batch` sequences, sliding windows capped.

    Intrinsic bytes: no block rounding, no engine reserve. Constant states are in `state_bytes`.
    """
    check_sizes(context=context, batch=batch)
    dtype = resolve_kv_dtype(spec, kv_dtype)
    bits = sum(token_bits(layer.mixer, dtype) * cached_tokens(layer.mixer, context) for layer in spec.layers)
    return ceil_bytes(bits * batch)


def state_bytes(spec: ModelConfig, batch: int = 1, state_dtype: object = None) -> int:
    """Bytes of the constant per-sequence states (linear attention, Mamba-2) for `batch` sequences.

    With state_dtype None the conv state is in the model dtype and the SSM state in the dtype the
    config asks for (`mamba_ssm_dtype`, e.g. float32 for Qwen3.5), else the model dtype.
    """
    check_sizes(batch=batch)
    total = Fraction(0)
    for layer in spec.layers:
        conv, ssm = state_numbers(layer.mixer)
        if conv or ssm:
            conv_bits, ssm_bits = _state_bits(spec, layer.mixer, state_dtype)
            total += conv * conv_bits + ssm * ssm_bits
    return ceil_bytes(total * batch)


def _state_bits(spec: ModelConfig, mixer: Mixer, state_dtype: object) -> tuple[Fraction, Fraction]:
    if state_dtype is None or str(state_dtype).lower() == "auto":
        state_dtype = spec.state_dtype
    if state_dtype is not None:
        bits = kv_dtype_bits(state_dtype)
        return bits, bits
    return kv_dtype_bits(spec.dtype), kv_dtype_bits(getattr(mixer, "ssm_dtype", None) or spec.dtype)


def check_sizes(context: int | None = None, batch: int | None = None) -> None:
    """Refuse negative, zero or absurd token and sequence counts with a one-line KvlabError."""
    for label, value, top in (("context", context, MAX_CONTEXT), ("batch", batch, MAX_BATCH)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise KvlabError(f"{label} must be a whole number, got {value!r}")
        if not 1 <= value <= top:
            raise KvlabError(f"{label} = {value:,} is out of range (1..{top:,})")


@dataclass(frozen=True)
class KindUsage:
    """What the layers of one kind (and one geometry) hold, for the per-kind breakdown."""

    label: str  # full_attention, sliding_attention, mla, linear_attention, mamba2, mlp_only; "(mtp)" marks MTP
    num_layers: int
    numbers_per_token: int  # per layer
    window: int | None  # sliding window in tokens, None when unbounded
    bytes_per_token: int  # all layers of this kind, one sequence (while under the window)
    kv_bytes: int  # at the given context and batch
    state_bytes: int  # constant states, for the batch


def breakdown(spec: ModelConfig, context: int, batch: int = 1, kv_dtype: object = "bfloat16",
              state_dtype: object = None) -> list[KindUsage]:
    """Per-kind rows: layers grouped by label and geometry, in order of first appearance."""
    groups: dict[tuple, list] = {}
    for layer in spec.layers:
        label = layer.label + (" (mtp)" if layer.mtp else "")
        key = (label, numbers_per_token(layer.mixer), window_of(layer.mixer), state_numbers(layer.mixer))
        groups.setdefault(key, []).append(layer)
    rows = []
    for (label, numbers, window, _), layers in groups.items():
        sub = _subspec(spec, layers)
        rows.append(KindUsage(
            label=label,
            num_layers=len(layers),
            numbers_per_token=numbers,
            window=window,
            bytes_per_token=kv_bytes_per_token(sub, kv_dtype) + window_bytes_per_token(sub, kv_dtype),
            kv_bytes=kv_bytes(sub, context, batch, kv_dtype),
            state_bytes=state_bytes(sub, batch, state_dtype),
        ))
    return rows


def _subspec(spec: ModelConfig, layers: list) -> ModelConfig:
    return dataclasses.replace(spec, layers=tuple(layers))
