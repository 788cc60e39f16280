"""Vector add / add + SiLU: the real residual shape, and a block × warp sweep on a large vector.

Bytes: read a, b; write out → ``3·n·2`` (bf16). The eager reference of ``add_silu`` is two kernels (5·n·2).
"""

from __future__ import annotations

import functools

import torch

from kernellab.kernels.vector_add import add, add_silu
from kernellab.runtime import ops

from .harness import HIDDEN, PREFILL_T, Case, main_for, randn

SWEEP = [(256, 1), (256, 4), (1024, 8), (4096, 4), (4096, 8), (8192, 8)]


def cases(device: str, real: bool) -> list[Case]:
    n = PREFILL_T * HIDDEN if real else 3001
    big = 2**26 if real else 5003

    def pair(size):
        return lambda: (randn(size, device=device), randn(size, device=device))

    out = [
        Case(
            "add",
            f"n={PREFILL_T}x{HIDDEN}",
            "bf16",
            pair(n),
            add,
            torch.add,
            bytes=3 * n * 2,
            atol=0,
            rtol=0,
            group="vector_add",
            teaching=True,
            notes="reference torch.add (the same single pass)",
        ),
        Case(
            "add_silu",
            f"n={PREFILL_T}x{HIDDEN}",
            "bf16",
            pair(n),
            add_silu,
            ops.add_silu,
            bytes=3 * n * 2,
            atol=1.6e-2,
            rtol=1.6e-2,
            group="vector_add",
            notes="eager reference: add then silu (2 kernels)",
        ),
        Case(
            "add",
            "n=2^26",
            "bf16",
            pair(big),
            add,
            torch.add,
            bytes=3 * big * 2,
            atol=0,
            rtol=0,
            group="vector_add",
            teaching=True,
            compile_ref=False,
        ),
    ]
    for block, warps in SWEEP:
        fn = functools.partial(add, block_size=block, num_warps=warps)
        out.append(
            Case(
                "add",
                "n=2^26",
                "bf16",
                pair(big),
                fn,
                torch.add,
                bytes=3 * big * 2,
                atol=0,
                rtol=0,
                variant=f"block{block}_warps{warps}",
                group="vector_add",
            )
        )
    return out


if __name__ == "__main__":
    main_for(cases)
