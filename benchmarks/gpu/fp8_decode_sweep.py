#!/usr/bin/env python3
"""The FP8 cache's decode attention on the H200: launch settings and the dtype its tiles widen to, then the
offline workload with the best of them against the current default.

1. Kernel sweep at the gate's shapes (Qwen3-0.6B: 16 query / 8 KV heads, head_dim 128, blocks of 16): the bf16
   cache at its settings, and the FP8 cache at every ``widen`` (bf16 | f16) × ``block_n`` × ``num_warps`` ×
   ``num_stages``, each checked against the fp32 reference over the dequantized cache (``ops``) and timed with
   ``triton.testing.do_bench``; GB/s of the bytes each must read.
2. Offline nano-vllm workload (256 prompts, greedy, ``ignore_eos``) on two FP8-cache engines kept side by side,
   one captured with ``FP8_LAUNCH`` as it stands and one with the sweep's best, in interleaved rounds
   (A B, B A, …); eager steps read ``FP8_LAUNCH`` at call time, so it is set before each run.

    export ROOT=$PWD KERNELLAB_COMMIT=<sha>; source benchmarks/gpu/env.sh
    python3 $ROOT/benchmarks/gpu/fp8_decode_sweep.py --out "$OUT"          # on the device machine
    python3 benchmarks/gpu/fp8_decode_sweep.py --out /tmp/x --device cpu      # rehearsal (interpreter, tiny)

Writes ``fp8_decode_sweep.json`` after each part (schema kernellab.bench.fp8_decode_sweep/v1).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from pathlib import Path

import torch

READ_BW_GBS = 3630.0  # the H200's measured read bandwidth (tests/gpu/run_fp8.py)
SHAPE = {"Hq": 16, "Hk": 8, "D": 128, "block_size": 16}


def _case(batch: int, ctx: int, device: str, dtype: torch.dtype) -> dict:
    from kernellab.runtime import ops

    Hq, Hk, D, bs = SHAPE["Hq"], SHAPE["Hk"], SHAPE["D"], SHAPE["block_size"]
    nblocks = batch * (ctx // bs)
    gen = torch.Generator(device=device).manual_seed(batch)
    k = torch.randn(nblocks, bs, Hk, D, device=device, generator=gen, dtype=dtype)
    v = torch.randn(nblocks, bs, Hk, D, device=device, generator=gen, dtype=dtype)
    q = torch.randn(batch, Hq, D, device=device, generator=gen, dtype=dtype)
    tables = torch.randperm(nblocks, device=device).to(torch.int32).view(batch, -1)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    k8, ks = ops.quantize_kv(k)
    v8, vs = ops.quantize_kv(v)
    ref = ops.paged_decode_attention(q, k8, v8, tables, lens, D**-0.5, k_scales=ks, v_scales=vs).float()
    return {"q": q, "k": k, "v": v, "k8": k8, "v8": v8, "ks": ks, "vs": vs, "tables": tables, "lens": lens, "ref": ref}


def sweep(cases: list[tuple[int, int]], device: str, configs: list[dict]) -> dict:
    from kernellab.kernels.paged_attention import LAUNCH, paged_decode_attention

    gpu = device == "cuda"
    if gpu:
        from triton.testing import do_bench

        def bench(fn):
            return do_bench(fn, warmup=25, rep=100) * 1e3  # µs
    else:

        def bench(fn):
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e6

    dtype = torch.bfloat16
    D, Hk = SHAPE["D"], SHAPE["Hk"]
    rows = []
    for batch, ctx in cases:
        c = _case(batch, ctx, device, dtype)
        tokens = batch * ctx
        bytes_bf16, bytes_fp8 = 2 * tokens * Hk * D * 2, 2 * tokens * Hk * (D + 4)
        t_bf16 = bench(lambda c=c: paged_decode_attention(c["q"], c["k"], c["v"], c["tables"], c["lens"], D**-0.5))
        row = {
            "batch": batch,
            "context": ctx,
            "bf16": {"launch": dict(LAUNCH), "us": round(t_bf16, 2), "gbs": round(bytes_bf16 / t_bf16 / 1e3, 1)},
            "fp8": [],
        }
        for cfg in configs:
            widen, launch = cfg["widen"], {k: cfg[k] for k in ("block_n", "num_warps", "num_stages")}

            def run(c=c, widen=widen, launch=launch):
                return paged_decode_attention(
                    c["q"], c["k8"], c["v8"], c["tables"], c["lens"], D**-0.5, k_scales=c["ks"], v_scales=c["vs"],
                    fp8_widen=widen, **launch,
                )  # fmt: skip

            try:
                err = float((run().float() - c["ref"]).norm() / c["ref"].norm())
                us = bench(run)
            except Exception as exc:  # a setting the compiler refuses (shared memory): recorded, not fatal
                row["fp8"].append({**cfg, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
                continue
            row["fp8"].append(
                {
                    **cfg,
                    "us": round(us, 2),
                    "gbs": round(bytes_fp8 / us / 1e3, 1),
                    "pct_of_read_bw": round(100 * bytes_fp8 / us / 1e3 / READ_BW_GBS, 1),
                    "speedup_vs_bf16": round(t_bf16 / us, 3),
                    "rel_err_vs_reference": err,
                }
            )
        rows.append(row)
        best = min((r for r in row["fp8"] if "us" in r), key=lambda r: r["us"])
        print(
            f"B={batch:4d} ctx={ctx:5d}: bf16 {t_bf16:8.2f} µs; fp8 best {best['us']:8.2f} µs "
            f"({best['widen']}, {best['block_n']}/{best['num_warps']}/{best['num_stages']}, "
            f"{best['pct_of_read_bw']} % of read bw, err {best['rel_err_vs_reference']:.1e})",
            flush=True,
        )
        del c
        if gpu:
            torch.cuda.empty_cache()
    return {"shape": SHAPE, "rows": rows}


def pick(result: dict, current: dict, batched: set[tuple[int, int]]) -> dict:
    """The setting with the least total time over the batched cases (the offline workload's decode), among those
    whose error is at most 1.25× the current setting's in each case."""
    key = ("widen", "block_n", "num_warps", "num_stages")
    rows = [r for r in result["rows"] if (r["batch"], r["context"]) in batched]
    totals: dict[tuple, float] = {}
    for cfg_rows in zip(*(r["fp8"] for r in rows), strict=True):
        if any("us" not in x for x in cfg_rows):
            continue
        ident = tuple(cfg_rows[0][k] for k in key)
        ok = True
        for r, x in zip(rows, cfg_rows, strict=True):
            cur = next(y for y in r["fp8"] if all(y[k] == current[k] for k in key))
            ok &= x["rel_err_vs_reference"] <= 1.25 * cur["rel_err_vs_reference"]
        if ok:
            totals[ident] = sum(x["us"] for x in cfg_rows)
    best = min(totals, key=totals.__getitem__)
    return dict(zip(key, best, strict=True))


def offline_ab(current: dict, best: dict, device: str, rounds: int) -> dict:
    from kernellab.bench.offline import gate_offline_setup, run_engine
    from kernellab.kernels import paged_attention
    from kernellab.runtime.config import EngineConfig
    from kernellab.runtime.engine import LLMEngine

    # two engines side by side: 36,000 blocks each cover 256 sequences of 2,048 tokens (32,768 blocks)
    cfg, prompts, outs = gate_offline_setup(
        device, kv_cache_dtype="fp8", num_kv_blocks=36000 if device == "cuda" else 512
    )
    engines = {}
    for name, launch in (("current", current), ("best", best)):
        paged_attention.FP8_LAUNCH.clear()
        paged_attention.FP8_LAUNCH.update(launch)
        engines[name] = (LLMEngine(EngineConfig(**cfg)), dict(launch))  # graphs captured with this setting
    runs = []
    for r in range(rounds):
        for name in ("current", "best") if r % 2 == 0 else ("best", "current"):
            eng, launch = engines[name]
            paged_attention.FP8_LAUNCH.clear()
            paged_attention.FP8_LAUNCH.update(launch)
            if not eng.reset_prefix_cache():
                raise RuntimeError("the engine is not idle between runs")
            run = run_engine(eng, prompts, outs, "nanovllm-256", cfg["dtype"])
            runs.append({"variant": name, "round": r, **{k: run[k] for k in ("output_tok_per_s", "seconds")}})
            print(f"offline fp8 round {r} {name:8s} {run['output_tok_per_s']:>9.0f} tok/s", flush=True)
    paged_attention.FP8_LAUNCH.clear()
    paged_attention.FP8_LAUNCH.update(current)
    ratios = [
        b["output_tok_per_s"] / a["output_tok_per_s"]
        for a, b in zip(
            [x for x in runs if x["variant"] == "current"], [x for x in runs if x["variant"] == "best"], strict=True
        )
    ]
    return {
        "engine": cfg,
        "settings": {"current": current, "best": best},
        "runs": runs,
        "median_tok_s": {
            n: statistics.median(x["output_tok_per_s"] for x in runs if x["variant"] == n) for n in ("current", "best")
        },
        "best_over_current": {"per_round": [round(x, 4) for x in ratios], "median": statistics.median(ratios)},
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--rounds", type=int, default=2, help="offline rounds per setting")
    args = ap.parse_args()
    gpu = args.device == "cuda"
    if not gpu:  # Triton's interpreter, read when a kernel is decorated, with the fixes the CPU tests use
        os.environ["TRITON_INTERPRET"] = "1"
        from kernellab.kernels.testing import patch_interpreter

        patch_interpreter()
    from kernellab.kernels import paged_attention
    from kernellab.results import provenance

    if gpu:
        cases = [(64, 1024), (256, 1024), (1, 4096)]
        grid = itertools.product(("bf16", "f16"), (32, 64, 128), (4, 8), (1, 2, 3))
    else:  # the interpreter: the script's path, a handful of settings
        cases = [(2, 64), (4, 64)]
        grid = itertools.product(("bf16", "f16"), (16, 32), (4,), (2,))
    configs = [dict(zip(("widen", "block_n", "num_warps", "num_stages"), g, strict=True)) for g in grid]
    current = dict(paged_attention.FP8_LAUNCH)
    if current not in configs:
        configs.append(current)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "schema": "kernellab.bench.fp8_decode_sweep/v1",
        "provenance": provenance(args.device),
        "current_fp8_launch": current,
        "kernel": sweep(cases, args.device, configs),
    }
    path = out / "fp8_decode_sweep.json"
    path.write_text(json.dumps(result, indent=1))
    batched = {c for c in cases if c[0] > 1}
    best = pick(result["kernel"], current, batched)
    result["best_fp8_launch"] = best
    print(f"current {current} → best {best}", flush=True)
    path.write_text(json.dumps(result, indent=1))
    result["offline"] = offline_ab(current, best, args.device, args.rounds)
    path.write_text(json.dumps(result, indent=1))
    print(f"offline fp8, best / current: {result['offline']['best_over_current']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
