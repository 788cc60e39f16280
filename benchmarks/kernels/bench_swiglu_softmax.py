"""SwiGLU on the fused gate/up output, and softmax over the vocabulary (and over short rows).

Bytes: silu_and_mul reads gate and up (2·T·I·2), writes T·I·2. softmax: one read and one write of the rows
(the ideal; the split long-row path actually reads the rows twice — the percentage shows that cost).
"""

from __future__ import annotations

import functools

import torch

from kernellab.kernels.softmax import softmax
from kernellab.kernels.swiglu import silu_and_mul
from kernellab.runtime import ops

from .harness import HIDDEN, INTER, PREFILL_T, VOCAB, Case, main_for, randn


def cases(device: str, real: bool) -> list[Case]:
    inter = INTER if real else 300
    vocab = VOCAB if real else 20000
    out = []
    for i, T in enumerate((PREFILL_T, 64) if real else (7,)):
        out.append(
            Case(
                "silu_and_mul",
                f"T={T},I={inter}",
                "bf16",
                lambda T=T: (randn(T, 2 * inter, device=device, scale=3.0),),
                silu_and_mul,
                ops.silu_and_mul,
                bytes=3 * T * inter * 2,
                atol=1.6e-2,
                rtol=1.6e-2,
                compile_ref=i == 0,
                group="swiglu",
            )
        )
    T = PREFILL_T if real else 7
    for block, warps in ((2048, 4), (2048, 8), (4096, 8), (512, 4)):
        out.append(
            Case(
                "silu_and_mul",
                f"T={T},I={inter}",
                "bf16",
                lambda T=T: (randn(T, 2 * inter, device=device, scale=3.0),),
                functools.partial(silu_and_mul, block_size=block, num_warps=warps),
                ops.silu_and_mul,
                bytes=3 * T * inter * 2,
                atol=1.6e-2,
                rtol=1.6e-2,
                variant=f"block{block}_warps{warps}",
                group="swiglu",
            )
        )
    B = 64 if real else 3
    out.append(
        Case(
            "softmax",
            f"B={B},V={vocab}",
            "fp32",
            lambda: (randn(B, vocab, device=device, dtype=torch.float32, scale=4.0),),
            softmax,
            ops.softmax,
            bytes=2 * B * vocab * 4,
            atol=1e-6,
            rtol=1e-4,
            group="softmax",
            notes="split path: rows read twice, bytes count one read",
        )
    )
    T = PREFILL_T if real else 5
    out.append(
        Case(
            "softmax",
            f"T={T},N={HIDDEN}",
            "bf16",
            lambda: (randn(T, HIDDEN, device=device, scale=4.0),),
            softmax,
            ops.softmax,
            bytes=2 * T * HIDDEN * 2,
            atol=1.6e-2,
            rtol=1.6e-2,
            compile_ref=False,
            group="softmax",
            notes="one load per row",
        )
    )
    return out


if __name__ == "__main__":
    main_for(cases)
