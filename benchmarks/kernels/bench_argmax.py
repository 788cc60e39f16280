"""Argmax and top-k over Qwen3's vocabulary (fp32 logits of the LM head).

Bytes: read the logits once (B·V·4); write B int64 (argmax) or B·k values + indices (top-k).
"""

from __future__ import annotations

import torch

from kernellab.kernels.argmax import argmax, topk
from kernellab.runtime import ops

from .harness import VOCAB, Case, main_for, randn

TOP_K = 50


def _check_topk(args):
    vals, idx = topk(*args)
    ref, _ = torch.topk(*args, dim=-1)
    ok = torch.equal(vals, ref) and torch.equal(torch.gather(args[0], 1, idx), vals)
    return bool(ok), float((vals - ref).abs().max())


def cases(device: str, real: bool) -> list[Case]:
    V = VOCAB if real else 1500
    out = []
    for i, B in enumerate((64, 1) if real else (3,)):
        out.append(
            Case(
                "argmax",
                f"B={B},V={V}",
                "fp32",
                lambda B=B: (randn(B, V, device=device, dtype=torch.float32),),
                argmax,
                ops.argmax,
                bytes=B * V * 4 + B * 8,
                compile_ref=i == 0,
                group="argmax",
            )
        )
    B = 64 if real else 3
    out.append(
        Case(
            "topk",
            f"B={B},V={V},k={TOP_K}",
            "fp32",
            lambda: (randn(B, V, device=device, dtype=torch.float32), TOP_K),
            topk,
            lambda x, k: torch.topk(x, k, dim=-1),
            bytes=B * V * 4 + B * TOP_K * 12,
            check=_check_topk,
            group="argmax",
            teaching=True,
            notes="reference torch.topk (radix select)",
        )
    )
    return out


if __name__ == "__main__":
    main_for(cases)
