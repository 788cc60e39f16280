"""``linear`` dispatcher: the decode GEMV where it beat cuBLAS on the H200, cuBLAS (``ops.linear``) elsewhere.

Measured at Qwen3-0.6B shapes on the H200 (docs/kernels.md): at M = 1 the GEMV (launched with PDL) beats
cuBLAS on all four projections (1.2–5.6×); at M = 8 and 16 its tensor-core path wins for down_proj but loses
for gate_up, so only M = 1 is dispatched by default (``GEMV_MAX_ROWS``); ``gemv.linear`` serves M ≤ 16.

Everything else goes to cuBLAS. The Triton GEMM (``gemm.py``) is not dispatched: on the H200 it lost to cuBLAS at
every Qwen3-0.6B projection and M measured (0.50–0.69×, docs/kernels.md), so it is a standalone teaching kernel
(tests and ``benchmarks/kernels/bench_gemm.py`` call ``gemm.linear``); route a bucket to it here only once a
benchmark records a win. The choice depends on the shape only, so it is the same under CUDA-graph capture.
"""

from __future__ import annotations

import torch

from kernellab.runtime import ops

from . import gemv

__all__ = ["GEMV_MAX_ROWS", "linear"]

GEMV_MAX_ROWS = 1


def linear(x: torch.Tensor, weight: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T`` with the fastest measured implementation for this M."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if 0 < rows <= GEMV_MAX_ROWS and weight.dtype == x.dtype:
        return gemv.linear(x, weight, out=out)
    y = ops.linear(x, weight)
    if out is not None:
        out.copy_(y)
        return out
    return y
