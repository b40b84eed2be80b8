"""Random GGUF blocks for the weight-format tests: raw random bytes with finite fp16 scales."""

from __future__ import annotations

import numpy as np

# byte offsets of each format's fp16 fields inside a block
FP16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(fmt: str, rows: int, in_features: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, row bytes] of random codes and scales of a realistic size (|d| ≤ 0.01)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    values, size = GGML_QUANT_SIZES[GGMLQuantizationType[fmt]]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * in_features // values, size), dtype=np.uint8)
    if fmt == "MXFP4":  # an E8M0 exponent first: scales 2^-14 .. 2^-4, like real weights
        blocks[:, 0] = rng.integers(113, 124, size=blocks.shape[0], dtype=np.uint8)
    for at in FP16_FIELDS.get(fmt, ()):
        d = (rng.standard_normal(blocks.shape[0]) * 0.01).astype(np.float16)
        blocks[:, at : at + 2] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def oracle(fmt: str, packed: np.ndarray, in_features: int) -> np.ndarray:
    """The gguf package's own dequantization: float32 [rows, in_features]."""
    from gguf import GGMLQuantizationType, quants

    return quants.dequantize(packed, GGMLQuantizationType[fmt]).reshape(packed.shape[0], in_features)
