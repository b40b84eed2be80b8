"""Which architectures the hand-written decoder runs, keyed by the config's architecture name.

An entry names the model class and the source quirks its weights need; `check_supported` reads
the normalised ModelConfig layer by layer and refuses, in one line, anything the model would get
wrong (an output gate, a bias it has no parameter for, a routing it does not know) instead of running it. What
it accepts is exactly what the decoder computes: softmax attention of one geometry in every layer
(each with its own sliding window, rotary settings and q·k scale), q/k norms (per head, or over the whole
projections as OLMoE's), q/k/v and o biases, attention sinks (gpt-oss), a bias-free gated MLP (SiLU or
tanh-GELU) or a mixture of experts (kvlab.model.moe: Qwen's and OLMoE's softmax-then-top-k routing, gpt-oss's
top-k-then-softmax with a router bias, DeepSeek-V3's group-limited sigmoid routing with its correction bias,
SiLU or gpt-oss's clamped SwiGLU experts, a gated or ungated shared expert), multi-head latent attention
(DeepSeek: kvlab.model.mla, one latent geometry in every layer),
two norms per layer or Gemma's four, scaled embeddings, a final logit softcap.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.config import MLA, Attention, DenseMLP, GatedDeltaNet, ModelConfig, MoE
from kvlab.config.layers import EXPERT_ACTIVATIONS, ROUTINGS
from kvlab.errors import KvlabError


@dataclass(frozen=True)
class Architecture:
    family: str  # the decoder family: llama, qwen2, qwen3, gemma3, qwen2_moe, qwen3_moe, olmoe, gpt_oss
    gguf_permuted_qk: bool = False  # llama.cpp reorders q/k rows of this family when converting


# config.json model_type or GGUF general.architecture → how kvlab runs it
ARCHITECTURES = {
    "llama": Architecture("llama", gguf_permuted_qk=True),
    "mistral": Architecture("llama"),
    "qwen2": Architecture("qwen2"),
    "qwen3": Architecture("qwen3"),
    "gemma3": Architecture("gemma3"),  # GGUF (llama.cpp's name)
    "gemma3_text": Architecture("gemma3"),  # config.json (Gemma3ForCausalLM; the text model of Gemma 3)
    "qwen2_moe": Architecture("qwen2_moe"),
    "qwen2moe": Architecture("qwen2_moe"),  # GGUF
    "qwen3_moe": Architecture("qwen3_moe"),
    "qwen3moe": Architecture("qwen3_moe"),  # GGUF
    "olmoe": Architecture("olmoe"),  # config.json and GGUF alike
    "gpt_oss": Architecture("gpt_oss"),
    "gpt-oss": Architecture("gpt_oss"),  # GGUF
    "deepseek_v3": Architecture("deepseek_v3"),  # multi-head latent attention, sigmoid-routed experts
    "deepseek2": Architecture("deepseek_v3"),  # GGUF (llama.cpp's one name for DeepSeek-V2 and V3)
    # hybrids: Gated DeltaNet layers (kvlab.model.deltanet, a state per sequence) beside gated attention
    "qwen3_5_text": Architecture("qwen3_5"),
    "qwen3_5_moe_text": Architecture("qwen3_5"),
    "qwen3_next": Architecture("qwen3_next"),
    "qwen35": Architecture("qwen3_5"),  # GGUF: value heads stored tiled by key head (llama.cpp's converter)
    "qwen35moe": Architecture("qwen3_5"),
    "qwen3next": Architecture("qwen3_next"),
}
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # the gated MLPs kvlab.model.layers has


def check_architecture_name(name: str, shown: str | None = None) -> None:
    """Refuse an architecture the registry does not know, before its config is read any further."""
    if name not in ARCHITECTURES:
        runs = ", ".join(sorted({a.family for a in ARCHITECTURES.values()}))
        raise KvlabError(f"unsupported architecture '{shown or name}': kvlab runs {runs}")


def architecture_of(config: ModelConfig) -> Architecture:
    """The registry entry for `config`, after checking every layer is one the decoder computes exactly."""
    check_architecture_name(config.architecture)
    arch = ARCHITECTURES[config.architecture]
    problem = _unsupported_feature(config)
    if problem:
        raise KvlabError(f"{config.name or config.architecture}: {problem}, which kvlab cannot run yet")
    return arch


def _unsupported_feature(config: ModelConfig) -> str | None:
    if config.vocab_size is None:
        return "the source gives no vocabulary size"
    if config.max_position_embeddings is None:
        return "the source gives no context length (max_position_embeddings)"
    first = next((layer.mixer for layer in config.layers if not isinstance(layer.mixer, GatedDeltaNet)), None)
    for i, layer in enumerate(config.layers):
        m, mlp = layer.mixer, layer.mlp
        if isinstance(m, GatedDeltaNet):
            problem = _unsupported_deltanet(m)
        elif isinstance(m, MLA):
            problem = _unsupported_mla(m, first)
        else:
            problem = _unsupported_attention(m, first, layer.label)
        if problem:
            return f"layer {i}{problem}"
        if isinstance(mlp, MoE):
            problem = _unsupported_moe(mlp)
            if problem:
                return f"layer {i}'s mixture of experts {problem}"
        elif not isinstance(mlp, DenseMLP) or not mlp.gated or mlp.bias or mlp.activation not in ACTIVATIONS:
            return f"layer {i}'s MLP is not a bias-free gated MLP ({' or '.join(ACTIVATIONS)})"
        elif mlp.intermediate_size != config.intermediate_size:
            return f"layer {i}'s MLP differs in size from the first dense MLP's"
        if layer.norms not in (2, 4):
            return f"layer {i} has {layer.norms} norms"
    return None


def _unsupported_attention(m, first, label: str) -> str | None:
    """What of softmax-attention layer `m` the decoder does not compute, as a phrase after "layer i"."""
    if not isinstance(m, Attention) or not isinstance(first, Attention):
        return f" is {label}" if not isinstance(m, Attention) else "'s attention differs from layer 0's MLA"
    if m.v_head_dim != m.head_dim:
        return "'s attention has a separate value size"
    same = (m.num_heads, m.kv_heads, m.head_dim, m.qkv_bias, m.qk_norm)  # one paged cache for every layer
    if same != (first.num_heads, first.kv_heads, first.head_dim, first.qkv_bias, first.qk_norm):
        return "'s attention differs in shape from layer 0's"
    if m.window is not None and m.window < 1:
        return f" has a sliding window of {m.window} tokens"
    return None


def _unsupported_deltanet(m: GatedDeltaNet) -> str | None:
    """Gated DeltaNet (kvlab.model.deltanet): value heads in whole groups per key head, a conv of width ≥ 1."""
    if m.num_value_heads % m.num_key_heads or m.conv_kernel < 1:
        return f"'s Gated DeltaNet has {m.num_value_heads} value heads for {m.num_key_heads} key heads " \
               f"and a conv of width {m.conv_kernel}"
    return None


def _unsupported_mla(m: MLA, first) -> str | None:
    """Multi-head latent attention (kvlab.model.mla): one latent geometry in every layer (one paged cache)."""
    if m != first:
        return "'s latent attention differs from layer 0's mixer"
    return None


def _unsupported_moe(moe: MoE) -> str | None:
    """What of a mixture of experts kvlab.model.moe does not compute (None: all of it)."""
    if moe.routing not in ROUTINGS:
        return f"routes with {moe.routing} (kvlab routes with {', '.join(ROUTINGS)})"
    if (moe.score_bias or moe.num_groups > 1 or moe.routed_scaling_factor != 1.0) and moe.routing != "sigmoid_topk":
        return f"routes with {moe.routing} and a correction bias, expert groups or a scaling factor " \
               "(kvlab runs those with DeepSeek-V3's sigmoid_topk only)"
    if moe.routing == "sigmoid_topk" and not moe.score_bias:
        return "routes with sigmoid_topk without DeepSeek-V3's correction bias (a config transformers may read otherwise)"
    per_group = moe.num_experts // max(moe.num_groups, 1)
    if moe.num_experts % moe.num_groups or not 0 < moe.top_k_groups <= moe.num_groups or \
            (moe.num_groups > 1 and per_group < 2) or moe.top_k > moe.top_k_groups * per_group:
        return f"has {moe.num_groups} expert groups, top {moe.top_k_groups}, for {moe.top_k} of {moe.num_experts} experts"
    if not moe.gated or moe.activation not in EXPERT_ACTIVATIONS:
        return f"has {moe.activation} experts{'' if moe.gated else ' without a gate'} (kvlab runs gated " \
               f"{' or '.join(EXPERT_ACTIVATIONS)} experts)"
    if not 0 < moe.top_k <= moe.num_experts:
        return f"chooses {moe.top_k} of {moe.num_experts} experts"
    return None
