#!/usr/bin/env python3
"""The L2 prefetch at batch-1 decode (``kernels/prefetch.py``, op ``l2_prefetch``), on and off, interleaved rounds:

- ``off``: the op disabled;
- after each QKV GEMV, the layer's output projection, gate/up and down weights and the next layer's QKV (31 MB at
  Qwen3-0.6B): bulk prefetches on a side stream, line prefetches on a side stream, line prefetches in the
  stream's PDL chain (``model.PREFETCH_LINES``, ``model.PREFETCH_SIDE_STREAM``).

Workload: the gate's latency engine (8 sequences, 4,096-token contexts), batch-1 inter-token latency at context
128 and 2,048 (64 greedy tokens after a random prompt), each variant its own engine (graphs captured with its
setting). The greedy tokens must be the same in every run. Before that, the GEMVs alone: each of a layer's
weight matrices read cold (L2 flushed by a 256 MB write) and right after its prefetch, in µs and GB/s.

    python3 benchmarks/gpu/l2_prefetch_ab.py --out "$OUT/l2"             # on the device machine (env.sh)
    python3 benchmarks/gpu/l2_prefetch_ab.py --out /tmp/l2 --device cpu   # a rehearsal of the path (torch ops)
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

# name: (line prefetches instead of bulk, on a side stream instead of the PDL chain); every variant also prefetches
# the next layer's QKV. The first H200 run (56c1be2) had the bulk prefetch in the PDL chain: the attention then
# waited for every prefetch to land (ITL 0.768 → 2.159 ms at context 128), so two variants leave the chain.
VARIANTS = {"off": None, "bulk-side": (False, True), "lines-side": (True, True), "lines-chain": (True, False)}


def gemv_cold_warm(reps: int = 30) -> dict:
    """Each Qwen3-0.6B batch-1 GEMV shape read cold (L2 flushed by a 256 MB write) and after a bulk or a line
    prefetch of its weight: median µs by CUDA events, and the weight bytes per second. A ~0.2 ms spin kernel before
    the timed GEMV lets the prefetch land and keeps the host's launch out of the timing."""
    from kernellab.kernels import gemv
    from kernellab.kernels.prefetch import l2_prefetch

    shapes = {"qkv": (4096, 1024), "o_proj": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    rows = {}
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        gemv.linear(x, w)
        times: dict[str, list[float]] = {"cold": [], "bulk": [], "lines": []}
        for _ in range(reps):
            for mode in times:
                flush.fill_(1)
                if mode != "cold":
                    l2_prefetch(w, lines=mode == "lines", pdl=False)
                torch.cuda._sleep(400_000)
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                gemv.linear(x, w)
                b.record()
                b.synchronize()
                times[mode].append(a.elapsed_time(b) * 1e3)
        mb = n * k * 2 / 1e6
        rows[name] = {"weight_mb": round(mb, 2)}
        for mode, ts in times.items():
            us = statistics.median(ts)
            rows[name][f"{mode}_us"] = round(us, 2)
            rows[name][f"{mode}_gb_per_s"] = round(mb * 1e3 / us, 1)
        print(
            f"gemv {name:8s} {mb:6.2f} MB  "
            + "  ".join(f"{m} {rows[name][f'{m}_us']:6.2f} µs ({rows[name][f'{m}_gb_per_s']:.0f} GB/s)" for m in times),
            flush=True,
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = ap.parse_args()
    from kernellab.bench.engine_ab import interleaved_rounds, itl_figures, median_summary, same_greedy_tokens
    from kernellab.bench.offline import gate_offline_setup
    from kernellab.results import provenance, write
    from kernellab.runtime import model as model_module
    from kernellab.runtime.config import EngineConfig
    from kernellab.runtime.engine import LLMEngine

    gpu = args.device == "cuda"
    cfg, _, _ = gate_offline_setup(args.device)
    lat_cfg = dict(cfg, max_num_seqs=8, max_model_len=4096 if gpu else 512, num_kv_blocks=2048 if gpu else 256)
    micro = gemv_cold_warm() if gpu else {}
    engines = {}
    t = time.perf_counter()
    defaults = model_module.PREFETCH_LINES, model_module.PREFETCH_SIDE_STREAM
    for name, how in VARIANTS.items():
        if how is not None:
            model_module.PREFETCH_LINES, model_module.PREFETCH_SIDE_STREAM = how
        disabled = ("l2_prefetch",) if how is None else ()
        engines[name] = LLMEngine(EngineConfig(**lat_cfg, disabled_kernels=disabled))
        if not gpu:
            engines[name].runner.eager_windows(8)
    model_module.PREFETCH_LINES, model_module.PREFETCH_SIDE_STREAM = defaults
    print(f"engines ready in {time.perf_counter() - t:.1f}s", flush=True)
    for name, eng in engines.items():
        enabled = "l2_prefetch" in eng.runner.model.ops.enabled
        if enabled != (name != "off") and gpu:
            raise RuntimeError(f"{name}: l2_prefetch enabled={enabled}")
    contexts = (128, 2048) if gpu else (128,)
    runs = interleaved_rounds(
        engines, args.rounds, "variant", lambda eng: itl_figures(eng, contexts, 64 if gpu else 12)
    )
    same = same_greedy_tokens(engines, 96 if gpu else 8)
    summary = median_summary(runs, "variant", list(VARIANTS))
    print(f"same greedy tokens in every variant: {same}", flush=True)
    result = {
        "schema": "kernellab.bench.l2_prefetch_ab/v1",
        "provenance": provenance(args.device),
        "engine": lat_cfg,
        "workload": "one greedy sequence, 64 tokens after a context of 128 / 2,048 random tokens; interleaved rounds",
        "variants": {
            "off": "l2_prefetch disabled",
            "bulk-side": "o_proj, gate/up, down and the next QKV weights after each QKV GEMV: bulk, side stream",
            "lines-side": "the same weights: line prefetches, side stream",
            "lines-chain": "the same weights: line prefetches in the stream's PDL chain",
        },
        "gemv_cold_vs_prefetched": micro,
        "same_tokens": same,
        "runs": runs,
        "summary": summary,
    }
    write(Path(args.out) / "l2_prefetch_ab.json", result)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
