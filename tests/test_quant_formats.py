"""The reference dequantization of every GGUF block format against the gguf package's, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvlab.quant.formats import FORMATS
from quant_blocks import oracle, random_blocks


@pytest.mark.parametrize("fmt", sorted(f for f in FORMATS if not FORMATS[f].is_plain))
@pytest.mark.parametrize("shape", [(3, 256), (16, 512), (5, 1024)])
def test_reference_dequantization_is_the_gguf_packages(fmt, shape):
    rows, cols = shape
    packed = random_blocks(fmt, rows, cols, seed=rows)
    expected = oracle(fmt, packed, cols)
    got = FORMATS[fmt].dequantize(torch.from_numpy(packed), cols)
    assert got.dtype == torch.float32 and got.shape == shape
    assert np.array_equal(got.numpy(), expected), (fmt, np.abs(got.numpy() - expected).max())


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0", "Q4_1", "Q5_0"])
def test_quantized_by_gguf_then_dequantized_is_close_to_the_weights(fmt):
    from gguf import GGMLQuantizationType, quants

    w = np.random.default_rng(1).standard_normal((8, 256)).astype(np.float32)
    packed = quants.quantize(w, GGMLQuantizationType[fmt])
    got = FORMATS[fmt].dequantize(torch.from_numpy(packed), 256).numpy()
    assert np.array_equal(got, oracle(fmt, packed, 256))
    assert np.abs(got - w).max() < {"Q8_0": 0.03, "Q4_0": 0.5, "Q4_1": 0.5, "Q5_0": 0.25}[fmt]


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0"])
def test_our_quantizers_write_the_gguf_packages_bytes(fmt):
    from gguf import GGMLQuantizationType, quants

    from kvlab.quant.quantize import quantize

    w = np.random.default_rng(2).standard_normal((12, 320)).astype(np.float32)
    w[3, :32] = 0  # an all-zero block: d = 0, no division by zero
    w[5, 7] = 40.0  # an outlier dominates its block
    ours = quantize(torch.from_numpy(w), fmt.lower()).numpy()
    assert np.array_equal(ours, quants.quantize(w, GGMLQuantizationType[fmt]))


def test_plain_matrices_are_formats_too():
    w = torch.randn(4, 6)
    for fmt, dtype in (("F32", torch.float32), ("F16", torch.float16), ("BF16", torch.bfloat16)):
        stored = w.to(dtype)
        packed = stored.view(torch.uint8).reshape(4, -1)
        assert torch.equal(FORMATS[fmt].dequantize(packed, 6), stored.float())
