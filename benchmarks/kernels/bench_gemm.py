"""Shape-bucketed GEMM at prefill (M = 4096 tokens) for the four Qwen3-0.6B projections, against cuBLAS.

FLOPs: 2·M·N·K; percentage of the bf16 matmul ceiling measured in the same run. A teaching kernel.
"""

from __future__ import annotations

from kernellab.kernels import gemm
from kernellab.runtime import ops

from .bench_gemv import shapes
from .harness import PREFILL_T, Case, main_for, randn


def cases(device: str, real: bool) -> list[Case]:
    out = []
    Ms = (PREFILL_T, 128) if real else (70,)
    for j, M in enumerate(Ms):
        for i, (name, (N, K)) in enumerate(shapes(real).items()):
            if j > 0 and name != "gate_up":
                continue
            out.append(
                Case(
                    "linear[gemm]",
                    f"{name} M={M} N={N} K={K}",
                    "bf16",
                    lambda M=M, N=N, K=K: (randn(M, K, device=device), randn(N, K, device=device, scale=K**-0.5)),
                    gemm.linear,
                    ops.linear,
                    flops=2 * M * N * K,
                    atol=3e-2,
                    rtol=2e-2,
                    teaching=True,
                    compile_ref=i == 0 and j == 0,
                    group="gemm",
                    notes="reference ops.linear = cuBLAS",
                )
            )
    return out


if __name__ == "__main__":
    main_for(cases)
