"""Vector add, add + SiLU and SwiGLU under the interpreter: odd sizes, one element, block/warp variants."""

from __future__ import annotations

import pytest
import torch

from kernellab.kernels.swiglu import silu_and_mul
from kernellab.kernels.vector_add import add, add_silu
from kernellab.runtime import ops
from tests.support.kernels import DTYPE_PARAMS, assert_close, poisoned


@pytest.mark.parametrize("dtype, atol, rtol", DTYPE_PARAMS)
@pytest.mark.parametrize("shape", [(1,), (1000,), (3, 333), (4097,)])
def test_add_and_add_silu(shape, dtype, atol, rtol, gen):
    a = torch.randn(shape, generator=gen).to(dtype)
    b = torch.randn(shape, generator=gen).to(dtype)
    out = poisoned(shape, dtype, "cpu")
    assert_close(add(a, b, out=out), torch.add(a, b), atol, rtol, "add")
    out = poisoned(shape, dtype, "cpu")
    assert_close(add_silu(a, b, out=out), ops.add_silu(a, b), atol, rtol, "add_silu")


@pytest.mark.parametrize("block_size, num_warps", [(128, 1), (256, 2), (4096, 8)])
def test_add_block_sweep_masks(block_size, num_warps, gen):
    n = 3 * block_size + 5  # a partial last block whatever the block size
    a, b = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    out = poisoned(n, torch.float32, "cpu")
    assert_close(
        add_silu(a, b, out=out, block_size=block_size, num_warps=num_warps), ops.add_silu(a, b), 1e-5, 1e-5, "add_silu"
    )


def test_add_rejects_mismatched_shapes():
    with pytest.raises(ValueError):
        add(torch.zeros(3), torch.zeros(4))


@pytest.mark.parametrize("dtype, atol, rtol", DTYPE_PARAMS)
@pytest.mark.parametrize("shape", [(1, 6), (5, 154), (3, 3000), (2, 2, 18)])
def test_silu_and_mul(shape, dtype, atol, rtol, gen):
    x = torch.randn(shape, generator=gen).mul(3).to(dtype)
    out = poisoned((*shape[:-1], shape[-1] // 2), dtype, "cpu")
    assert_close(silu_and_mul(x, out=out), ops.silu_and_mul(x), atol, rtol, "silu_and_mul")


def test_silu_and_mul_strided_rows(gen):
    base = torch.randn(4, 300, generator=gen).to(torch.bfloat16)
    x = base[:, :200]  # a row stride larger than the row
    assert_close(silu_and_mul(x), ops.silu_and_mul(x), 1.6e-2, 1.6e-2, "silu_and_mul")
