"""RMSNorm and fused residual-add + RMSNorm under the interpreter."""

from __future__ import annotations

import pytest
import torch

from kernellab.kernels.rms_norm import add_rms_norm, rms_norm
from kernellab.runtime import ops
from tests.support.kernels import DTYPE_PARAMS, assert_close, poisoned

SHAPES = [(1, 64), (5, 123), (7, 1024), (3, 2, 200), (2, 5000)]


def _weight(H, dtype, gen):
    return (1 + 0.1 * torch.randn(H, generator=gen)).to(dtype)


@pytest.mark.parametrize("dtype, atol, rtol", DTYPE_PARAMS)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm(shape, dtype, atol, rtol, gen):
    x = torch.randn(shape, generator=gen).mul(2).to(dtype)
    w = _weight(shape[-1], dtype, gen)
    out = poisoned(shape, dtype, "cpu")
    assert_close(rms_norm(x, w, 1e-6, out=out), ops.rms_norm(x, w, 1e-6), atol, rtol, "rms_norm")


@pytest.mark.parametrize("dtype, atol, rtol", DTYPE_PARAMS)
@pytest.mark.parametrize("shape", SHAPES)
def test_add_rms_norm(shape, dtype, atol, rtol, gen):
    x = torch.randn(shape, generator=gen).to(dtype)
    res = torch.randn(shape, generator=gen).to(dtype)
    w = _weight(shape[-1], dtype, gen)
    out, res_out = poisoned(shape, dtype, "cpu"), poisoned(shape, dtype, "cpu")
    y, r = add_rms_norm(x, res, w, 1e-5, out=out, residual_out=res_out)
    y_ref, r_ref = ops.add_rms_norm(x, res, w, 1e-5)
    # One rounding of the same fp32 sum: bit exact, except that the interpreter truncates fp32 → bf16
    # instead of rounding to nearest (the GPU tests check bf16 bit for bit).
    exact = dtype != torch.bfloat16
    assert_close(r, r_ref, 0 if exact else atol, 0 if exact else rtol, "residual")
    assert_close(y, y_ref, atol, rtol, "normed")


@pytest.mark.parametrize("residual", [False, True])
def test_two_pass_long_row_path(residual, gen):
    """Force the chunked two-pass path at an odd width (rows wider than max_single_pass)."""
    x = torch.randn(3, 333, generator=gen).to(torch.bfloat16)
    w = _weight(333, torch.bfloat16, gen)
    if residual:
        res = torch.randn(3, 333, generator=gen).to(torch.bfloat16)
        y, r = add_rms_norm(
            x,
            res,
            w,
            1e-6,
            out=poisoned((3, 333), torch.bfloat16, "cpu"),
            residual_out=poisoned((3, 333), torch.bfloat16, "cpu"),
            max_single_pass=64,
        )
        y_ref, r_ref = ops.add_rms_norm(x, res, w, 1e-6)
        assert_close(r, r_ref, 1.6e-2, 1.6e-2, "residual")
    else:
        y = rms_norm(x, w, 1e-6, out=poisoned((3, 333), torch.bfloat16, "cpu"), max_single_pass=64)
        y_ref = ops.rms_norm(x, w, 1e-6)
    assert_close(y, y_ref, 1.6e-2, 1.6e-2, "normed")


def test_cast_order_rounds_before_the_weight(gen):
    """Qwen-exact order: x·rstd is rounded to the activation dtype before the weight multiply.

    fp16 here because the interpreter rounds fp32 → fp16 to nearest (numpy) but truncates fp32 → bf16; the
    GPU tests check bf16 bit for bit. Rounding only once would differ from the reference in ~1/3 of outputs.
    """
    x = torch.randn(16, 256, generator=gen).to(torch.float16)
    w = _weight(256, torch.float16, gen) * 3
    y = rms_norm(x, w, 1e-6)
    ref = ops.rms_norm(x, w, 1e-6)
    once = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()).half()
    assert (y != ref).float().mean() < 0.01
    assert (once != ref).float().mean() > 0.05


def test_fp32_weight_promotes_like_torch(gen):
    x = torch.randn(4, 96, generator=gen).to(torch.bfloat16)
    w = _weight(96, torch.float32, gen)
    y = rms_norm(x, w, 1e-6)
    assert y.dtype == torch.float32
    assert_close(y, ops.rms_norm(x, w, 1e-6), 1.6e-2, 1.6e-2, "promoted")  # bf16 intermediate


def test_in_place_residual(gen):
    x = torch.randn(5, 130, generator=gen)
    res = torch.randn(5, 130, generator=gen)
    w = _weight(130, torch.float32, gen)
    y_ref, r_ref = ops.add_rms_norm(x, res, w, 1e-6)
    y, r = add_rms_norm(x, res, w, 1e-6, residual_out=res)
    assert r.data_ptr() == res.data_ptr()
    assert_close(r, r_ref, 0, 0, "residual")
    assert_close(y, y_ref, 1e-5, 1e-5, "normed")
