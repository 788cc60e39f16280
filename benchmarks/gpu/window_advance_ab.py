#!/usr/bin/env python3
"""Offline throughput with decode-window rows advanced in one pass (``Scheduler.advance_window``, the engine's
path) against the per-token loop it replaced (``advance()`` per token, emulated by swapping the method), on one
engine, interleaved rounds: the engine gate's offline workload (nano-vllm's 256 prompts, windows of 16 steps).

    PYTHONPATH=. python3 benchmarks/gpu/window_advance_ab.py --out "$OUT"   # on the device machine

Random weights of the exact Qwen3-0.6B shape. Each run starts from an empty prefix cache, so every run is the
same workload; both variants must emit the same tokens (greedy).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def per_token(scheduler):
    """advance_window as the engine did it before: advance() per token until the row ends."""

    def advance_window(seq, tokens):
        kept = []
        for token in tokens:
            if not scheduler.advance(seq, 1, token):
                break
            kept.append(token)
            if seq.is_finished:
                break
        return kept

    return advance_window


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))  # cpu: a rehearsal, tiny model
    args = ap.parse_args()
    from kernellab.bench.offline import gate_offline_setup, run_engine
    from kernellab.results import provenance
    from kernellab.runtime.config import EngineConfig
    from kernellab.runtime.engine import LLMEngine

    gpu = args.device == "cuda"
    # (no decode windows off CUDA: the CPU rehearsal checks the script, not the effect)
    cfg, prompts, outs = gate_offline_setup(args.device)
    eng = LLMEngine(EngineConfig(**cfg))
    one_pass = eng.scheduler.advance_window
    variants = {"one_pass": one_pass, "per_token": per_token(eng.scheduler)}
    runs: list[dict] = []
    for r in range(args.rounds):
        for name in ("one_pass", "per_token") if r % 2 == 0 else ("per_token", "one_pass"):
            eng.scheduler.advance_window = variants[name]
            # every run starts from an empty prefix cache: otherwise the runs after the first find all 256 prompts
            # (and their outputs) cached, skip their prefill, and measure another workload with other batches
            if not eng.reset_prefix_cache():
                raise RuntimeError("the engine is not idle between runs")
            if gpu:
                torch.cuda.synchronize()
            t = time.perf_counter()
            run = run_engine(eng, prompts, outs, "nanovllm-256", cfg["dtype"])
            runs.append(
                {
                    "variant": name,
                    "round": r,
                    "output_tok_per_s": run["output_tok_per_s"],
                    "seconds": run["seconds"],
                    "output_tokens": run["output_tokens"],
                    "first": run["first_prompt_token_ids"],
                }
            )
            print(f"round {r} {name:10s} {run['output_tok_per_s']:>10.0f} tok/s  ({time.perf_counter() - t:.1f}s)")
    eng.scheduler.advance_window = one_pass
    same = len({tuple(x["first"]) for x in runs}) == 1 and len({x["output_tokens"] for x in runs}) == 1
    summary = {}
    for name in variants:
        tps = [x["output_tok_per_s"] for x in runs if x["variant"] == name]
        summary[name] = {"median_tok_s": statistics.median(tps), "all": tps}
    ratios = [
        a["output_tok_per_s"] / b["output_tok_per_s"]
        for a, b in zip(
            [x for x in runs if x["variant"] == "one_pass"],
            [x for x in runs if x["variant"] == "per_token"],
            strict=True,
        )
    ]
    summary["one_pass_over_per_token"] = {
        "per_round": [round(x, 4) for x in ratios],
        "median": statistics.median(ratios),
    }
    print(f"one pass / per token, per round: {summary['one_pass_over_per_token']['per_round']}; same tokens: {same}")
    reference = runs[0]["first"]
    for x in runs:  # which runs agree with the first one, token for token (the first prompt's greedy tokens)
        x["same_tokens_as_first_run"] = x.pop("first") == reference
    result = {
        "schema": "kernellab.bench.window_advance_ab/v1",
        "provenance": provenance(args.device),
        "engine": dict(cfg),
        "workload": "nano-vllm 256 prompts (100-1024 tokens, as many out), greedy, ignore_eos",
        "same_tokens": same,
        "runs": runs,
        "summary": summary,
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "window_advance_ab.json").write_text(json.dumps(result, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
