"""RMSNorm and fused residual-add + RMSNorm at Qwen3-0.6B's hidden size.

Bytes: rms_norm reads x (T·H·2) and the weight (H·2), writes y (T·H·2); add_rms_norm reads x and the
residual, writes y and the new residual (4·T·H·2 + H·2). Target: ≥ 70 % of the read bandwidth at T = 4096.
"""

from __future__ import annotations

import functools

from kernellab.kernels.rms_norm import add_rms_norm, rms_norm
from kernellab.runtime import ops

from .harness import EPS, HIDDEN, PREFILL_T, Case, main_for, randn

SWEEP = [(1, 4), (2, 2), (2, 8), (4, 4), (4, 8)]  # (rows per program, warps); default is (2, 4)


def cases(device: str, real: bool) -> list[Case]:
    H = HIDDEN if real else 200
    rows = (PREFILL_T, 64) if real else (37, 1)

    def norm_args(T):
        return lambda: (randn(T, H, device=device, scale=2.0), 1 + randn(H, device=device, scale=0.1), EPS)

    def add_args(T):
        return lambda: (
            randn(T, H, device=device),
            randn(T, H, device=device),
            1 + randn(H, device=device, scale=0.1),
            EPS,
        )

    out = []
    for i, T in enumerate(rows):
        target = 70.0 if i == 0 else None
        out.append(
            Case(
                "rms_norm",
                f"T={T},H={H}",
                "bf16",
                norm_args(T),
                rms_norm,
                ops.rms_norm,
                bytes=2 * T * H * 2 + H * 2,
                target_pct=target,
                compile_ref=i == 0,
                group="rms_norm",
            )
        )
        out.append(
            Case(
                "add_rms_norm",
                f"T={T},H={H}",
                "bf16",
                add_args(T),
                add_rms_norm,
                ops.add_rms_norm,
                bytes=4 * T * H * 2 + H * 2,
                target_pct=target,
                compile_ref=i == 0,
                group="rms_norm",
            )
        )
    T = rows[0]
    for r, w in SWEEP:
        out.append(
            Case(
                "rms_norm",
                f"T={T},H={H}",
                "bf16",
                norm_args(T),
                functools.partial(rms_norm, rows_per_program=r, num_warps=w),
                ops.rms_norm,
                bytes=2 * T * H * 2 + H * 2,
                variant=f"rows{r}_warps{w}",
                group="rms_norm",
            )
        )
    for r, w in SWEEP[1:4]:
        out.append(
            Case(
                "add_rms_norm",
                f"T={T},H={H}",
                "bf16",
                add_args(T),
                functools.partial(add_rms_norm, rows_per_program=r, num_warps=w),
                ops.add_rms_norm,
                bytes=4 * T * H * 2 + H * 2,
                variant=f"rows{r}_warps{w}",
                group="rms_norm",
            )
        )
    return out


if __name__ == "__main__":
    main_for(cases)
