"""All GPU kernel tests and kernel benchmarks in one go, for the device machine.

    bash benchmarks/gpu/kernels.sh DIR [--budget SECONDS] [--test-timeout SECONDS]

(the wrapper puts the package, through tests/gpu/shim.sh, and the repo root, for ``benchmarks.kernels``, on
PYTHONPATH, then runs this file with ``--out DIR``).

Writes into DIR (default ``$OUT``, else ``results/kernels/local``): ``kernels_<gpu>.json`` (schema
``kernellab.kernels/v1``: provenance, ceilings, results, gpu_tests), ``gpu_tests.log`` and ``gpu_tests.xml``.
Prints a short table last. Never hangs: the tests run under a timeout and the benchmarks under a wall-clock
budget (cases past it are skipped and say so); no autotuning anywhere.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_tests(out: Path, timeout_s: float, extra: list[str]) -> dict:
    t0 = time.monotonic()
    # xdist spreads Triton's compiles over 4 processes (the GPU has room for all of them); the compiled
    # kernels land in Triton's disk cache, which the benchmarks then reuse.
    parallel = ["-n", "4"] if importlib.util.find_spec("xdist") else []
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "tests/gpu/test_kernels_gpu.py",
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
        "--junitxml",
        str(out / "gpu_tests.xml"),
        *parallel,
        *extra,
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
        log, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        log = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        log += f"\nTIMEOUT after {timeout_s:.0f} s"
        rc = -1
    (out / "gpu_tests.log").write_text(log)
    counts = {k: 0 for k in ("passed", "failed", "skipped", "errors")}
    summary = ""
    for line in log.splitlines()[::-1]:
        if re.search(r"\d+ (passed|failed|skipped|errors?)", line):
            summary = line.strip("= ")
            for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?)", line):
                counts["errors" if kind.startswith("error") else kind] = int(n)
            break
    failures = [ln for ln in log.splitlines() if ln.startswith(("FAILED", "ERROR"))]
    return {
        "returncode": rc,
        **counts,
        "seconds": round(time.monotonic() - t0, 1),
        "summary": summary,
        "failures": failures[:50],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or REPO / "results" / "kernels" / "local"))
    ap.add_argument("--budget", type=float, default=230.0, help="whole-run wall-clock budget (s)")
    ap.add_argument("--test-timeout", type=float, default=100.0)
    ap.add_argument("--compile-budget", type=float, default=45.0)
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("-k", default=None, help="pytest -k filter for the GPU tests")
    args = ap.parse_args()
    t0 = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)

    import torch

    from benchmarks.kernels.harness import dumps, table

    tests = {"skipped_by_flag": True}
    if not args.skip_tests:
        tests = run_tests(args.out, args.test_timeout, ["-k", args.k] if args.k else [])
        print(f"GPU tests: {tests['summary']} in {tests['seconds']} s", flush=True)

    from benchmarks.kernels import run_all

    gpu = torch.cuda.get_device_name().split()[-1].lower() if torch.cuda.is_available() else "cpu"
    path = args.out / f"kernels_{gpu}.json"
    remaining = args.budget - (time.monotonic() - t0)
    try:
        runner = run_all.run(path, remaining, args.compile_budget, smoke=not torch.cuda.is_available())
    except Exception as exc:  # still report the tests
        print(f"benchmarks failed: {type(exc).__name__}: {exc}")
        print(f"GPU tests: {tests.get('summary', 'not run')}")
        raise
    doc = json.loads(path.read_text())
    doc["gpu_tests"] = tests
    doc["run_seconds"] = round(time.monotonic() - t0, 1)
    path.write_text(dumps(doc))

    print()
    print(_sweep_summary(runner.results))
    print(table(runner.results, runner.ceilings))
    print(f"GPU tests: {tests.get('summary', 'not run')}; artifact {path}; {doc['run_seconds']} s")


def _sweep_summary(results: list[dict]) -> str:
    """Best variant per (kernel, shape) next to the default, so the next defaults come from data."""
    lines = ["best variant per shape (sweeps):"]
    by_key: dict[tuple, list[dict]] = {}
    for r in results:
        if r.get("time_us") and r.get("correct"):
            by_key.setdefault((r["kernel"], r["shape"]), []).append(r)
    for (kernel, shape), rows in by_key.items():
        if len(rows) < 2:
            continue
        best = min(rows, key=lambda r: r["time_us"])
        default = next((r for r in rows if r["variant"] == "default"), None)
        d = f"{default['time_us']:.2f}" if default else "-"
        lines.append(f"  {kernel:<22} {shape:<40} default {d:>8} us  best {best['variant']} {best['time_us']:.2f} us")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
