"""config.json (a parsed dict) -> ModelConfig, the way transformers reads it: the one reader of config.json.

What the file alone does not say comes from the architecture's class defaults (Gemma 3's pattern and
context length), and layer kinds are derived like transformers derives them: `layer_types` when the
file lists them, else `full_attention_interval` (Qwen3-Next), `hybrid_override_pattern` (Nemotron-H),
`sliding_window_pattern` (Gemma 3), or `sliding_window` (Mistral; Qwen2 only with use_sliding_window).
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Any

from kvlab.config.layers import MLA, Attention, DenseMLP, GatedDeltaNet, Layer, Mamba2, MoE
from kvlab.config.model import ModelConfig, QuantScheme
from kvlab.config.rope import RopeConfig, rope_from_hf
from kvlab.errors import KvlabError
from kvlab.config.dtypes import canonical_dtype

# model_type values whose layout this module knows; anything else gets the generic formula and a note
KNOWN_TYPES = {
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "qwen3_next",
    "qwen3_5_text", "qwen3_5_moe_text", "gemma", "gemma2", "gemma3_text", "gpt_oss",
    "deepseek_v2", "deepseek_v3", "nemotron_h", "phi3", "starcoder2", "olmo2", "smollm3", "olmoe",
}
# defaults of the transformers config classes, used when the file leaves a key out
CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048},
    "mistral": {"max_position_embeddings": 32768},
    "qwen2": {"max_position_embeddings": 32768},
    "qwen3": {"max_position_embeddings": 32768},
    "gemma3_text": {
        "vocab_size": 262208, "max_position_embeddings": 131072, "sliding_window": 4096,
        "sliding_window_pattern": 6, "tie_word_embeddings": True, "head_dim": 256,
        "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 256,
    },
    "gemma2": {"sliding_window_pattern": 2, "tie_word_embeddings": True},
    "gemma": {"tie_word_embeddings": True},
}
QK_NORM_TYPES = {"qwen3", "qwen3_moe", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "gemma3_text", "olmo2",
                 "olmoe"}
QK_NORM_WHOLE_TYPES = {"olmoe"}  # q/k norms over the whole projections, not per head (OLMo 2's too: not run yet)
QKV_BIAS_TYPES = {"qwen2", "qwen2_moe"}  # q, k, v always carry a bias; o does not
GEMMA_TYPES = {"gemma", "gemma2", "gemma3_text"}  # scaled embeddings, RMSNorm as x̂ · (1 + w)
QWEN_HYBRID_TYPES = {"qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"}  # RMSNorm as x̂ · (1 + w); gated attention
SLIDING_ONLY_WITH_FLAG = {"qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "qwen3_next", "smollm3"}
_LAYER_TYPE_NAMES = {
    "full_attention": "full", "attention": "full", "global": "full",
    "sliding_attention": "sliding", "sliding_window": "sliding", "local": "sliding",
    "linear_attention": "linear", "mamba": "mamba", "mamba2": "mamba",
    "mlp": "mlp", "moe": "moe",
}
_NEMOTRON_PATTERN = {"M": "mamba", "*": "full", "-": "mlp", "E": "moe"}
MAX_DIM = 10**7  # no real hidden size, head count or vocabulary comes near this
MAX_LAYERS = 10_000


def config_from_hf(raw: dict, *, name: str, source: str) -> ModelConfig:
    """Normalise a parsed config.json (nested text_config included) into a ModelConfig."""
    if not isinstance(raw, dict):
        raise KvlabError(f"{source}: a config must be a JSON object, not {type(raw).__name__}")
    cfg, notes = _flatten(raw)
    model_type = str(cfg.get("model_type") or "unknown")
    for key, value in CLASS_DEFAULTS.get(model_type, {}).items():
        if cfg.get(key) is None:
            cfg[key] = value
            if key in ("max_position_embeddings", "sliding_window_pattern", "sliding_window"):
                notes.append(f"{key} = {value} is the {model_type} class default (not in the file)")
    known = model_type in KNOWN_TYPES
    r = _Reader(cfg, source, None if known else model_type)
    num_layers = _num_layers(cfg, r)
    hidden = r.int("hidden_size", "n_embd", "d_model")
    kinds = _layer_kinds(cfg, r, model_type, num_layers, notes)
    rope = rope_from_hf(cfg, source)
    mixers = {kind: _mixer(kind, cfg, r, model_type, notes, rope) for kind in sorted(set(kinds))}
    layers = tuple(
        Layer(mixer=mixers[kind], mlp=_mlp(i, kind, cfg, r, model_type), norms=_norms(model_type))
        for i, kind in enumerate(kinds)
    )
    if not known:  # reached only when every field the generic formula reads was present
        notes.append(f"unknown architecture {model_type!r}: generic decoder formula used "
                     "(every field it needs is present)")
    return ModelConfig(
        architecture=model_type,
        hidden_size=hidden,
        vocab_size=r.int("vocab_size", required=False),
        layers=layers,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=r.int("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                                      required=False, limit=2**40),
        rms_norm_eps=_float(cfg, "rms_norm_eps", 1e-6, source),
        rope=rope,
        embedding_scale=hidden**0.5 if model_type in GEMMA_TYPES else None,
        norm_offset=1.0 if model_type in GEMMA_TYPES | QWEN_HYBRID_TYPES else None,
        final_logit_softcap=_optional_float(cfg, "final_logit_softcapping", source),
        dtype=_dtype(cfg, notes),
        mtp_layers=_mtp_layers(cfg, r, layers),
        quantization=_quantization(cfg.get("quantization_config")),
        bos_token_id=_token_id(cfg.get("bos_token_id")),
        eos_token_ids=_token_ids(cfg.get("eos_token_id")),
        name=name,
        source=source,
        notes=tuple(notes),
    )


def _float(cfg: dict, key: str, default: float, source: str) -> float:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise KvlabError(f"{source}: '{key}' must be a positive number, got {value!r}")
    return float(value)


def _optional_float(cfg: dict, key: str, source: str) -> float | None:
    return None if cfg.get(key) is None else _float(cfg, key, 1.0, source)


def _token_id(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _token_ids(value: object) -> tuple[int, ...]:
    """eos_token_id: one id or a list of them (Llama 3, Qwen2.5 chat models list several)."""
    values = value if isinstance(value, list) else [value]
    return tuple(v for v in map(_token_id, values) if v is not None)


class _Reader:
    """Typed, validated access to config fields; errors name the field and the file."""

    def __init__(self, cfg: dict, source: str, unknown_type: str | None = None):
        self.cfg, self.source, self.unknown_type = cfg, source, unknown_type

    def int(self, *keys: str, required: bool = True, limit: int = MAX_DIM, minimum: int = 1) -> int | None:
        for key in keys:
            value = self.cfg.get(key)
            if value is None:
                continue
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or (isinstance(value, float) and not value.is_integer())):  # NaN, Infinity, 2.5
                raise KvlabError(f"{self.source}: '{key}' must be a whole number, got {value!r}")
            if not minimum <= value <= limit:
                raise KvlabError(f"{self.source}: '{key}' = {value} is out of range ({minimum}..{limit:,})")
            return int(value)
        if required:
            why = (f"unknown architecture {self.unknown_type!r}: the generic formula needs it" if self.unknown_type
                   else "needed for the memory count")
            raise KvlabError(f"{self.source}: config is missing '{keys[0]}' ({why})")
        return None


def _num_layers(cfg: dict, r: _Reader) -> int:
    """num_hidden_layers, or the length of the per-layer list when only that is given (Nemotron-H)."""
    listed = cfg.get("hybrid_override_pattern") or cfg.get("layers_block_type")
    if cfg.get("num_hidden_layers") is None and isinstance(listed, (str, list)) and 0 < len(listed) <= MAX_LAYERS:
        return len(listed)
    return r.int("num_hidden_layers", "n_layer", "num_layers", limit=MAX_LAYERS)


def _flatten(raw: dict) -> tuple[dict, list[str]]:
    """Merge a nested text_config over the outer keys (multimodal wrappers keep the LM inside it)."""
    notes: list[str] = []
    text = raw.get("text_config") or raw.get("llm_config")
    if not isinstance(text, dict):
        return dict(raw), notes
    cfg = {k: v for k, v in raw.items() if k not in ("text_config", "llm_config", "vision_config", "audio_config")}
    cfg.update({k: v for k, v in text.items() if v is not None})
    if raw.get("vision_config") is not None:
        notes.append("text model only: the vision encoder's weights are not counted (it has no KV cache)")
    return cfg, notes


def _layer_kinds(cfg: dict, r: _Reader, model_type: str, n: int, notes: list[str]) -> list[str]:
    """One of full / sliding / linear / mamba / mlp / moe per layer."""
    pattern = cfg.get("hybrid_override_pattern")
    if isinstance(pattern, str):
        if len(pattern) != n or set(pattern) - set(_NEMOTRON_PATTERN):
            raise KvlabError(f"{r.source}: 'hybrid_override_pattern' must have {n} characters from M * - E")
        return [_NEMOTRON_PATTERN[c] for c in pattern]
    listed = cfg.get("layer_types") or cfg.get("layers_block_type")
    if listed is not None:
        if not isinstance(listed, list) or len(listed) != n:
            raise KvlabError(f"{r.source}: 'layer_types' must list one type for each of the {n} layers")
        unknown = sorted({str(t) for t in listed} - set(_LAYER_TYPE_NAMES))
        if unknown:
            raise KvlabError(f"{r.source}: unknown layer type {unknown[0]!r} in 'layer_types'")
        kinds = [_LAYER_TYPE_NAMES[t] for t in listed]
        if model_type == "nemotron_h":  # transformers 5 spells Mamba-2 blocks "linear_attention" here
            kinds = ["mamba" if k == "linear" else k for k in kinds]
        return kinds
    interval = r.int("full_attention_interval", required=False, limit=MAX_LAYERS)
    if interval:
        return ["full" if (i + 1) % interval == 0 else "linear" for i in range(n)]
    window = cfg.get("sliding_window")
    period = r.int("sliding_window_pattern", required=False, limit=MAX_LAYERS)
    if period and window:
        return ["full" if (i + 1) % period == 0 else "sliding" for i in range(n)]
    if window is None:
        return ["full"] * n
    if model_type in SLIDING_ONLY_WITH_FLAG or cfg.get("use_sliding_window") is False:
        if not cfg.get("use_sliding_window"):
            return ["full"] * n  # Qwen2.5 carries a sliding_window that is switched off
        first = r.int("max_window_layers", required=False, minimum=0, limit=MAX_LAYERS) or 0
        return ["sliding" if i >= first else "full" for i in range(n)]
    if model_type not in ("mistral", "mixtral", "phi3", "starcoder2"):
        notes.append("'sliding_window' set with no per-layer types: every layer treated as sliding")
    return ["sliding"] * n


def _mixer(kind: str, cfg: dict, r: _Reader, model_type: str, notes: list[str], rope: RopeConfig):
    """The token mixer of every layer of one kind (all layers of a kind share one geometry here)."""
    if kind in ("mlp", "moe"):
        return None
    if kind == "mamba":
        return Mamba2(
            num_heads=r.int("mamba_num_heads"),
            head_dim=r.int("mamba_head_dim"),
            state_size=r.int("ssm_state_size", "state_size"),
            n_groups=r.int("n_groups", "mamba_n_groups"),
            conv_kernel=r.int("conv_kernel", "mamba_d_conv", limit=1024),
            conv_bias=bool(cfg.get("use_conv_bias", True)),
            proj_bias=bool(cfg.get("use_bias", False)),
            ssm_dtype=_ssm_dtype(cfg),
        )
    if kind == "linear":
        return GatedDeltaNet(
            num_key_heads=r.int("linear_num_key_heads"),
            num_value_heads=r.int("linear_num_value_heads"),
            key_head_dim=r.int("linear_key_head_dim"),
            value_head_dim=r.int("linear_value_head_dim"),
            conv_kernel=r.int("linear_conv_kernel_dim", limit=1024),
            ssm_dtype=_ssm_dtype(cfg),
        )
    heads = r.int("num_attention_heads", "n_head", "num_heads")
    if cfg.get("kv_lora_rank") is not None:
        return MLA(
            num_heads=heads,
            kv_lora_rank=r.int("kv_lora_rank"),
            qk_rope_head_dim=r.int("qk_rope_head_dim"),
            qk_nope_head_dim=r.int("qk_nope_head_dim"),
            v_head_dim=r.int("v_head_dim"),
            q_lora_rank=r.int("q_lora_rank", required=False),
            rope_interleaved=bool(cfg.get("rope_interleave", True)),
        )
    kv_heads = r.int("num_key_value_heads", "n_head_kv", required=r.unknown_type is not None)
    if kv_heads is None:
        kv_heads = heads  # transformers' convention: no KV-head count means plain multi-head attention
        notes.append("no 'num_key_value_heads': multi-head attention assumed (kv heads = attention heads)")
    head_dim = r.int("head_dim", "attention_head_dim", required=False)
    if head_dim is None:
        hidden = r.int("hidden_size", "n_embd", "d_model")
        if hidden % heads:
            raise KvlabError(f"{r.source}: config has no 'head_dim' and hidden_size {hidden} is not "
                             f"divisible by num_attention_heads {heads}")
        head_dim = hidden // heads
    window = r.int("sliding_window", limit=2**40) if kind == "sliding" else None
    bias = bool(cfg.get("attention_bias", False))
    return Attention(
        num_heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        v_head_dim=head_dim,
        window=window,
        qkv_bias=bias or model_type in QKV_BIAS_TYPES,
        o_bias=bias,
        qk_norm=model_type in QK_NORM_TYPES,
        qk_norm_whole=model_type in QK_NORM_WHOLE_TYPES,
        clip_qkv=_optional_float(cfg, "clip_qkv", r.source),
        output_gate=bool(cfg.get("attn_output_gate", model_type in QWEN_HYBRID_TYPES)),
        sinks=model_type == "gpt_oss",
        rope=_layer_rope(kind, cfg, rope),
        scale=_attention_scale(cfg, r, model_type, head_dim),
    )


def _attention_scale(cfg: dict, r: _Reader, model_type: str, head_dim: int) -> float | None:
    """Gemma 2/3 scale q·k by query_pre_attn_scalar^-1/2 (27B: 168, not its head_dim of 128); None: 1/√head_dim."""
    scalar = r.int("query_pre_attn_scalar", required=False) if model_type in ("gemma2", "gemma3_text") else None
    return None if scalar is None or scalar == head_dim else scalar**-0.5


def _layer_rope(kind: str, cfg: dict, rope: RopeConfig) -> RopeConfig | None:
    """Gemma 3's sliding layers rotate with their own base and no scaling (`rope_local_base_freq`);
    every other layer uses the model's rotary settings (None)."""
    local = cfg.get("rope_local_base_freq")
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("sliding_attention"), dict):  # transformers 5
        local = params["sliding_attention"].get("rope_theta", local)
    if kind != "sliding" or not isinstance(local, (int, float)) or isinstance(local, bool):
        return None
    return RopeConfig(theta=float(local))


def _mlp(i: int, kind: str, cfg: dict, r: _Reader, model_type: str) -> DenseMLP | MoE | None:
    """The feed-forward block of layer i."""
    if model_type == "nemotron_h":  # Nemotron-H blocks hold either a mixer or an MLP, never both
        if kind == "mlp":
            return DenseMLP(r.int("intermediate_size"), gated=False, bias=bool(cfg.get("mlp_bias")))
        if kind == "moe":
            return MoE(
                num_experts=r.int("n_routed_experts"), top_k=r.int("num_experts_per_tok"),
                expert_size=r.int("moe_intermediate_size"),
                shared_size=r.int("moe_shared_expert_intermediate_size", required=False, minimum=0) or 0,
                gated=False, score_bias=True,
            )
        return None
    num_experts = r.int("num_experts", "n_routed_experts", "num_local_experts", required=False, minimum=0)
    if num_experts and _is_moe_layer(i, cfg, r):
        shared = r.int("shared_expert_intermediate_size", required=False, minimum=0) or 0
        n_shared = r.int("n_shared_experts", required=False, minimum=0) or 0
        expert_size = r.int("moe_intermediate_size", "intermediate_size")
        gpt_oss = model_type == "gpt_oss"
        return MoE(
            num_experts=num_experts,
            top_k=r.int("num_experts_per_tok", "experts_per_token", "top_k"),
            expert_size=expert_size,
            shared_size=shared or n_shared * expert_size,
            shared_gate=bool(shared),
            router_bias=gpt_oss,
            expert_bias=gpt_oss,
            score_bias=model_type == "deepseek_v3",
            routing="topk_softmax" if gpt_oss else _routing(cfg, model_type),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", model_type in ("mixtral", "deepseek_v3"))),
            activation="clamped_swiglu" if gpt_oss else str(cfg.get("hidden_act") or "silu"),
            swiglu_limit=_float(cfg, "swiglu_limit", 7.0, r.source) if gpt_oss else None,
            swiglu_alpha=_float(cfg, "swiglu_alpha", 1.702, r.source) if gpt_oss else None,
            num_groups=r.int("n_group", required=False) or 1,
            top_k_groups=r.int("topk_group", required=False) or 1,
            routed_scaling_factor=_float(cfg, "routed_scaling_factor", 1.0, r.source),
        )
    return DenseMLP(r.int("intermediate_size", "n_inner", "ffn_dim"), bias=bool(cfg.get("mlp_bias")),
                    activation=str(cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"))


def _routing(cfg: dict, model_type: str) -> str:
    """How the router turns logits into expert weights: Qwen's and OLMoE's softmax then top-k, or a scoring
    function the config names (DeepSeek-V3's "sigmoid"), kept so the registry can name what it refuses."""
    scoring = cfg.get("scoring_func", "sigmoid" if model_type == "deepseek_v3" else None)  # transformers 5 omits it
    return f"{scoring}_topk" if isinstance(scoring, str) and scoring != "softmax" else "softmax_topk"


def _is_moe_layer(i: int, cfg: dict, r: _Reader) -> bool:
    first_dense = r.int("first_k_dense_replace", required=False, minimum=0, limit=MAX_LAYERS) or 0
    freq = r.int("moe_layer_freq", required=False, limit=MAX_LAYERS) or 1
    step = r.int("decoder_sparse_step", required=False, limit=MAX_LAYERS) or 1
    dense_only = cfg.get("mlp_only_layers") or []
    return i >= first_dense and i % freq == 0 and (i + 1) % step == 0 and i not in dense_only


def _norms(model_type: str) -> int:
    """Hidden-size norm vectors per block: Gemma 2/3 have four (pre and post), Nemotron-H one."""
    if model_type == "nemotron_h":
        return 1
    return 4 if model_type in ("gemma2", "gemma3_text") else 2


def _mtp_layers(cfg: dict, r: _Reader, layers: tuple[Layer, ...]) -> tuple[Layer, ...]:
    """Multi-token-prediction modules: one decoder layer each, like the model's last attention layer."""
    n = r.int("num_nextn_predict_layers", "mtp_num_hidden_layers", required=False, minimum=0, limit=64) or 0
    attention = [layer for layer in layers if isinstance(layer.mixer, (Attention, MLA))]
    if not n or not attention:
        return ()
    last = attention[-1]
    mixer = last.mixer
    if isinstance(mixer, Attention) and mixer.window:  # MTP heads attend to the full context
        mixer = dataclasses.replace(mixer, window=None)
    return tuple(Layer(mixer=mixer, mlp=last.mlp, norms=last.norms, mtp=True) for _ in range(n))


def _dtype(cfg: dict, notes: list[str]) -> str:
    value = cfg.get("torch_dtype") or cfg.get("dtype")
    if value is None:
        notes.append("config names no dtype: bfloat16 assumed")
        return "bfloat16"
    return canonical_dtype(value)


def _ssm_dtype(cfg: dict) -> str | None:
    value = cfg.get("mamba_ssm_dtype") or cfg.get("mamba_ssm_cache_dtype")
    return canonical_dtype(value) if value and value != "auto" else None


def _quantization(q: object) -> QuantScheme | None:
    """The checkpoint's stored format, from quantization_config, when it is one we can size."""
    if not isinstance(q, dict):
        return None
    method = str(q.get("quant_method", "")).lower()
    if method == "fp8":
        block = q.get("weight_block_size")
        if isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block):
            return QuantScheme(f"fp8 (fp32 scale per {block[0]}x{block[1]})",
                               8 + Fraction(32, block[0] * block[1]), experts_only=False)
        return QuantScheme("fp8", Fraction(8), experts_only=False)
    if method == "mxfp4":
        return QuantScheme("mxfp4 (experts only)", 4 + Fraction(8, 32), experts_only=True)
    bits, group = q.get("bits"), q.get("group_size")
    if method in ("gptq", "awq") and isinstance(bits, int) and isinstance(group, int) and group > 0:
        return QuantScheme(f"int{bits} group {group}", bits + Fraction(16, group), experts_only=False)
    return None
