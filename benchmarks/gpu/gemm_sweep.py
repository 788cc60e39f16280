#!/usr/bin/env python3
"""The descriptor-form Triton GEMM (``kernels/gemm.py: linear_desc``) against cuBLAS at Qwen3-0.6B's prefill
projections, and its SwiGLU epilogue against what the engine runs today (cuBLAS's gate/up GEMM, then the Triton
``silu_and_mul`` kernel).

Why: a 2,048-token prompt's TTFT spends ~0.26 ms in the MLP's SwiGLU kernel, ~0.28 in the QK-norm + RoPE kernel
and ~0.17 in the idle gaps before cuBLAS's 256 × 128 GEMMs (``latency_anatomy.py --traces``, H100 at 6d2cc52).
Folding those into a GEMM's epilogue (and launching it with PDL) pays only if the Triton GEMM is close to cuBLAS:
this measures how close, per shape and tile setting, before any of it goes into the engine.

Each candidate is checked against the fp32 reference, then timed as a CUDA graph of one call (median of 20
samples of 5 replays, µs), so launch cost is not counted (the engine's prefill runs in graphs).

    python3 benchmarks/gpu/gemm_sweep.py --out "$OUT/gemm_sweep.json" [--m 512,2048,4096]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch

SHAPES = {  # name: (N, K) of Qwen3-0.6B's projections (hidden 1,024, 16 / 8 heads of 128, intermediate 3,072)
    "qkv": (4096, 1024),
    "gate_up": (6144, 1024),
    "o_proj": (1024, 2048),
    "down": (1024, 3072),
}
PLAIN = {  # name: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, persistent)
    "t128x256x64w8s3": (128, 256, 64, 8, 3, False),
    "t128x256x64w8s4": (128, 256, 64, 8, 4, False),
    "t128x128x64w8s4": (128, 128, 64, 8, 4, False),
    "t128x128x64w4s4": (128, 128, 64, 4, 4, False),
    "t128x128x64w4s5": (128, 128, 64, 4, 5, False),
    "t64x256x64w4s4": (64, 256, 64, 4, 4, False),
    "p128x256x64w8s3": (128, 256, 64, 8, 3, True),
    "p128x128x64w8s4": (128, 128, 64, 8, 4, True),
    # the tile loop pipelined across tiles (flatten) and with producer warps (warp_specialize)
    "p128x256x64w8s3-flat": (128, 256, 64, 8, 3, True, {"flatten": True}),
    "p128x256x64w8s3-flat-ws": (128, 256, 64, 8, 3, True, {"flatten": True, "warp_specialize": True}),
}
GLU = {  # BLOCK_N is each half's (gate and up)
    "g128x128x64w8s3": (128, 128, 64, 8, 3, False),
    "g128x128x64w8s4": (128, 128, 64, 8, 4, False),
    "g128x64x64w4s4": (128, 64, 64, 4, 4, False),
    "g128x64x64w8s5": (128, 64, 64, 8, 5, False),
    "g64x128x64w4s4": (64, 128, 64, 4, 4, False),
    "gp128x128x64w8s3": (128, 128, 64, 8, 3, True),
    "gp128x64x64w4s4": (128, 64, 64, 4, 4, True),
    "gp128x128x64w8s3-flat": (128, 128, 64, 8, 3, True, {"flatten": True}),
    "gp128x128x64w8s3-flat-ws": (128, 128, 64, 8, 3, True, {"flatten": True, "warp_specialize": True}),
    "gp128x128x64w8s3-ws": (128, 128, 64, 8, 3, True, {"warp_specialize": True}),
}


QKV_VARIANTS = {  # the fused QKV + QK-norm + RoPE + KV-write GEMM: epilogue parts off (timing), other tiles
    "fused-no-rope": {"epilogue": (False, True)},
    "fused-no-cache": {"epilogue": (True, False)},
    "fused-plain": {"epilogue": (False, False)},
    "fused-tiled": {"persistent": False},
    "fused-ws": {"warp_specialize": True},
    "fused-flat": {"flatten": True},  # the branch-free epilogue
    "fused-flat-ws": {"flatten": True, "warp_specialize": True},
    # three stages of the flattened loop need 245,784 bytes of shared memory (232,448 on sm_90; H100, 6b1d491)
    "fused-flat-s2": {
        "flatten": True,
        "config": {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 2},
    },
    "fused-flat-k32s3": {
        "flatten": True,
        "config": {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
    },
    "fused-s4-128x256": {
        "config": {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 8, "num_stages": 4}
    },
    "fused-64x256": {
        "config": {"BLOCK_M": 64, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}
    },
    "fused-128x128": {
        "config": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 4}
    },
}


def timed(fn: Callable[[], object], reps: int = 20) -> float:
    """Median µs of one call, replayed from a CUDA graph."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(5):
            graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / 5)
    return sorted(times)[len(times) // 2]


def _cfg(t: tuple) -> tuple[dict, dict]:
    """(tile config, ``linear_desc`` keyword arguments) of a sweep entry."""
    bm, bn, bk, warps, stages, persistent, *flags = t
    cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "num_warps": warps, "num_stages": stages}
    return cfg, {"persistent": persistent, **(flags[0] if flags else {})}


def qkv_rope(record, x: torch.Tensor, w: torch.Tensor, M: int, N: int, K: int, flops: float) -> None:
    """cuBLAS's QKV GEMM + the Triton ``qk_norm_rope_store_kv`` (the engine's prefill path today) against the GEMM
    with both in its epilogue (``gemm.qkv_proj_norm_rope_store_kv``), Qwen3-0.6B's 16 / 8 heads of 128 into a
    bf16 cache; the error is against the two-kernel path's output."""
    from kernellab.kernels import gemm, rope
    from kernellab.runtime import ops

    hq, hk, d, bs = 16, 8, 128, 16
    dev = x.device
    pos = torch.randint(0, 4096, (M,), device=dev)
    cs = ops.rope_cos_sin_cache(d, 4096, 1e6, device=dev)
    qw, kw = torch.rand(d, device=dev, dtype=x.dtype) + 0.5, torch.rand(d, device=dev, dtype=x.dtype) + 0.5
    blocks = M // bs + 8
    kc, vc = (torch.zeros(blocks, bs, hk, d, device=dev, dtype=x.dtype) for _ in range(2))
    slots = torch.randperm(blocks * bs, device=dev)[:M]

    def two_kernels(whole: bool = False):
        qkv = torch.nn.functional.linear(x, w)
        q, k, v = (t.view(M, -1, d) for t in qkv.split([hq * d, hk * d, hk * d], dim=-1))
        q2, k2 = rope.qk_norm_rope_store_kv(pos, q, k, v, qw, kw, 1e-6, cs, kc, vc, slots)
        if not whole:  # what the engine runs (timed)
            return q2
        return torch.cat([q2.reshape(M, -1), k2.reshape(M, -1), qkv[:, (hq + hk) * d :]], dim=1)

    ref = two_kernels(whole=True).float()
    chain = record("qkv+rope", M, N, K, "cublas+qk_norm_rope_store_kv", two_kernels, two_kernels().float(), flops, 0)
    record(
        "qkv+rope", M, N, K, "fused",
        lambda: gemm.qkv_proj_norm_rope_store_kv(x, w, pos, qw, kw, 1e-6, cs, kc, vc, slots, hq, hk),
        ref, flops, chain,
    )  # fmt: skip
    # where the epilogue's time goes, and other tiles (the parts switched off give wrong values: timing only)
    plain = torch.nn.functional.linear(x, w).float()
    for name, kw_ in QKV_VARIANTS.items():
        parts = kw_.get("epilogue", (True, True))
        record(
            "qkv+rope", M, N, K, name,
            lambda kw_=kw_: gemm.qkv_proj_norm_rope_store_kv(x, w, pos, qw, kw, 1e-6, cs, kc, vc, slots, hq, hk, **kw_),
            ref if parts[0] else plain, flops, chain,
        )  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--m", default="512,2048,4096", type=lambda s: [int(v) for v in s.split(",")])
    ap.add_argument("--shapes", default=",".join(SHAPES), help="of " + ", ".join(SHAPES))
    args = ap.parse_args()
    from kernellab.kernels import gemm, swiglu
    from kernellab.results import provenance, write

    torch.manual_seed(0)
    dev = torch.device("cuda")
    rows, errors = [], []

    def record(shape: str, M: int, N: int, K: int, variant: str, fn, ref: torch.Tensor, flops: float, base):
        try:
            y = fn()
            err = (y.float() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)
            us = timed(fn)
        except Exception as exc:  # a setting that does not compile or fit is recorded, not fatal
            errors.append(f"{shape} M={M} {variant}: {exc!r}"[:300])
            print("error", errors[-1], flush=True)
            return None
        row = {
            "shape": shape,
            "M": M,
            "N": N,
            "K": K,
            "variant": variant,
            "us": round(us, 2),
            "tflops": round(flops / us / 1e6, 1),
            "rel_err": float(f"{err:.3g}"),
            "vs_base": round(base / us, 3) if base else 1.0,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
        return us

    for M in args.m:
        x = torch.randn(M, 1024, device=dev, dtype=torch.bfloat16)
        for shape, (N, K) in SHAPES.items():
            if shape not in args.shapes.split(","):
                continue
            xs = x if K == 1024 else torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * K**-0.5
            ref = xs.float() @ w.float().T
            flops = 2.0 * M * N * K
            base = record(shape, M, N, K, "cublas", lambda xs=xs, w=w: torch.nn.functional.linear(xs, w), ref, flops, 0)
            for name, t in PLAIN.items():
                cfg, kw = _cfg(t)
                record(
                    shape, M, N, K, name,
                    lambda xs=xs, w=w, cfg=cfg, kw=kw: gemm.linear_desc(xs, w, config=cfg, **kw),
                    ref, flops, base,
                )  # fmt: skip
            if shape == "qkv":  # the projection and Qwen3's attention prologue as the engine runs it, then fused
                qkv_rope(record, xs, w, M, N, K, flops)
            if shape != "gate_up":
                continue
            # the MLP's first half as the engine runs it, then fused
            glu_ref = torch.nn.functional.silu(ref[:, : N // 2]) * ref[:, N // 2 :]
            chain = record(
                "gate_up+swiglu", M, N, K, "cublas+silu_and_mul",
                lambda xs=xs, w=w: swiglu.silu_and_mul(torch.nn.functional.linear(xs, w)), glu_ref, flops, 0,
            )  # fmt: skip
            for name, t in GLU.items():
                cfg, kw = _cfg(t)
                record(
                    "gate_up+swiglu", M, N, K, name,
                    lambda xs=xs, w=w, cfg=cfg, kw=kw: gemm.linear_desc(xs, w, glu=True, config=cfg, **kw),
                    glu_ref, flops, chain,
                )  # fmt: skip
    best = {}
    for r in rows:
        key = (r["shape"], r["M"])
        if r["variant"] not in ("cublas", "cublas+silu_and_mul") and (key not in best or r["us"] < best[key]["us"]):
            best[key] = r
    print(f"{'shape':16s} {'M':>5s} {'baseline us':>11s} {'best triton':>18s} {'us':>8s} {'vs base':>7s}")
    for (shape, M), r in sorted(best.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        b = next(x for x in rows if x["shape"] == shape and x["M"] == M and x["vs_base"] == 1.0)
        print(f"{shape:16s} {M:5d} {b['us']:11.2f} {r['variant']:>18s} {r['us']:8.2f} {r['vs_base']:7.3f}")
    write(
        Path(args.out),
        {
            "schema": "kernellab.bench.gemm_sweep/v1",
            "provenance": provenance("cuda"),
            "workload": "Qwen3-0.6B prefill projections, bf16, random inputs; CUDA-graph replays, median µs; "
            "vs_base: cuBLAS's time (gate_up+swiglu: cuBLAS + the engine's silu_and_mul) over the candidate's",
            "rows": rows,
            "errors": errors,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
