"""MXFP4 blocks (gpt-oss's experts): the reference dequantization and mxfp4.c's against the gguf package's,
bit for bit, and the C product at 1-32 rows against float32 math on the dequantized matrix."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvlab.kernels import mxfp4
from kvlab.quant.formats import FORMATS
from kvlab.quant.linear import PackedTensor
from quant_blocks import oracle, random_blocks

pytestmark = pytest.mark.skipif(not mxfp4.available(), reason="the C kernels are not built here")


def part(rows: int, cols: int, seed: int = 0) -> PackedTensor:
    return PackedTensor("MXFP4", (rows, cols), torch.from_numpy(random_blocks("MXFP4", rows, cols, seed=seed)))


@pytest.mark.parametrize("shape", [(3, 32), (13, 96), (67, 2880)])
def test_the_c_dequantization_is_the_references_and_the_gguf_packages(shape):
    p = part(*shape)
    expected = oracle("MXFP4", p.data.numpy(), shape[1])
    assert np.array_equal(FORMATS["MXFP4"].dequantize(p.data, shape[1]).numpy(), expected)
    assert np.array_equal(mxfp4.dequantize(p).numpy(), expected)


def test_every_exponent_and_code_decodes_as_ggml_does():
    blocks = np.zeros((256, 17), dtype=np.uint8)
    blocks[:, 0] = np.arange(256)  # every E8M0 exponent, subnormal halves (e < 2) included
    blocks[:, 1:] = np.arange(16, dtype=np.uint8)[None, :] * 17  # every code, low and high nibble
    p = PackedTensor("MXFP4", (256, 32), torch.from_numpy(blocks))
    with np.errstate(over="ignore"):  # e = 255 with code 12 is past float32's range: inf, in both
        expected = oracle("MXFP4", blocks, 32)
    assert np.array_equal(mxfp4.dequantize(p).numpy(), expected, equal_nan=True)
    assert np.array_equal(p.dequantize().numpy(), expected, equal_nan=True)


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 16, 17, 32])  # issue 30's counts: 17 is past a 16-row tile
def test_the_product_reads_the_blocks_once_for_every_row(rows):
    p = part(70, 2880, seed=rows)  # gpt-oss's hidden size; 70 outputs: not a multiple of a work item's 4
    x = torch.randn(rows, 2880, generator=torch.Generator().manual_seed(rows))
    expected = x.double() @ p.dequantize().double().T
    got = mxfp4.matmul(x, p)
    assert got.shape == (rows, 70)
    assert torch.allclose(got.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    assert torch.equal(mxfp4.matmul(x, p, threads=1), mxfp4.matmul(x, p, threads=2))  # thread-count invariant
    assert torch.equal(mxfp4.matmul(x[:1], p), got[:1])  # a row's result does not depend on the others


def test_a_shape_the_kernel_does_not_take_is_refused():
    with pytest.raises(ValueError):
        mxfp4.matmul(torch.randn(2, 40), PackedTensor("MXFP4", (4, 40), torch.zeros(4, 17, dtype=torch.uint8)))
