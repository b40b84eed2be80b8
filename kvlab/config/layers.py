"""The layers of a model: what each block of a ModelConfig holds, one frozen dataclass per kind.

A layer is a token mixer (what owns the cache) plus an MLP. Mixers:
    Attention      softmax attention caching K and V per token; `window` set = sliding-window layer
    MLA            multi-head latent attention caching one compressed latent per token (DeepSeek)
    GatedDeltaNet  linear attention with a constant per-sequence state (Qwen3-Next, Qwen3.5)
    Mamba2         state-space mixer with a constant per-sequence state (Nemotron-H)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Union

from kvlab.config.rope import RopeConfig


@dataclass(frozen=True)
class Attention:
    """Softmax attention (MHA, GQA or MQA) that caches one K and one V vector per KV head per token."""

    kind: ClassVar[str] = "attention"
    num_heads: int  # query heads
    kv_heads: int  # K/V heads actually stored (GQA: fewer than num_heads; MQA: 1)
    head_dim: int  # size of one K head (and one query head)
    v_head_dim: int  # size of one V head
    window: int | None = None  # sliding window in tokens; None = the layer sees the whole context
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # RMSNorm on q and k (Qwen3, Gemma 3: per head)
    qk_norm_whole: bool = False  # ... over the whole q and k projections, before the heads split (OLMoE)
    clip_qkv: float | None = None  # q, k and v clamped to ±clip_qkv after the projections (OLMoE, optional)
    output_gate: bool = False  # q_proj also emits a sigmoid gate per head (Qwen3-Next, Qwen3.5)
    sinks: bool = False  # one learned sink logit per head (gpt-oss)
    rope: RopeConfig | None = None  # this layer's own rotary settings (Gemma 3's sliding layers); None: the model's
    scale: float | None = None  # multiplier of q·k; None: 1/√head_dim (Gemma 3: query_pre_attn_scalar^-1/2)

    @property
    def label(self) -> str:
        return "sliding_attention" if self.window else "full_attention"


@dataclass(frozen=True)
class MLA:
    """Multi-head latent attention: the cache holds c_KV (kv_lora_rank) and one shared RoPE key."""

    kind: ClassVar[str] = "mla"
    label: ClassVar[str] = "mla"
    num_heads: int
    kv_lora_rank: int  # size of the cached latent c_KV
    qk_rope_head_dim: int  # size of the cached decoupled RoPE key (one for all heads)
    qk_nope_head_dim: int  # per-head key part rebuilt from the latent
    v_head_dim: int  # per-head value rebuilt from the latent
    q_lora_rank: int | None = None  # None: queries projected straight from the hidden state
    rope_interleaved: bool = True  # the rotary channels pair as (0, 1), (2, 3), ... (DeepSeek's rope_interleave)


@dataclass(frozen=True)
class GatedDeltaNet:
    """Gated DeltaNet linear attention: a short causal conv plus a matrix-valued recurrent state."""

    kind: ClassVar[str] = "gated_deltanet"
    label: ClassVar[str] = "linear_attention"
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int  # width of the depthwise causal conv over q, k and v
    ssm_dtype: str | None = None  # dtype the config asks for the recurrent state (None: model dtype)


@dataclass(frozen=True)
class Mamba2:
    """Mamba-2 selective state-space mixer: a short causal conv plus an SSM state per head."""

    kind: ClassVar[str] = "mamba2"
    label: ClassVar[str] = "mamba2"
    num_heads: int
    head_dim: int
    state_size: int  # d_state, the SSM state per channel
    n_groups: int  # groups sharing B and C
    conv_kernel: int
    conv_bias: bool = True
    proj_bias: bool = False
    ssm_dtype: str | None = None


Mixer = Union[Attention, MLA, GatedDeltaNet, Mamba2]


@dataclass(frozen=True)
class DenseMLP:
    """A feed-forward block: gate+up+down when gated (SwiGLU/GeGLU), up+down otherwise (relu², GELU)."""

    intermediate_size: int
    gated: bool = True
    bias: bool = False
    activation: str = "silu"  # of the gate (gated) or of up (plain): silu, gelu_pytorch_tanh, relu2, ...


ROUTINGS = ("softmax_topk", "topk_softmax", "sigmoid_topk")  # MoE.routing: the router's scores and top-k
EXPERT_ACTIVATIONS = ("silu", "clamped_swiglu")  # MoE.activation of the routed experts


@dataclass(frozen=True)
class MoE:
    """A mixture of experts: `top_k` of `num_experts` routed experts per token, plus shared experts.

    Routing: "softmax_topk" (Qwen, OLMoE) takes the top-k of softmax(router logits), renormalised to sum
    to 1 when `norm_topk_prob`; "topk_softmax" (gpt-oss) softmaxes the top-k logits themselves.
    "sigmoid_topk" (DeepSeek-V3) chooses by sigmoid(logits) + the correction bias (`score_bias`), within the
    `top_k_groups` of `num_groups` expert groups whose two best scores sum highest, weighs by the sigmoids
    (renormalised when `norm_topk_prob`), times `routed_scaling_factor`.
    Experts: "silu" is down(silu(gate) · up); "clamped_swiglu" (gpt-oss) clamps gate ≤ limit and
    |up| ≤ limit, then down((up + 1) · gate · sigmoid(alpha · gate)).
    """

    num_experts: int
    top_k: int
    expert_size: int  # intermediate size of one routed expert
    shared_size: int = 0  # total intermediate size of the always-on shared expert(s); 0 = none
    gated: bool = True
    shared_gate: bool = False  # Qwen: a sigmoid gate (hidden -> 1) on the shared expert
    router_bias: bool = False
    expert_bias: bool = False  # biases inside every expert (gpt-oss)
    score_bias: bool = False  # a per-expert routing correction bias (DeepSeek-V3)
    routing: str = "softmax_topk"  # see ROUTINGS
    norm_topk_prob: bool = False  # softmax_topk: the chosen probabilities renormalised to sum to 1
    activation: str = "silu"  # see EXPERT_ACTIVATIONS
    swiglu_limit: float | None = None  # clamped_swiglu's clamp
    swiglu_alpha: float | None = None  # clamped_swiglu's sigmoid slope
    num_groups: int = 1  # sigmoid_topk: experts split into this many groups (DeepSeek's n_group)
    top_k_groups: int = 1  # ... of which the top_k are chosen within this many (topk_group)
    routed_scaling_factor: float = 1.0  # the routed experts' weights times this (DeepSeek-V3: 2.5)


@dataclass(frozen=True)
class Layer:
    """One block of the model: a token mixer (or none) and an MLP (or none)."""

    mixer: Mixer | None
    mlp: DenseMLP | MoE | None
    norms: int = 2  # hidden-size norm weight vectors in the block
    mtp: bool = False  # a multi-token-prediction module, not a layer of the main model

    @property
    def label(self) -> str:
        """The layer kind as printed: full_attention, sliding_attention, mla, linear_attention, ..."""
        if self.mixer is None:
            return "mlp_only"
        return self.mixer.label
