"""RMSNorm with an fp32 reduction and Qwen-exact cast order, and the fused residual-add + RMSNorm.

Formula
    ``rms_norm(x, w, eps) = w · (x / sqrt(mean(x², -1) + eps))`` for ``x: (..., H)``, ``w: (H,)``
    (reference ``kernellab.runtime.ops.rms_norm``); ``add_rms_norm(x, residual, w, eps)`` first forms
    ``r = x + residual`` in the input dtype and returns ``(rms_norm(r), r)`` (reference ``ops.add_rms_norm``).

Program mapping
    The input is viewed as ``R`` rows of ``H``. Each program owns ``ROWS`` consecutive rows as one
    ``[ROWS, BLOCK_H]`` tile (``BLOCK_H = next_pow2(H)``, lanes past ``H`` masked), so the whole row is read
    once, squared and summed across the threads of the program (``tl.sum(axis=1)`` = warp shuffles + a small
    shared-memory exchange between warps), then scaled and written from the same registers: one read, one
    write per element. Short rows (the per-head QK-norm, H = 128) pack several rows per program so a program
    still moves a few KB; long rows (H > 8192) switch to a two-pass loop over ``BLOCK_H`` chunks (the second
    pass re-reads the row, mostly from L2) instead of holding it in registers.

Coalescing
    Rows are contiguous (unit stride on the last dim, any row stride); each thread holds 16-byte runs along H,
    so a warp reads whole 128-byte lines. Bytes: read ``R·H`` (+ ``R·H`` residual) + ``H`` weight, write
    ``R·H`` (+ ``R·H`` residual out).

Precision (the order HF's Qwen3/Llama use)
    1. the residual sum is rounded to the input dtype (that rounded ``r`` is what is normalised and returned);
    2. ``x`` is upcast to fp32; ``mean(x²)`` is reduced in fp32; ``rsqrt(var + eps)`` in fp32;
    3. ``x·rstd`` is rounded to the input dtype **before** the weight multiply;
    4. that value times the weight is formed in fp32 and rounded to ``promote(x.dtype, w.dtype)``.
    Skipping step 3 (multiplying in fp32 and rounding once) is more accurate but not what the model was
    trained with; it changes about a third of bf16 outputs by one ulp. On the H200 the outputs equal the
    eager reference bit for bit except ~0.02 % of elements (one ulp, rarely two), where the fp32 sum of
    squares, reduced in another order than torch's, differs in its last bit and flips a rounding.

Trade-offs tried
    Rows per program × warps at H = 1024, 4,096 rows on the H200 (sweep in
    ``benchmarks/kernels/bench_rms_norm.py``): 1 row / 4 warps (8 elements per thread) 6.0 µs, 1 row / 8 warps
    6.4 µs, 2 rows / 8 warps 6.1 µs, 4 rows / 8 warps 6.2 µs, **2 rows / 4 warps (16 elements, two 16-byte
    loads per thread) 5.3 µs** — now the default: enough bytes in flight per thread without starving the
    grid (2,048 programs, one wave). A persistent grid saves program launches but not bytes; at one wave it
    has nothing to win. At 5.34 µs (3.14 TB/s) the kernel sits at the launch floor plus the bytes at copy
    speed (64 rows take 1.65 µs; 16.8 MB at the 4.26 TB/s copy ceiling take 3.9 µs). The in-place residual update (``residual_out=residual``) is safe:
    each element is read before it is written by the same program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ._common import cdiv, next_pow2, require, rows_2d, use_pdl

__all__ = ["add_rms_norm", "rms_norm"]

_MAX_SINGLE_PASS = 8192  # widest row held in registers at once


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    n_rows,
    H,
    stride_x,
    stride_res,
    stride_out,
    stride_res_out,
    eps,
    BLOCK_H: tl.constexpr,
    ROWS: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
    SINGLE_PASS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:  # see _common.use_pdl
        gdc_launch_dependents()
        gdc_wait()
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < n_rows
    rows = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    act_ty = x_ptr.dtype.element_ty
    out_ty = out_ptr.dtype.element_ty
    if SINGLE_PASS:
        col_mask = cols < H
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        if ADD_RESIDUAL:
            r = tl.load(res_ptr + rows[:, None] * stride_res + cols[None, :], mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(act_ty)
            tl.store(res_out_ptr + rows[:, None] * stride_res_out + cols[None, :], x, mask=mask)
        xf = x.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=1) / H + eps)
        normed = (xf * rstd[:, None]).to(act_ty)
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0)
        y = normed.to(tl.float32) * w.to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], y.to(out_ty), mask=mask)
    else:
        acc = tl.zeros([ROWS, BLOCK_H], dtype=tl.float32)
        for start in range(0, H, BLOCK_H):
            c = start + cols
            mask = row_mask[:, None] & (c < H)[None, :]
            x = tl.load(x_ptr + rows[:, None] * stride_x + c[None, :], mask=mask, other=0.0)
            if ADD_RESIDUAL:
                r = tl.load(res_ptr + rows[:, None] * stride_res + c[None, :], mask=mask, other=0.0)
                x = (x.to(tl.float32) + r.to(tl.float32)).to(act_ty)
                tl.store(res_out_ptr + rows[:, None] * stride_res_out + c[None, :], x, mask=mask)
            xf = x.to(tl.float32)
            acc += xf * xf
        rstd = tl.math.rsqrt(tl.sum(acc, axis=1) / H + eps)
        if ADD_RESIDUAL:
            tl.debug_barrier()  # the second pass re-reads r written above, possibly by other threads
            src_ptr = res_out_ptr
            stride_src = stride_res_out
        else:
            src_ptr = x_ptr
            stride_src = stride_x
        for start in range(0, H, BLOCK_H):
            c = start + cols
            col_mask = c < H
            mask = row_mask[:, None] & col_mask[None, :]
            x = tl.load(src_ptr + rows[:, None] * stride_src + c[None, :], mask=mask, other=0.0)
            normed = (x.to(tl.float32) * rstd[:, None]).to(act_ty)
            w = tl.load(w_ptr + c, mask=col_mask, other=0.0)
            y = normed.to(tl.float32) * w.to(tl.float32)[None, :]
            tl.store(out_ptr + rows[:, None] * stride_out + c[None, :], y.to(out_ty), mask=mask)


def _config(H: int, n_rows: int, rows_per_program, num_warps, max_single_pass):
    single = next_pow2(H) <= max_single_pass
    block_h = next_pow2(H) if single else min(4096, next_pow2(max_single_pass) // 2 or 1)
    if rows_per_program is None:
        # ~2K elements (4 KB bf16) per program: two rows at H = 1024, sixteen per-head rows at H = 128.
        rows_per_program = max(1, min(16, 2048 // block_h))
    if num_warps is None:  # 16 elements (two 16-byte loads) per thread
        num_warps = max(1, min(8, rows_per_program * block_h // 512))
    return single, block_h, rows_per_program, num_warps


def _launch(x, residual, weight, eps, out, residual_out, rows_per_program, num_warps, max_single_pass):
    H = x.shape[-1]
    require(weight.shape == (H,), f"weight must be ({H},), got {tuple(weight.shape)}")
    x2 = rows_2d(x)
    n_rows = x2.shape[0]
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    if out is None:
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    require(out.dtype == out_dtype and out.shape == x.shape, "out has the wrong shape or dtype")
    out2 = out.view(-1, H)
    weight = weight if weight.is_contiguous() else weight.contiguous()
    if residual is not None:
        require(residual.shape == x.shape and residual.dtype == x.dtype, "residual must match x")
        res2 = rows_2d(residual)
        if residual_out is None:
            residual_out = torch.empty_like(x)
        require(residual_out.shape == x.shape and residual_out.dtype == x.dtype, "residual_out must match x")
        res_out2 = residual_out.view(-1, H)
    else:
        res2 = res_out2 = x2  # unused (ADD_RESIDUAL=False)
    single, block_h, rows, warps = _config(H, n_rows, rows_per_program, num_warps, max_single_pass)
    if n_rows:
        pdl = use_pdl(x2)
        _rms_norm_kernel[(cdiv(n_rows, rows),)](
            x2,
            res2,
            weight,
            out2,
            res_out2,
            n_rows,
            H,
            x2.stride(0),
            res2.stride(0),
            out2.stride(0),
            res_out2.stride(0),
            eps,
            BLOCK_H=block_h,
            ROWS=rows,
            ADD_RESIDUAL=residual is not None,
            SINGLE_PASS=single,
            PDL=pdl,
            num_warps=warps,
            launch_pdl=pdl,
        )
    return out, residual_out


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor | None = None,
    rows_per_program: int | None = None,
    num_warps: int | None = None,
    max_single_pass: int = _MAX_SINGLE_PASS,
) -> torch.Tensor:
    """``weight · (x / sqrt(mean(x², -1) + eps))`` over the last dim of ``x: (..., H)``; ``weight: (H,)``."""
    return _launch(x, None, weight, eps, out, None, rows_per_program, num_warps, max_single_pass)[0]


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    rows_per_program: int | None = None,
    num_warps: int | None = None,
    max_single_pass: int = _MAX_SINGLE_PASS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``r = x + residual``; returns ``(rms_norm(r, weight, eps), r)``. ``residual_out=residual`` is in place."""
    return _launch(x, residual, weight, eps, out, residual_out, rows_per_program, num_warps, max_single_pass)
