"""Decode GEMV (dense bf16, W8A16, W4A16) at Qwen3-0.6B's projection shapes, with a config sweep.

Bytes: read the weight (N·K·bytes_per_weight) + scales (4·N, quantized) + x (M·K·2), write y (M·N·2).
Target: ≥ 70 % of the read bandwidth for q/k/v, o, gate/up and down at M = 1. The quantized kernels are timed
against the dense bf16 cuBLAS GEMV they would replace (their eager reference), and checked against
``ops.linear`` on the dequantized weight.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from kernellab.kernels import gemv, quant_gemv
from kernellab.kernels._common import next_pow2
from kernellab.kernels.gemv import GemvConfig, default_config
from kernellab.runtime import ops

from .harness import HEAD_DIM, HIDDEN, HK, HQ, INTER, VOCAB, Case, main_for, randn


def shapes(real: bool) -> dict[str, tuple[int, int]]:
    """name → (N, K) of ``weight: (N, K)``."""
    if not real:
        return {"qkv": (96, 64), "down": (40, 200)}
    return {
        "qkv": ((HQ + 2 * HK) * HEAD_DIM, HIDDEN),
        "o": (HIDDEN, HQ * HEAD_DIM),
        "gate_up": (2 * INTER, HIDDEN),
        "down": (HIDDEN, INTER),
    }


def _sweep(N, K, device) -> list[tuple[str, GemvConfig]]:
    """The default without PDL, narrower/wider row blocks, split-K, and the first version's K-looping tiles."""
    base = default_config(1, N, K, 16, device)
    out = [("no_pdl", dataclasses.replace(base, pdl=False))]
    if base.block_n > 1:
        half = base.block_n // 2
        out.append(
            (
                f"n{half}_k{min(2 * base.block_k, next_pow2(K))}",
                dataclasses.replace(base, block_n=half, block_k=min(2 * base.block_k, next_pow2(K))),
            )
        )
    out.append((f"split2_n{base.block_n}", dataclasses.replace(base, split_k=2, block_k=max(32, base.block_k // 2))))
    out.append(("loop_n8_k512_w4", GemvConfig(8, 512, 1, 4)))  # run 1's best for q/k/v
    out.append(("loop_n16_k512_w4", GemvConfig(16, 512, 1, 4)))
    return out


def _quant_check(bits):
    def check(args):
        x, qw, scales = args
        fn = quant_gemv.linear_w8a16 if bits == 8 else quant_gemv.linear_w4a16
        y = fn(x, qw, scales)
        deq = quant_gemv.QuantizedWeight(qw, scales, bits, x.shape[1])
        ref = ops.linear(x.float(), quant_gemv.dequantize_weight(deq)).to(x.dtype)
        err = float((y.double() - ref.double()).abs().max())
        return bool(torch.allclose(y.float(), ref.float(), atol=2e-2, rtol=2e-2)), err

    return check


def cases(device: str, real: bool) -> list[Case]:
    dev = torch.device(device)
    out = []
    table = shapes(real)
    for i, (name, (N, K)) in enumerate(table.items()):

        def make(M=1, N=N, K=K):
            return randn(M, K, device=device), randn(N, K, device=device, scale=K**-0.5)

        out.append(
            Case(
                "linear[gemv]",
                f"{name} M=1 N={N} K={K}",
                "bf16",
                make,
                gemv.linear,
                ops.linear,
                bytes=N * K * 2 + K * 2 + N * 2,
                target_pct=70.0,
                group="gemv",
                notes="reference ops.linear = cuBLAS; default launches with PDL (variant no_pdl without)",
            )
        )
        for variant, cfg in _sweep(N, K, dev) if real else []:
            out.append(
                Case(
                    "linear[gemv]",
                    f"{name} M=1 N={N} K={K}",
                    "bf16",
                    make,
                    functools.partial(gemv.linear, config=cfg),
                    ops.linear,
                    bytes=N * K * 2 + K * 2 + N * 2,
                    variant=variant,
                    group="gemv",
                )
            )
        if name in ("gate_up", "down") or not real:
            for M in (8, 16):
                out.append(
                    Case(
                        "linear[gemv]",
                        f"{name} M={M} N={N} K={K}",
                        "bf16",
                        functools.partial(make, M),
                        gemv.linear,
                        ops.linear,
                        bytes=N * K * 2 + M * K * 2 + M * N * 2,
                        compile_ref=False,
                        group="gemv",
                    )
                )
        for bits in (8, 4):

            def qmake(N=N, K=K, bits=bits):
                qw = quant_gemv.quantize_weight(randn(N, K, device=device, scale=K**-0.5), bits)
                return randn(1, K, device=device), qw.qweight, qw.scales

            fn = quant_gemv.linear_w8a16 if bits == 8 else quant_gemv.linear_w4a16

            dense_ref = _DenseReference(N, K)
            out.append(
                Case(
                    f"linear_w{bits}a16",
                    f"{name} M=1 N={N} K={K}",
                    "bf16",
                    qmake,
                    fn,
                    dense_ref,
                    bytes=N * K * bits // 8 + 4 * N + K * 2 + N * 2,
                    check=_quant_check(bits),
                    compile_ref=False,
                    group="quant_gemv",
                    notes="eager column = dense bf16 cuBLAS GEMV at the same shape",
                )
            )
        if i == 0 and real:
            out.append(
                Case(
                    "linear[gemv]",
                    f"lm_head M=1 N={VOCAB} K={HIDDEN}",
                    "bf16",
                    functools.partial(make, 1, VOCAB, HIDDEN),
                    gemv.linear,
                    ops.linear,
                    bytes=VOCAB * HIDDEN * 2 + HIDDEN * 2 + VOCAB * 2,
                    compile_ref=False,
                    group="gemv",
                )
            )
    return out


class _DenseReference:
    """The bf16 cuBLAS GEMV a quantized layer replaces, rotating over 16 dense weights (not L2-resident)."""

    def __init__(self, N: int, K: int):
        self.N, self.K, self.weights, self.calls = N, K, [], 0

    def __call__(self, x, qweight, scales):
        if not self.weights:
            self.weights = [randn(self.N, self.K, device=x.device) for _ in range(16)]
        self.calls += 1
        return ops.linear(x, self.weights[self.calls % 16])


if __name__ == "__main__":
    main_for(cases)
