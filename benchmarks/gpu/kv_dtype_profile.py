#!/usr/bin/env python3
"""Where the offline workload's time goes per KV-cache dtype: the bf16 cache against the 8-bit ones, same workload.

At ce2e67b the int8 cache's decode attention ran faster than the bf16 one's at the offline workload's main shape
(218.7 against 261.1 µs a layer at 256 sequences × 1,024 tokens), yet the whole workload ran 5.5 % slower on it
(23,085 against 24,429 tok/s). This script says where the difference lies instead of guessing. For each cache, on
an engine of the gate's offline configuration (``kernellab.bench.offline.gate_offline_setup``: nano-vllm's 256
prompts, greedy, ``ignore_eos``; 20,480 KV blocks for every cache, of the cache's own block size: 16 tokens, 64 for
int8 since 7e35b30, so its pool holds 4× the tokens; either holds the whole batch, where pool size changed nothing):

0. the whole run once, untimed: the warm-up's eight prompts leave specializations the workload meets later
   uncompiled (at 407f0fb the packed prefill attention's, 2.8 s of JIT inside the first cache's timed prefill
   on an H100);
1. the whole run, each ``step()`` call timed on the host and counted as prefill (it computed prompt tokens) or
   decode (a window launched ahead is read by a later call, so a call's time is what the host waited for);
2. the run again under ``torch.profiler``, two windows: the first step (a 16,384-token prefill) and
   ``--decode-calls`` decode-only calls once every prompt is in (the full batch), each with the device time per
   kernel (CPU: per op) and the window's wall time.

    export ROOT=$PWD KERNELLAB_COMMIT=<sha>; source benchmarks/gpu/env.sh
    python3 $ROOT/benchmarks/gpu/kv_dtype_profile.py --out "$OUT"                      # on the device machine
    python3 benchmarks/gpu/kv_dtype_profile.py --out /tmp/x --device cpu               # the path, on the CPU

A cache may name its pool: ``int8@auto`` sizes it from free memory as the gate's 8-bit section does (twice the
blocks of the bf16 pool for the same bytes), ``bf16@40960`` a number of blocks; a bare name takes 20,480. On the
H100 at 407f0fb, with equal pools, the int8 cache's decode calls took 5.69 s against bf16's 6.72, while the gate's
8-bit section (pools from memory) had int8 5.5 % slower overall on the H200: ``--caches bf16,int8,bf16@auto,
int8@auto`` tells whether the pool's size is what differs.

Writes ``kv_dtype_profile.json`` (schema kernellab.bench.kv_dtype_profile/v1) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _add_all(eng, prompts, outs, tag: str) -> None:
    from kernellab.runtime.request.sampling import SamplingParams

    for i, (p, n) in enumerate(zip(prompts, outs, strict=True)):
        eng.add_request(f"{tag}{i}", p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))


def _kernels(prof, device: str, top: int) -> dict:
    """Per kernel (CUDA) or per op (CPU, self time): milliseconds and calls, the largest ``top`` and the total."""
    if device == "cuda":
        # device work only: kernels, copies and memsets, not the host ops (aten::, cuda*) that launched them
        rows = [
            (e.key, e.device_time_total, e.count)
            for e in prof.key_averages()
            if e.device_time_total > 0 and not e.key.startswith(("aten::", "cuda"))
        ]
    else:
        rows = [(e.key, e.self_cpu_time_total, e.count) for e in prof.key_averages() if e.self_cpu_time_total > 0]
    rows.sort(key=lambda r: r[1], reverse=True)
    return {
        "total_ms": round(sum(r[1] for r in rows) / 1e3, 3),
        "top": [{"name": k[:90], "ms": round(t / 1e3, 3), "calls": c} for k, t, c in rows[:top]],
    }


def _fresh_cache(eng) -> None:
    """Empty the prefix cache, so the next run computes every prompt (no hits from the run before)."""
    if not eng.reset_prefix_cache():
        raise RuntimeError("the engine is not idle between runs")


def timed_run(eng, prompts, outs, device: str) -> dict:
    """The whole workload, each step() call timed on the host and sorted into prefill and decode calls."""
    _add_all(eng, prompts, outs, "run")
    kinds = {"prefill": [0, 0.0], "decode": [0, 0.0]}
    _sync(device)
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        before = eng.prompt_tokens
        t = time.perf_counter()
        eng.step()
        k = kinds["prefill" if eng.prompt_tokens > before else "decode"]
        k[0] += 1
        k[1] += time.perf_counter() - t
    _sync(device)
    wall = time.perf_counter() - t0
    return {
        "wall_s": round(wall, 4),
        "output_tok_per_s": round(sum(outs) / wall, 1),
        "calls": {k: {"n": n, "s": round(s, 4)} for k, (n, s) in kinds.items()},
    }


def profiled_run(eng, prompts, outs, device: str, decode_calls: int, top: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    _add_all(eng, prompts, outs, "prof")
    windows = {}
    _sync(device)
    with profile(activities=acts) as prof:
        t = time.perf_counter()
        eng.step()  # the first step: prompts only
        _sync(device)
    windows["first_step"] = {"wall_ms": round((time.perf_counter() - t) * 1e3, 3), **_kernels(prof, device, top)}
    while eng.has_unfinished_requests() and eng.scheduler.waiting:  # every prompt in
        eng.step()
    before = -1
    while eng.has_unfinished_requests() and eng.prompt_tokens != before:  # the last chunks prefilled
        before = eng.prompt_tokens
        eng.step()
    batch = len(eng.scheduler.running)
    _sync(device)
    with profile(activities=acts) as prof:
        t = time.perf_counter()
        n = 0
        while n < decode_calls and eng.has_unfinished_requests():
            eng.step()
            n += 1
        _sync(device)
    windows["decode"] = {
        "calls": n,
        "running": batch,
        "wall_ms": round((time.perf_counter() - t) * 1e3, 3),
        **_kernels(prof, device, top),
    }
    while eng.has_unfinished_requests():
        eng.step()
    return windows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument(
        "--caches",
        default="bf16,int8",
        help="comma-separated: bf16, int8, fp8, each with @auto or @<blocks> for its pool",
    )
    ap.add_argument("--decode-calls", type=int, default=16, help="decode-only step() calls in the profiled window")
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    gpu = args.device == "cuda"
    if not gpu:
        import os

        os.environ["TRITON_INTERPRET"] = "1"  # read when a kernel is decorated: before the package's import
        from kernellab.kernels.testing import patch_interpreter

        patch_interpreter()
    from kernellab.bench.offline import gate_offline_setup, warm_up
    from kernellab.results import provenance
    from kernellab.runtime.config import EngineConfig
    from kernellab.runtime.engine import LLMEngine

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "kv_dtype_profile.json"
    result: dict = {
        "schema": "kernellab.bench.kv_dtype_profile/v1",
        "provenance": provenance(args.device),
        "caches": {},
    }
    for cache in args.caches.split(","):
        dtype, _, pool = cache.partition("@")
        blocks = None if pool == "auto" else int(pool) if pool else 20480 if gpu else 512
        cfg, prompts, outs = gate_offline_setup(
            args.device, kv_cache_dtype="auto" if dtype == "bf16" else dtype, num_kv_blocks=blocks
        )
        eng = LLMEngine(EngineConfig(**cfg))
        warm_up(eng, prompts)
        timed_run(eng, prompts, outs, args.device)  # untimed: every specialization the workload meets, compiled
        _fresh_cache(eng)
        run = timed_run(eng, prompts, outs, args.device)
        run["kv_blocks"] = eng.runner.num_blocks
        _fresh_cache(eng)
        windows = profiled_run(eng, prompts, outs, args.device, args.decode_calls, args.top)
        result["engine"] = {k: v for k, v in cfg.items() if k not in ("model", "kv_cache_dtype", "num_kv_blocks")}
        result["caches"][cache] = {"fast_path": eng.fast_path, "run": run, "profile": windows}
        c = run["calls"]
        print(
            f"{cache:10s} {run['kv_blocks']:>7d} blocks {run['output_tok_per_s']:>9.0f} tok/s  wall {run['wall_s']:.3f} s  prefill calls "
            f"{c['prefill']['n']} {c['prefill']['s']:.3f} s  decode calls {c['decode']['n']} {c['decode']['s']:.3f} s  "
            f"| first step {windows['first_step']['wall_ms']:.2f} ms  {windows['decode']['calls']} decode calls at "
            f"{windows['decode']['running']} rows {windows['decode']['wall_ms']:.2f} ms",
            flush=True,
        )
        path.write_text(json.dumps(result, indent=1, default=str))
        del eng
        if gpu:
            torch.cuda.empty_cache()
    for window in ("first_step", "decode"):
        print(f"\n{window}: time per kernel (ms)")
        names: dict[str, dict[str, float]] = {}
        for cache, r in result["caches"].items():
            for row in r["profile"][window]["top"]:
                names.setdefault(row["name"], {})[cache] = row["ms"]
        for name, by in sorted(names.items(), key=lambda kv: -max(kv[1].values())):
            cols = "  ".join(f"{c} {by.get(c, float('nan')):8.3f}" for c in result["caches"])
            print(f"  {name[:60]:60s} {cols}")
    path.write_text(json.dumps(result, indent=1, default=str))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
