"""``linear`` dispatcher: the decode GEMV where it beat cuBLAS on the H200, cuBLAS (``ops.linear``) elsewhere.

Measured at Qwen3-0.6B shapes on the H200 (docs/kernels.md): at M = 1 the GEMV (launched with PDL) beats
cuBLAS on all four projections (1.2–5.6×); at M = 8 and 16 its tensor-core path wins for down_proj but loses
for gate_up, so only M = 1 is dispatched by default (``GEMV_MAX_ROWS``); ``gemv.linear`` serves M ≤ 16.

The Triton GEMM (``gemm.py``) is used only for the M buckets listed in ``GEMM_BUCKETS``, i.e. where the H200
benchmark measured it faster than cuBLAS at Qwen3-0.6B shapes (see docs/kernels.md); the set is empty until
such a win is recorded. The choice depends on the shape only, so it is the same under CUDA-graph capture.
"""

from __future__ import annotations

import torch

from kernellab.runtime import ops

from . import gemm, gemv

__all__ = ["GEMM_BUCKETS", "GEMV_MAX_ROWS", "linear"]

GEMM_BUCKETS: frozenset[int] = frozenset()  # upper M bound of each bucket where Triton beat cuBLAS: none
GEMV_MAX_ROWS = 1


def linear(x: torch.Tensor, weight: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T`` with the fastest measured implementation for this M."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if 0 < rows <= GEMV_MAX_ROWS and weight.dtype == x.dtype:
        return gemv.linear(x, weight, out=out)
    bucket = 64 if rows <= 64 else 512 if rows <= 512 else 1 << 62
    if bucket in GEMM_BUCKETS:
        return gemm.linear(x, weight, out=out)
    y = ops.linear(x, weight)
    if out is not None:
        out.copy_(y)
        return out
    return y
