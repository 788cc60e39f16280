#!/usr/bin/env python3
"""How much of a full-batch decode attention launch is the tail of its longest sequences: a list-scheduling model
of the offline workload's decode steps, run on the CPU, to decide whether length balance
(``paged_attention.BALANCE_SLICE_TOKENS``) is worth a GPU A/B. It is a model, not a measurement: the GPU decides.

The workload is the gate's (``kernellab.bench.workloads.nanovllm``: 256 prompts of 100-1,024 tokens, 100-1,024
output tokens each, all admitted at once). At every ``--every``-th decode step with at least ``--min-rows`` live
sequences, each (sequence, KV head, slice) program of the launch becomes a job whose length is its tiles (64 tokens
each) plus ``--merge`` tiles when its sequence has several slices, and ``--idle`` tiles for a slice with no tokens
(it still starts, loads its context length and exits). Jobs start in launch order (the sequence fastest, then the
KV head, then the slice, as CUDA schedules a ``(B, Hk, S)`` grid) on ``--slots`` concurrent programs (4 CTAs an SM
× 132 SMs for the int8 descriptor form) as each slot frees: the launch's time is the last job's end. A tile-time is
the same for every program; the real kernel is bound by memory bandwidth, so programs left alone at a tail run
faster than this assumes, and the model overstates what balance gains. Prints and writes (``--out``) each
setting's total time relative to one slice a sequence, for several idle and merge costs.

    python benchmarks/kernels/decode_balance_model.py --out results/kernels/decode_balance_model.json
"""

from __future__ import annotations

import argparse
import heapq
from pathlib import Path


def launch_time(units: list[float], slots: int) -> float:
    """Greedy list scheduling in launch order: each job starts on the first free slot; the last end."""
    free = [0.0] * slots
    end = 0.0
    for u in units:
        t = heapq.heappop(free) + u
        end = max(end, t)
        heapq.heappush(free, t)
    return end


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def jobs(ctxs: list[int], kv_heads: int, splits: int, min_slice: int, tile: int, idle: float, merge: float):
    """The launch's programs in grid order, each as tile-times (``paged_attention._slice_of``'s slicing)."""
    out = []
    for s in range(splits):
        for _ in range(kv_heads):
            for c in ctxs:
                per = max(cdiv(cdiv(c, splits), tile) * tile, min_slice)
                n_active = cdiv(c, per)
                if s >= n_active:
                    out.append(idle)
                    continue
                n = min(c, (s + 1) * per) - s * per
                out.append(cdiv(n, tile) + (merge if n_active > 1 else 0.0))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    ap.add_argument("--slots", type=int, default=4 * 132)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--tile", type=int, default=64)
    ap.add_argument("--every", type=int, default=16, help="model every N-th decode step")
    ap.add_argument("--min-rows", type=int, default=129, help="steps with at least this many live sequences")
    args = ap.parse_args()
    from kernellab.bench.workloads import nanovllm

    prompts, outs = nanovllm()
    ins = [len(p) for p in prompts]
    settings = [(1, args.tile), (2, 512), (3, 512), (4, 512), (4, 256), (2, 768), (4, 768)]
    costs = [(0.02, 0.3), (0.2, 0.5), (0.5, 0.5), (1.0, 0.5)]
    rows = []
    for idle, merge in costs:
        total = {}
        for splits, min_slice in settings:
            t = 0.0
            for step in range(0, max(outs), args.every):
                ctxs = [ins[i] + step for i in range(len(ins)) if step < outs[i]]
                if len(ctxs) < args.min_rows:
                    break
                t += launch_time(jobs(ctxs, args.kv_heads, splits, min_slice, args.tile, idle, merge), args.slots)
            total[(splits, min_slice)] = t
        base = total[(1, args.tile)]
        row = {
            "idle_tiles": idle,
            "merge_tiles": merge,
            "relative_to_one_slice": {f"{s}x{m}": round(v / base, 4) for (s, m), v in total.items()},
        }
        rows.append(row)
        print(
            f"idle {idle:4.2f} merge {merge:3.1f}: "
            + "  ".join(f"{k} {v:.3f}" for k, v in row["relative_to_one_slice"].items())
        )
    if args.out:
        from kernellab.results import provenance, write

        write(
            Path(args.out),
            {
                "schema": "kernellab.bench.decode_balance_model/v1",
                "provenance": provenance("cpu"),
                "what": "list-scheduling model of the offline workload's full-batch decode attention launches "
                "(a model on the CPU, not a GPU measurement); settings as SPLITSxMIN_SLICE_TOKENS",
                "slots": args.slots,
                "kv_heads": args.kv_heads,
                "tile_tokens": args.tile,
                "steps": {"every": args.every, "min_rows": args.min_rows},
                "rows": rows,
            },
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
