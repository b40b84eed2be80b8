"""Weight memory: parameters counted from the architecture, and their bytes in a storage format.

Counts follow the transformers modules of each architecture (the projections each layer owns); a
GGUF file gives them exactly from its tensors instead. Bytes are exact when a file is given
(safetensors or GGUF headers), else parameters x bits per parameter of the chosen format.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from kvlab.errors import KvlabError
from kvlab.config import (
    MLA, Attention, DenseMLP, GatedDeltaNet, Layer, Mamba2, ModelConfig, MoE, ParamCounts,
)
from kvlab.memory.units import ceil_bytes, kv_dtype_bits, weight_format_bits


@dataclass(frozen=True)
class _Parts:
    """Running sums of one layer's parameters by role (see ParamCounts)."""

    dense: int = 0
    experts: int = 0
    experts_active: int = 0
    routers: int = 0
    vectors: int = 0

    def __add__(self, other: _Parts) -> _Parts:
        return _Parts(*(a + b for a, b in zip(self.__dict__.values(), other.__dict__.values())))


def mixer_params(mixer, hidden: int) -> _Parts:
    """Parameters of a token mixer, from its projections."""
    h = hidden
    if isinstance(mixer, Attention):
        q_out = mixer.num_heads * mixer.head_dim * (2 if mixer.output_gate else 1)  # gate doubles q_proj
        k_out, v_out = mixer.kv_heads * mixer.head_dim, mixer.kv_heads * mixer.v_head_dim
        o_in = mixer.num_heads * mixer.v_head_dim
        vectors = (q_out + k_out + v_out) * mixer.qkv_bias + h * mixer.o_bias
        qk_norm = (q_out + k_out) if mixer.qk_norm_whole else 2 * mixer.head_dim  # OLMoE: whole projections
        vectors += qk_norm * mixer.qk_norm + mixer.num_heads * mixer.sinks
        return _Parts(dense=h * (q_out + k_out + v_out) + o_in * h, vectors=vectors)
    if isinstance(mixer, MLA):
        qk_head = mixer.qk_nope_head_dim + mixer.qk_rope_head_dim
        heads = mixer.num_heads
        if mixer.q_lora_rank:  # q_a (h -> rank), norm, q_b (rank -> heads x qk_head)
            q, q_vec = h * mixer.q_lora_rank + mixer.q_lora_rank * heads * qk_head, mixer.q_lora_rank
        else:
            q, q_vec = h * heads * qk_head, 0
        kv_a = h * (mixer.kv_lora_rank + mixer.qk_rope_head_dim)  # hidden -> latent + RoPE key
        kv_b = mixer.kv_lora_rank * heads * (mixer.qk_nope_head_dim + mixer.v_head_dim)  # latent -> K, V
        o = heads * mixer.v_head_dim * h
        return _Parts(dense=q + kv_a + kv_b + o, vectors=q_vec + mixer.kv_lora_rank)
    if isinstance(mixer, GatedDeltaNet):
        key_dim = mixer.num_key_heads * mixer.key_head_dim
        value_dim = mixer.num_value_heads * mixer.value_head_dim
        in_proj = h * (2 * key_dim + 2 * value_dim + 2 * mixer.num_value_heads)  # q, k, v, z, b, a
        conv = (2 * key_dim + value_dim) * mixer.conv_kernel  # depthwise, no bias
        vectors = conv + 2 * mixer.num_value_heads + mixer.value_head_dim  # + dt_bias, A_log, gated norm
        return _Parts(dense=in_proj + value_dim * h, vectors=vectors)
    if isinstance(mixer, Mamba2):
        d_inner = mixer.num_heads * mixer.head_dim
        conv_dim = d_inner + 2 * mixer.n_groups * mixer.state_size
        in_out = d_inner + conv_dim + mixer.num_heads  # z, (x, B, C), dt
        vectors = conv_dim * mixer.conv_kernel + conv_dim * mixer.conv_bias
        vectors += 3 * mixer.num_heads + d_inner  # dt_bias, A_log, D, gated norm
        vectors += (in_out + h) * mixer.proj_bias
        return _Parts(dense=h * in_out + d_inner * h, vectors=vectors)
    return _Parts()


def mlp_params(mlp, hidden: int) -> _Parts:
    """Parameters of a dense MLP or a mixture of experts."""
    h = hidden
    if isinstance(mlp, DenseMLP):
        mats = 3 if mlp.gated else 2
        bias = (2 * mlp.intermediate_size + h if mlp.gated else mlp.intermediate_size + h) * mlp.bias
        return _Parts(dense=mats * h * mlp.intermediate_size, vectors=bias)
    if isinstance(mlp, MoE):
        mats = 3 if mlp.gated else 2
        one = mats * h * mlp.expert_size
        one += ((2 if mlp.gated else 1) * mlp.expert_size + h) * mlp.expert_bias
        router = h * mlp.num_experts + h * mlp.shared_gate
        vectors = mlp.num_experts * (mlp.router_bias + mlp.score_bias)
        return _Parts(dense=mats * h * mlp.shared_size, experts=one * mlp.num_experts,
                      experts_active=one * mlp.top_k, routers=router, vectors=vectors)
    return _Parts()


def layer_params(layer: Layer, hidden: int) -> _Parts:
    """One block: mixer + MLP + norms (+ an MTP module's input projection and norms)."""
    parts = mixer_params(layer.mixer, hidden) + mlp_params(layer.mlp, hidden) + _Parts(vectors=layer.norms * hidden)
    if layer.mtp:  # concat(embedding, hidden) -> hidden, two input norms and an output norm
        parts += _Parts(dense=2 * hidden * hidden, vectors=3 * hidden)
    return parts


def count_params(spec: ModelConfig) -> ParamCounts | None:
    """Parameters by role; exact from a GGUF file's tensors when it has them, else from the layers.

    Returns None when the description lacks the vocabulary size (no embedding count possible).
    """
    if spec.file_weights and spec.file_weights.params:
        return spec.file_weights.params
    if spec.vocab_size is None:
        return None
    total = _Parts(vectors=spec.hidden_size)  # final norm
    for layer in spec.layers:
        total += layer_params(layer, spec.hidden_size)
    embedding = spec.vocab_size * spec.hidden_size
    return ParamCounts(embedding=embedding, lm_head=0 if spec.tie_word_embeddings else embedding, **total.__dict__)


@dataclass(frozen=True)
class WeightEstimate:
    """Weight memory and how it was obtained."""

    bytes: int | None  # None when neither a file nor a full count is available
    params: ParamCounts | None
    format: str  # what was assumed, in words
    exact: bool  # True: summed from the tensors in the file's headers


def params_bytes(params: int, fmt: str) -> int:
    """Bytes of `params` parameters stored in a format: 35e9 at '4' bits -> 17.5e9 B (16.30 GiB)."""
    if params < 0:
        raise KvlabError(f"parameter count must be positive, got {params}")
    return ceil_bytes(params * weight_format_bits(fmt))


def weight_bytes(spec: ModelConfig, fmt: str = "auto") -> WeightEstimate:
    """Weight bytes in a format, or as stored when fmt is 'auto'.

    'auto': exact bytes from the file when one was given; else the checkpoint's own format from the
    config (quantization_config, e.g. DeepSeek-V3 fp8 blocks, gpt-oss MXFP4 experts), else its dtype.
    A named format applies to every matrix (embeddings included); 1-D vectors stay at 16 bits.
    """
    params = count_params(spec)
    if fmt in (None, "", "auto"):
        if spec.file_weights:
            fw = spec.file_weights
            return WeightEstimate(fw.tensor_bytes, params, "as stored (exact, from the file's headers)", exact=True)
        if params is None:
            return WeightEstimate(None, None, "unknown (config has no vocab_size)", exact=False)
        return _as_checkpoint(spec, params)
    bits = weight_format_bits(fmt)
    if params is None:
        raise KvlabError(f"{spec.source}: config is missing 'vocab_size', needed to count the weights")
    vector_bits = Fraction(32) if bits >= 32 else Fraction(16)
    matrices = params.total - params.vectors
    total = ceil_bytes(matrices * bits + params.vectors * vector_bits)
    return WeightEstimate(total, params, f"{fmt} ({_bits_text(bits)} bits per weight)", exact=False)


def _as_checkpoint(spec: ModelConfig, params: ParamCounts) -> WeightEstimate:
    """The checkpoint's stored format as its config describes it."""
    dtype_bits = kv_dtype_bits(spec.dtype)
    q = spec.quantization
    if q is None:
        return WeightEstimate(ceil_bytes(params.total * dtype_bits), params, spec.dtype, exact=False)
    quantized = params.experts if q.experts_only else params.dense + params.experts
    rest = params.total - quantized
    total = ceil_bytes(quantized * q.bits + rest * dtype_bits)
    what = "experts" if q.experts_only else "layer matrices"
    text = f"{q.name}: {what} at {_bits_text(q.bits)} bits, the rest {spec.dtype}"
    return WeightEstimate(total, params, text, exact=False)


def _bits_text(bits: Fraction) -> str:
    return f"{float(bits):.4f}".rstrip("0").rstrip(".")
