"""`--dtype auto`: the checkpoint's own dtype, except on a CPU that computes it slower than float32.

A 16-bit checkpoint keeps its dtype on a GPU. On a CPU, 16-bit matrix products are fast only with
matrix units for that type (Intel AMX: bfloat16 since Sapphire Rapids, float16 only with AMX-FP16);
elsewhere PyTorch converts or emulates (the blog post `kvlab lab dtype` reproduces measured a 500-token
prefill of Qwen2.5-0.5B 11× slower in bfloat16 than in float32), so those run in float32. Quantized
blocks (a GGUF file's Q4_K, ...) say nothing about the activations: float32 on a CPU (what the block
kernels take), bfloat16 on a GPU that has it.
"""

from __future__ import annotations

import torch

from kvlab.config import ModelConfig
from kvlab.config.dtypes import canonical_dtype

FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def checkpoint_dtype(config: ModelConfig) -> str | None:
    """The float dtype most of the checkpoint's bytes are stored in; None when they are quantized blocks."""
    weights = config.file_weights
    stored = canonical_dtype(weights.bytes_by_type[0][0]) if weights and weights.bytes_by_type else config.dtype
    return stored if stored in FLOAT_DTYPES else None


def cpu_has_fast(dtype: str) -> bool:
    """Whether this CPU multiplies `dtype` matrices with its own matrix units (faster than float32)."""
    probe = {"bfloat16": "_is_amx_tile_supported", "float16": "_is_amx_fp16_supported"}.get(dtype)
    check = getattr(torch.cpu, probe, None) if probe else None  # private probes: absent in some builds
    try:
        return bool(check and check())
    except RuntimeError:
        return False


def auto_dtype(config: ModelConfig, device: torch.device) -> str:
    """The dtype `--dtype auto` chooses for this checkpoint on this device (a name from FLOAT_DTYPES)."""
    stored = checkpoint_dtype(config)
    if device.type == "cpu":
        return stored if stored in ("bfloat16", "float16") and cpu_has_fast(stored) else "float32"
    if stored is not None:
        return stored
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return "float16"
    return "bfloat16"
