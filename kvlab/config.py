"""ModelConfig: every architectural fact of a decoder, from config.json or GGUF metadata.

The config is frozen: numbers that depend on the run (cache length, dtype, device) live elsewhere.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvlab.errors import KvlabError

# Hugging Face `architectures[0]` and GGUF `general.architecture` → our architecture name.
ARCHITECTURE_ALIASES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
}
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding: base frequency and optional context-extension scaling."""

    theta: float = 10000.0
    type: str = "default"  # default | linear | llama3 | yarn
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn: scale on cos/sin; derived from factor when None
    mscale: float | None = None  # yarn (DeepSeek style)
    mscale_all_dim: float | None = None
    truncate: bool = True  # yarn


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer (Llama, Qwen2, Qwen3 families)."""

    architecture: str  # llama | qwen2 | qwen3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA: fewer than num_heads)
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: biases on q, k, v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def kv_elements_per_token(self) -> int:
        """Numbers the KV cache stores per token: layers × (K and V) × kv heads × head dim."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim

    def with_overrides(self, **changes: Any) -> "ModelConfig":
        return replace(self, **changes)

    # ---- constructors -------------------------------------------------------------------

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """From a parsed Hugging Face config.json."""
        cfg = cfg.get("text_config", cfg)
        arch_names = list(cfg.get("architectures") or []) + [cfg.get("model_type", "")]
        arch = next((ARCHITECTURE_ALIASES[a] for a in arch_names if a in ARCHITECTURE_ALIASES), None)
        if arch is None:
            name = (cfg.get("architectures") or [cfg.get("model_type", "unknown")])[0]
            raise KvlabError(
                f"unsupported architecture '{name}': kvlab runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        need = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]
        missing = [k for k in need if k not in cfg]
        if missing:
            raise KvlabError(f"config.json is missing '{missing[0]}'")
        num_heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rope=_rope_from_hf(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "ModelConfig":
        path = Path(path) / "config.json"
        if not path.is_file():
            raise KvlabError(f"no config.json in {path.parent}: a model directory needs one")
        try:
            return cls.from_hf(json.loads(path.read_text()))
        except json.JSONDecodeError as e:
            raise KvlabError(f"{path} is not valid JSON ({e.msg} at line {e.lineno})") from None

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]]) -> "ModelConfig":
        """From GGUF metadata (key → value) and the tensors' shapes (PyTorch order) in the file."""
        gguf_arch = meta.get("general.architecture", "unknown")
        arch = ARCHITECTURE_ALIASES.get(gguf_arch)
        if arch is None:
            raise KvlabError(
                f"unsupported architecture '{gguf_arch}' in GGUF file: kvlab runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )

        def get(key: str, default: Any = None) -> Any:
            value = meta.get(f"{gguf_arch}.{key}", default)
            if value is None:
                raise KvlabError(f"GGUF metadata is missing '{gguf_arch}.{key}'")
            return value

        hidden = int(get("embedding_length"))
        num_heads = int(get("attention.head_count"))
        if "token_embd.weight" not in tensor_shapes:
            raise KvlabError("GGUF file has no token_embd.weight tensor")
        vocab = tensor_shapes["token_embd.weight"][0]  # rows of the embedding: the model's vocabulary
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(get("attention.head_count_kv", num_heads)),
            head_dim=int(get("attention.key_length", hidden // num_heads)),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            max_position_embeddings=int(get("context_length", 2048)),
            rope=_rope_from_gguf(meta, gguf_arch),
            tie_word_embeddings="output.weight" not in tensor_shapes,
            qkv_bias="blk.0.attn_q.bias" in tensor_shapes,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_shapes,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (int(eos),),
        )


def _rope_from_hf(cfg: dict[str, Any]) -> RopeConfig:
    # transformers 5 writes `rope_parameters` (with rope_theta inside); older files `rope_scaling` + `rope_theta`
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "linear", "llama3", "yarn"):
        raise KvlabError(f"unsupported rope_scaling type '{rope_type}': kvlab knows default, linear, llama3, yarn")
    original = params.get("original_max_position_embeddings")
    if rope_type in ("llama3", "yarn") and original is None:
        original = cfg.get("max_position_embeddings")
    factor = params.get("factor")
    if factor is None:
        factor = cfg.get("max_position_embeddings", 1) / original if rope_type == "yarn" and original else 1.0
    return RopeConfig(
        theta=float(theta),
        type=rope_type,
        factor=float(factor),
        original_max_position_embeddings=original,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=params.get("attention_factor"),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
    )


def _rope_from_gguf(meta: dict[str, Any], arch: str) -> RopeConfig:
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling in ("none", None):
        return RopeConfig(theta=theta)
    if scaling not in ("linear", "yarn"):
        raise KvlabError(f"unsupported GGUF rope scaling '{scaling}': kvlab knows linear and yarn")
    return RopeConfig(
        theta=theta,
        type=scaling,
        factor=float(meta.get(f"{arch}.rope.scaling.factor", 1.0)),
        original_max_position_embeddings=meta.get(f"{arch}.rope.scaling.original_context_length"),
    )
