"""Run every kernel benchmark in one process: targets first, then the other real shapes, then the sweeps.

``python -m benchmarks.kernels.run_all --out results.json [--budget 240] [--smoke]``
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import torch

from .harness import Case, Runner, table

MODULES = [
    "bench_rms_norm",
    "bench_attention",
    "bench_gemv",
    "bench_vector_add",
    "bench_rope",
    "bench_swiglu_softmax",
    "bench_argmax",
    "bench_gemm",
]


def collect(device: str, real: bool) -> list[Case]:
    cases: list[Case] = []
    for name in MODULES:
        cases += importlib.import_module(f".{name}", __package__).cases(device, real)
    targets = [c for c in cases if c.variant == "default" and c.target_pct is not None]
    defaults = [c for c in cases if c.variant == "default" and c.target_pct is None]
    variants = [c for c in cases if c.variant != "default"]
    return targets + defaults + variants


def run(out: Path | None, budget_s: float, compile_budget_s: float, smoke: bool) -> Runner:
    device = "cuda" if torch.cuda.is_available() and not smoke else "cpu"
    if device == "cpu":  # the smoke run executes the kernels on Triton's interpreter
        from kernellab.kernels.testing import patch_interpreter

        patch_interpreter()
    runner = Runner(device, out, budget_s, compile_budget_s)
    for case in collect(device, real=device == "cuda"):
        runner.run(case)
    return runner


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--budget", type=float, default=240.0)
    ap.add_argument("--compile-budget", type=float, default=80.0)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    runner = run(args.out, args.budget, args.compile_budget, args.smoke)
    print(table(runner.results, runner.ceilings))


if __name__ == "__main__":
    main()
