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
    )


def rope_from_gguf(meta: dict[str, Any], arch: str) -> RopeConfig:
    """The rotary settings of a GGUF file's metadata."""
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
