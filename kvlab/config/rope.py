"""RopeConfig: the rotary position embedding's base frequency and context-extension scaling.

Read from config.json (`rope_parameters` in transformers 5, `rope_scaling` + `rope_theta` before) or
from GGUF metadata (`{arch}.rope.freq_base`, `{arch}.rope.scaling.*`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvlab.errors import KvlabError

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


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
    partial_rotary_factor: float = 1.0  # share of each head's channels rotated (Qwen3.5, Qwen3-Next: 0.25)


def rope_from_hf(cfg: dict[str, Any], source: str = "config.json") -> RopeConfig:
    """The rotary settings of a (flattened) config.json."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise KvlabError(f"{source}: 'rope_scaling' must be an object, not {type(params).__name__}")
    params = dict(params)
    if isinstance(params.get("full_attention"), dict):  # transformers 5 keys Gemma 3's by layer type
        params = dict(params["full_attention"])
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise KvlabError(f"{source}: unsupported rope_scaling type '{rope_type}': kvlab knows {', '.join(ROPE_TYPES)}")
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
        partial_rotary_factor=_partial_factor(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor")),
                                              source),
    )


def _partial_factor(value: Any, source: str) -> float:
    if value is None:
        return 1.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise KvlabError(f"{source}: 'partial_rotary_factor' must be a number in (0, 1], got {value!r}")
    return float(value)


def rope_from_gguf(meta: dict[str, Any], arch: str) -> RopeConfig:
    """The rotary settings of a GGUF file's metadata."""
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling in ("none", None):
        return RopeConfig(theta=theta)
    if scaling not in ("linear", "yarn"):
        raise KvlabError(f"unsupported GGUF rope scaling '{scaling}': kvlab knows linear and yarn")
    # DeepSeek's YaRN (llama.cpp's deepseek2): yarn_log_multiplier = 0.1 · mscale_all_dim, the softmax scale's
    # correction (kvlab.model.mla); llama.cpp's cos/sin factor nets to 1 there (transformers: mscale = mscale_all_dim)
    log_mul = meta.get(f"{arch}.rope.scaling.yarn_log_multiplier")
    log_mul = log_mul if isinstance(log_mul, (int, float)) and not isinstance(log_mul, bool) and log_mul > 0 else None
    deepseek = arch == "deepseek2"
    return RopeConfig(
        theta=theta,
        type=scaling,
        factor=float(meta.get(f"{arch}.rope.scaling.factor", 1.0)),
        original_max_position_embeddings=meta.get(f"{arch}.rope.scaling.original_context_length"),
        attention_factor=1.0 if deepseek else None,
        mscale_all_dim=log_mul / 0.1 if deepseek and log_mul else None,
    )


# ---- a rope-scaling override from the command line or the API --------------------------------------

# the keys a config.json rope_scaling block may hold (transformers' names)
OVERRIDE_KEYS = ("rope_type", "type", "factor", "original_max_position_embeddings", "low_freq_factor",
                 "high_freq_factor", "beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim",
                 "truncate", "rope_theta")  # fmt: skip


def parse_rope_scaling(value: str | dict, source: str = "--rope-scaling") -> dict:
    """A rope_scaling block as `--rope-scaling JSON` or `LLM(rope_scaling=...)` gives it, checked: an
    object with a known rope_type, a factor of at least 1 (for any scaling type), only known keys."""
    import json

    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise KvlabError(f"{source}: not valid JSON ({e.msg} at column {e.colno}): give an object such as "
                             '\'{"rope_type": "yarn", "factor": 2.0}\'') from None  # fmt: skip
    if not isinstance(value, dict):
        raise KvlabError(f"{source}: must be a JSON object, not {type(value).__name__}")
    unknown = sorted(set(value) - set(OVERRIDE_KEYS))
    if unknown:
        raise KvlabError(f"{source}: unknown key '{unknown[0]}': use {', '.join(OVERRIDE_KEYS)}")
    rope_type = value.get("rope_type", value.get("type"))
    if rope_type not in ROPE_TYPES:
        raise KvlabError(f"{source}: unknown rope_type {rope_type!r}: kvlab knows {', '.join(ROPE_TYPES)}")
    for key in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "attention_factor",
                "mscale", "mscale_all_dim", "rope_theta"):  # fmt: skip
        number = value.get(key)
        if number is not None and (isinstance(number, bool) or not isinstance(number, (int, float)) or not number > 0):
            raise KvlabError(f"{source}: '{key}' must be a positive number, got {number!r}")
    factor = value.get("factor")
    if rope_type != "default" and (factor is None or factor < 1):
        raise KvlabError(f"{source}: rope_type {rope_type} needs a 'factor' of at least 1, got {factor!r}")
    original = value.get("original_max_position_embeddings")
    if original is not None and (isinstance(original, bool) or not isinstance(original, int) or original < 1):
        raise KvlabError(f"{source}: 'original_max_position_embeddings' must be a whole number above 0, "
                         f"got {original!r}")
    return {**value, "rope_type": rope_type}


def rope_override(rope: RopeConfig, scaling: str | dict, trained: int | None) -> tuple[RopeConfig, int | None]:
    """(the rotary settings `scaling` asks for, the context they stretch the model to).

    `rope`: the model's own settings (their base frequency is kept unless the block gives rope_theta);
    `trained`: its max_position_embeddings, the default original_max_position_embeddings. The context
    is original × factor (vLLM's rule for a rope_scaling override), never less than `trained`."""
    params = parse_rope_scaling(scaling)
    cfg = {"rope_theta": rope.theta, "rope_scaling": params, "max_position_embeddings": trained}
    scaled = rope_from_hf(cfg, "--rope-scaling")
    if scaled.type == "default" or trained is None:
        return scaled, trained
    original = scaled.original_max_position_embeddings or trained
    return scaled, max(trained, int(original * scaled.factor))
