"""ModelSpec: a model described layer by layer, with exactly the facts the memory calculator needs.

Every source (config.json, a Hugging Face directory, GGUF metadata, a bundled config) is normalised
into this one frozen structure; the arithmetic in kv.py, weights.py and fit.py reads nothing else.

A layer is a token mixer (what owns the cache) plus an MLP. Mixers:
    Attention      softmax attention caching K and V per token; `window` set = sliding-window layer
    MLA            multi-head latent attention caching one compressed latent per token (DeepSeek)
    GatedDeltaNet  linear attention with a constant per-sequence state (Qwen3-Next, Qwen3.5)
    Mamba2         state-space mixer with a constant per-sequence state (Nemotron-H)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from fractions import Fraction
from typing import ClassVar, Union


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
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3, Gemma 3)
    output_gate: bool = False  # q_proj also emits a sigmoid gate per head (Qwen3-Next, Qwen3.5)
    sinks: bool = False  # one learned sink logit per head (gpt-oss)

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


@dataclass(frozen=True)
class MoE:
    """A mixture of experts: `top_k` of `num_experts` routed experts per token, plus shared experts."""

    num_experts: int
    top_k: int
    expert_size: int  # intermediate size of one routed expert
    shared_size: int = 0  # total intermediate size of the always-on shared expert(s); 0 = none
    gated: bool = True
    shared_gate: bool = False  # Qwen: a sigmoid gate (hidden -> 1) on the shared expert
    router_bias: bool = False
    expert_bias: bool = False  # biases inside every expert (gpt-oss)
    score_bias: bool = False  # a per-expert routing correction bias (DeepSeek-V3)


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


@dataclass(frozen=True)
class QuantScheme:
    """How the checkpoint stores its weights when the config says so (quantization_config)."""

    name: str  # e.g. "fp8-block128", "mxfp4", "int4"
    bits: Fraction  # bits per quantized parameter, scales included
    experts_only: bool  # True: only routed-expert weights are quantized (gpt-oss MXFP4)


@dataclass(frozen=True)
class ParamCounts:
    """Parameters by role; the role decides which ones a weight format quantizes."""

    embedding: int  # input embedding table (vocab x hidden)
    lm_head: int  # output projection; 0 when tied to the embedding
    dense: int  # every other matrix outside the routed experts (attention, dense MLPs, shared experts)
    experts: int  # routed-expert matrices and biases, all experts
    experts_active: int  # the part of `experts` one token uses (top_k of num_experts)
    routers: int  # expert routers and gates (kept in high precision by quantized checkpoints)
    vectors: int  # 1-D parameters: norms, biases, conv filters, A, D, dt (kept in 16 bits)

    @property
    def total(self) -> int:
        return self.embedding + self.lm_head + self.dense + self.experts + self.routers + self.vectors

    @property
    def active(self) -> int:
        """Parameters one token multiplies with: all but the unused experts and, when the output
        projection is separate, the input embedding table (a token only reads one row of it).
        gpt-oss-20b: 3.6B, as OpenAI counts it."""
        lookup_only = self.embedding if self.lm_head else 0  # tied: the table is also the output matmul
        return self.total - lookup_only - (self.experts - self.experts_active)


@dataclass(frozen=True)
class FileWeights:
    """Exact weight storage read from safetensors or GGUF headers."""

    path: str
    tensor_bytes: int  # bytes of tensor data, headers excluded
    num_elements: int  # numbers stored (packed formats count their storage units)
    bytes_by_type: tuple[tuple[str, int], ...]  # (dtype or GGUF type, bytes), largest first
    file_bytes: int | None = None  # size on disk, headers and padding included
    params: ParamCounts | None = None  # exact counts by role when the file's tensor names tell them (GGUF)


@dataclass(frozen=True)
class ModelSpec:
    """A model, layer by layer, normalised from whatever source described it."""

    name: str
    architecture: str  # model_type of config.json, or GGUF general.architecture
    source: str  # where the description came from, for the report
    hidden_size: int
    vocab_size: int | None
    tie_embeddings: bool
    layers: tuple[Layer, ...]
    dtype: str = "bfloat16"  # the model's own dtype: default KV dtype and state dtype
    max_context: int | None = None  # trained context length (max_position_embeddings)
    state_dtype: str | None = None  # dtype of every recurrent state when the runtime fixes it (llama.cpp: f32)
    mtp_layers: tuple[Layer, ...] = ()  # multi-token-prediction modules, counted only after with_mtp()
    quantization: QuantScheme | None = None
    file_weights: FileWeights | None = None
    notes: tuple[str, ...] = ()

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def with_mtp(self) -> ModelSpec:
        """This spec with its multi-token-prediction modules counted as layers (for speculative decoding)."""
        if not self.mtp_layers:
            return self
        note = f"{len(self.mtp_layers)} MTP layer(s) counted"
        return dataclasses.replace(
            self, layers=self.layers + self.mtp_layers, mtp_layers=(), notes=self.notes + (note,)
        )

    def with_note(self, note: str) -> ModelSpec:
        return dataclasses.replace(self, notes=self.notes + (note,))

    def count_by_label(self) -> dict[str, int]:
        """How many layers of each kind, in order of first appearance."""
        counts: dict[str, int] = {}
        for layer in self.layers:
            counts[layer.label] = counts.get(layer.label, 0) + 1
        return counts
