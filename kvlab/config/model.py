"""ModelConfig: one frozen, normalised description of a model, layer by layer.

Every source (config.json, a Hugging Face directory, GGUF metadata, a bundled config) is read into
this one structure by one reader per source (`config/hf.py`, `config/gguf.py`); the model builds
itself from it and `kvlab mem` does its arithmetic on it, so an architectural fact lands once.

Facts that vary by layer (attention kind and window, head geometry, biases, q/k norms, rotary
settings, the MLP's kind and activation, norms) live on each `Layer`; the properties below read the
model-wide ones for architectures whose attention layers all share one geometry. Numbers that
depend on a run (cache length, dtype in memory, device, number of blocks) live elsewhere.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from fractions import Fraction

from kvlab.config.layers import Attention, DenseMLP, Layer
from kvlab.config.rope import RopeConfig


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
class ModelConfig:
    """A decoder-only model, layer by layer, normalised from whatever source described it."""

    architecture: str  # config.json's model_type, or GGUF general.architecture: llama, qwen2, gemma3_text, ...
    hidden_size: int
    vocab_size: int | None  # None only where the source does not say (the calculator then skips weights)
    layers: tuple[Layer, ...]
    tie_word_embeddings: bool = False
    max_position_embeddings: int | None = None  # trained context length; None when the source does not say
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)  # of every attention layer without its own
    embedding_scale: float | None = None  # token embeddings times this, in the weights' dtype (Gemma: √hidden)
    # RMSNorm's weight applied as x̂ · (norm_offset + w) in float32, rounded once (Gemma: 1.0 in its own
    # checkpoints, 0.0 in llama.cpp's GGUFs, whose converter added the 1); None: Llama's w · x̂
    norm_offset: float | None = None
    final_logit_softcap: float | None = None  # logits = cap · tanh(logits / cap); None: raw logits
    dtype: str = "bfloat16"  # the checkpoint's own dtype: default KV dtype and state dtype
    state_dtype: str | None = None  # dtype of every recurrent state when the runtime fixes it (llama.cpp: f32)
    mtp_layers: tuple[Layer, ...] = ()  # multi-token-prediction modules, counted only after with_mtp()
    quantization: QuantScheme | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # where the description came from
    name: str = ""
    source: str = ""
    file_weights: FileWeights | None = None
    notes: tuple[str, ...] = ()
    # positions a rope-scaling override (--rope-scaling, with_rope_scaling) stretches the model to:
    # original × factor; None without one. max_position_embeddings stays the trained length.
    extended_context: int | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    # ---- model-wide facts of a model whose attention layers share one geometry ---------------------

    @property
    def attention(self) -> Attention:
        """The first softmax-attention layer's mixer (head counts, head size, biases, q/k norm)."""
        for layer in self.layers:
            if isinstance(layer.mixer, Attention):
                return layer.mixer
        raise ValueError(f"{self.name or self.architecture} has no softmax-attention layer")

    @property
    def num_heads(self) -> int:
        return self.attention.num_heads

    @property
    def num_kv_heads(self) -> int:
        return self.attention.kv_heads

    @property
    def head_dim(self) -> int:
        return self.attention.head_dim

    @property
    def qkv_bias(self) -> bool:
        return self.attention.qkv_bias

    @property
    def qk_norm(self) -> bool:
        return self.attention.qk_norm

    @property
    def intermediate_size(self) -> int:
        for layer in self.layers:
            if isinstance(layer.mlp, DenseMLP):
                return layer.mlp.intermediate_size
        raise ValueError(f"{self.name or self.architecture} has no dense MLP")

    @property
    def kv_elements_per_token(self) -> int:
        """Numbers the KV cache stores per token: layers × (K and V) × kv heads × head dim."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim

    # ---- derived descriptions ---------------------------------------------------------------------

    def with_mtp(self) -> ModelConfig:
        """This model with its multi-token-prediction modules counted as layers (for speculative decoding)."""
        if not self.mtp_layers:
            return self
        note = f"{len(self.mtp_layers)} MTP layer(s) counted"
        return dataclasses.replace(
            self, layers=self.layers + self.mtp_layers, mtp_layers=(), notes=self.notes + (note,)
        )

    @property
    def context_limit(self) -> int | None:
        """Tokens a sequence may hold: the trained max_position_embeddings, or the context a rope-scaling
        override stretched it to."""
        return self.extended_context or self.max_position_embeddings

    def with_rope_scaling(self, scaling: str | dict) -> ModelConfig:
        """This model with the rope_scaling block `scaling` in place of its own (vLLM's --hf-overrides
        rope_scaling, llama.cpp's --rope-scaling): the rotary settings of every layer without its own
        (Gemma 3's sliding layers keep theirs, as in transformers), and `extended_context`."""
        from kvlab.config.rope import rope_override

        rope, context = rope_override(self.rope, scaling, self.max_position_embeddings)
        note = (f"rope scaling overridden: {rope.type}, factor {rope.factor:g}, context {context:,} tokens "
                f"(trained: {self.max_position_embeddings:,})" if context else f"rope scaling overridden: {rope.type}")
        return dataclasses.replace(self, rope=rope, extended_context=context if rope.type != "default" else None,
                                   notes=self.notes + (note,))  # fmt: skip

    def with_note(self, note: str) -> ModelConfig:
        return dataclasses.replace(self, notes=self.notes + (note,))

    def count_by_label(self) -> dict[str, int]:
        """How many layers of each kind, in order of first appearance."""
        counts: dict[str, int] = {}
        for layer in self.layers:
            counts[layer.label] = counts.get(layer.label, 0) + 1
        return counts
