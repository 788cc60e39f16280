"""Softmax (one-load rows and the split long-row path), argmax and top-k over a vocabulary."""

from __future__ import annotations

import pytest
import torch

from kernellab.kernels.argmax import argmax, topk
from kernellab.kernels.softmax import softmax
from kernellab.runtime import ops
from tests.support.kernels import DTYPE_PARAMS, assert_close, poisoned


@pytest.mark.parametrize("dtype, atol, rtol", DTYPE_PARAMS)
@pytest.mark.parametrize("shape", [(1, 1), (4, 100), (3, 5000), (2, 3, 17)])
def test_softmax_rows(shape, dtype, atol, rtol, gen):
    x = torch.randn(shape, generator=gen).mul(4).to(dtype)
    out = poisoned(shape, dtype, "cpu")
    assert_close(softmax(x, out=out), ops.softmax(x), atol, rtol, "softmax")


@pytest.mark.parametrize("dtype, atol, rtol", DTYPE_PARAMS)
def test_softmax_split_long_rows(dtype, atol, rtol, gen):
    x = torch.randn(3, 3001, generator=gen).mul(4).to(dtype)
    out = poisoned(x.shape, dtype, "cpu")
    assert_close(softmax(x, out=out, max_single=1024, chunk=512), ops.softmax(x), atol, rtol, "softmax")


@pytest.mark.parametrize("max_single", [16384, 256])
def test_softmax_masked_entries(max_single, gen):
    """-inf logits (masked vocabulary) get probability exactly 0, the rest still sums to 1."""
    x = torch.randn(2, 700, generator=gen)
    x[:, ::3] = float("-inf")
    y = softmax(x, max_single=max_single, chunk=128)
    assert_close(y, ops.softmax(x), 1e-6, 1e-5, "softmax")
    assert (y[:, ::3] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B, V, chunk", [(1, 10, 8192), (3, 1000, 256), (2, 4099, 1024)])
def test_argmax(B, V, chunk, dtype, gen):
    x = torch.randn(B, V, generator=gen).to(dtype)
    out = poisoned(B, torch.int64, "cpu")
    assert torch.equal(argmax(x, out=out, chunk=chunk), ops.argmax(x))
    ref_out = poisoned(B, torch.int64, "cpu")  # the reference writes into a given buffer too (a window's row)
    assert ops.argmax(x, out=ref_out) is ref_out and torch.equal(ref_out, out)


def test_argmax_ties_take_the_lowest_index():
    x = torch.zeros(3, 1000)
    x[0, [700, 300, 900]] = 5.0  # ties across chunks
    x[1, [10, 11]] = 1.0  # ties within a chunk
    out = argmax(x, chunk=256)
    assert out.tolist() == [300, 10, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B, V, k, chunk", [(1, 50, 1, 4096), (2, 1000, 5, 256), (2, 1501, 17, 256)])
def test_topk(B, V, k, chunk, dtype, gen):
    x = torch.randn(B, V, generator=gen).to(dtype)
    vals, idx = poisoned((B, k), dtype, "cpu"), poisoned((B, k), torch.int64, "cpu")
    vals, idx = topk(x, k, values=vals, indices=idx, chunk=chunk)
    ref_vals, _ = torch.topk(x, k, dim=-1)
    assert torch.equal(vals, ref_vals)  # descending, bit exact
    assert torch.equal(torch.gather(x, 1, idx), vals)  # the indices point at those values
    assert all(len(set(row)) == k for row in idx.tolist())


def test_topk_ties_take_lower_indices():
    x = torch.zeros(1, 600)
    x[0, [500, 20, 300]] = 2.0
    vals, idx = topk(x, 4, chunk=128)
    assert idx.tolist() == [[20, 300, 500, 0]]
    assert vals.tolist() == [[2.0, 2.0, 2.0, 0.0]]


def test_topk_rejects_large_k():
    with pytest.raises(ValueError):
        topk(torch.zeros(1, 1000), 300)
