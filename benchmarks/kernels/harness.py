"""Benchmark harness for the kernel lab: ceilings, CUDA-graph timing, provenance, JSON artifact, table.

Method (see /docs/kernels.md "How the numbers are taken"):
- Every case is timed from CUDA-graph replays of many back-to-back calls, so a call costs its GPU time plus
  the launch gap, not Python's launch overhead; the median of 5 replays is reported. Where a function cannot
  be captured (host syncs in a reference), the same calls are timed on a plain stream ("method": "stream").
- Inputs rotate over enough independent sets to cover ≥ 256 MB, so a call cannot be served from the 60 MB L2.
- Bandwidth kernels report GB/s from an explicit byte formula (each case's ``bytes``: every input read once,
  every output written once) and their percentage of the **read-only reduction bandwidth measured in the same
  run**; compute kernels report TFLOP/s against the bf16 matmul measured in the same run.
- The Triton kernel, the eager PyTorch reference and ``torch.compile`` of that reference run on the same inputs
  in the same process; correctness compares the Triton output to the eager reference on fresh random inputs.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

REPO = Path(__file__).resolve().parents[2]
SCHEMA = "kernellab.kernels/v1"
ROTATE_BYTES = 256 * 2**20
MAX_SETS = 32


@dataclass
class Case:
    """One benchmark row. ``make()`` returns a fresh tuple of arguments for one input set."""

    kernel: str
    shape: str
    dtype: str
    make: Callable[[], tuple]
    triton_fn: Callable[..., Any]
    torch_fn: Callable[..., Any] | None
    bytes: int | None = None  # bytes moved by one call (reads + writes), for bandwidth kernels
    flops: int | None = None  # FLOPs of one call, for compute kernels
    atol: float = 2e-2
    rtol: float = 2e-2
    check: Callable[[tuple], tuple[bool, float]] | None = None  # custom check (mutating ops)
    variant: str = "default"
    target_pct: float | None = None
    teaching: bool = False
    compile_ref: bool = True
    ref_graph: bool = True  # False: the reference syncs the host, so it is timed on a stream, never captured
    notes: str = ""
    group: str = ""  # chapter (module) name, for the docs

    @property
    def footprint(self) -> int:
        return self.bytes or 0


def _compare(out, ref, atol, rtol) -> tuple[bool, float]:
    if isinstance(out, (tuple, list)):
        results = [_compare(o, r, atol, rtol) for o, r in zip(out, ref, strict=True)]
        return all(ok for ok, _ in results), max(err for _, err in results)
    if out.dtype in (torch.int64, torch.int32):
        return bool(torch.equal(out, ref)), float((out != ref).sum())
    a, e = out.double(), ref.double()
    if torch.isnan(a).any():
        return False, float("nan")
    err = float((a - e).abs().max()) if a.numel() else 0.0
    return bool(((a - e).abs() <= atol + rtol * e.abs()).all()), err


class Timer:
    """CUDA-graph (or stream) timing of one function over rotating input sets; wall clock on the CPU."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"

    def _events(self, fn, sets, calls) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(calls):
            fn(*sets[i % len(sets)])
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / calls

    def time_us(self, fn, sets, target_ms: float = 2.0, graph: bool = True) -> tuple[float, str, float]:
        """(median µs per call, method, relative spread of the 5 repeats)."""
        if not self.cuda:
            t0 = time.perf_counter()
            for s in sets[:2]:
                fn(*s)
            return (time.perf_counter() - t0) * 1e6 / min(2, len(sets)), "wall", 0.0
        for s in sets[:2]:
            fn(*s)
        torch.cuda.synchronize()
        est = self._events(fn, sets, max(len(sets), 4))
        calls = int(min(4000, max(len(sets), math.ceil(target_ms * 1e3 / max(est, 0.5)))))
        calls = math.ceil(calls / len(sets)) * len(sets)
        times, method = None, "stream"
        if graph:
            try:
                times = self._graph(fn, sets, calls)
                method = "graph"
            except Exception as exc:  # host syncs or allocations that capture rejects
                print(f"  (graph capture failed, timing on a stream: {type(exc).__name__})", flush=True)
                torch.cuda.synchronize()
        if times is None:
            times = [self._events(fn, sets, calls) for _ in range(5)]
        med = statistics.median(times)
        return med, method, (max(times) - min(times)) / med if med else 0.0

    def _graph(self, fn, sets, calls) -> list[float]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for s in sets[:3]:
                fn(*s)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                fn(*sets[i % len(sets)])
        graph.replay()
        torch.cuda.synchronize()
        out = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) * 1e3 / calls)
        del graph
        return out


# ------------------------------------------------------------------------------------------------ ceilings


def measure_ceilings(device: str) -> dict[str, Any]:
    """Copy (read + write), read-only reduction, and bf16 matmul ceilings, measured now on this device."""
    if device != "cuda":
        return {"copy_gbps": None, "read_gbps": None, "matmul_tflops": None, "note": "CPU smoke run"}
    timer = Timer(device)
    copy_gbps = _copy_gbps(timer)
    read_torch, read_triton = _read_gbps(timer)
    return {
        "copy_gbps": round(copy_gbps, 1),
        "read_gbps": round(max(read_torch, read_triton or 0.0), 1),
        "read_gbps_torch_sum": round(read_torch, 1),
        "read_gbps_triton": round(read_triton, 1) if read_triton else None,
        "matmul_tflops": round(_matmul_tflops(timer), 1),
        "how": "copy: 1 GiB, best of copy_ on a stream and a Triton copy kernel, bytes = read + write; read: "
        "1 GiB fp32 reduction, best of torch.sum and a Triton streaming sum; matmul: 8192³ bf16 "
        "torch.matmul on random data",
    }


def _copy_gbps(timer: Timer) -> float:
    """Best of ``copy_`` on a stream and a Triton copy kernel in a graph (a captured ``copy_`` becomes a
    memcpy node served by the copy engines, ~2.8 TB/s on the H200, not the SMs)."""
    src = torch.randn(2**28, device="cuda", dtype=torch.float32)  # 1 GiB
    dst = torch.empty_like(src)
    torch_us, _, _ = timer.time_us(lambda: dst.copy_(src), [()], target_ms=20, graph=False)
    n, block = src.numel(), 4096
    triton_us, _, _ = timer.time_us(
        lambda: _copy_kernel[(triton.cdiv(n, block),)](src, dst, n, BLOCK=block, num_warps=8), [()], target_ms=20
    )
    return 2 * src.nbytes / min(torch_us, triton_us) / 1e3


def _read_gbps(timer: Timer) -> tuple[float, float | None]:
    x = torch.randn(2**28, device="cuda", dtype=torch.float32)  # 1 GiB
    us, _, _ = timer.time_us(lambda: torch.sum(x), [()], target_ms=20)
    triton_us = _triton_read_us(x, timer)
    return x.nbytes / us / 1e3, (x.nbytes / triton_us / 1e3 if triton_us else None)


def _matmul_tflops(timer: Timer) -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    us, _, _ = timer.time_us(lambda: a @ b, [()], target_ms=50)
    return 2 * 8192**3 / us / 1e6


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Streaming read ceiling: each program sums ITERS·BLOCK fp32 values and writes one partial."""
    pid = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in tl.static_range(ITERS):
        offs = (pid * ITERS + i) * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def _triton_read_us(x: torch.Tensor, timer: Timer) -> float | None:
    try:
        block, iters = 2048, 8
        grid = triton.cdiv(x.numel(), block * iters)
        out = torch.empty(grid, device=x.device, dtype=torch.float32)
        us, _, _ = timer.time_us(
            lambda: _read_kernel[(grid,)](x, out, x.numel(), BLOCK=block, ITERS=iters, num_warps=8), [()], target_ms=20
        )
        return us
    except Exception as exc:  # the ceiling then falls back to torch.sum alone
        print(f"triton read ceiling failed: {exc!r}", file=sys.stderr)
        return None


# ------------------------------------------------------------------------------------------------ running


def n_sets_for(case: Case, device: str) -> int:
    if device != "cuda":
        return 1
    return max(1, min(MAX_SETS, math.ceil(ROTATE_BYTES / max(case.footprint, 1))))


class Runner:
    """Runs cases in order within a wall-clock budget and keeps the artifact on disk after each one."""

    def __init__(self, device: str, out_path: Path | None, budget_s: float, compile_budget_s: float):
        self.device = device
        self.timer = Timer(device)
        self.out_path = out_path
        self.t0 = time.monotonic()
        self.budget_s = budget_s
        self.compile_budget_s = compile_budget_s
        self.compile_spent = 0.0
        self.ceilings = measure_ceilings(device)
        self.results: list[dict[str, Any]] = []
        self.provenance = provenance()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def run(self, case: Case) -> dict[str, Any] | None:
        if self.elapsed() > self.budget_s:
            print(f"[skip: budget] {case.kernel} {case.shape} {case.variant}", flush=True)
            return None
        row = {
            "kernel": case.kernel,
            "group": case.group,
            "variant": case.variant,
            "shape": case.shape,
            "dtype": case.dtype,
            "bytes": case.bytes,
            "flops": case.flops,
            "target_pct": case.target_pct,
            "teaching": case.teaching,
            "notes": case.notes,
        }
        try:
            row.update(self._run(case))
        except Exception as exc:
            row.update({"correct": False, "error": f"{type(exc).__name__}: {exc}"[:500], "time_us": None})
        torch.cuda.empty_cache() if self.device == "cuda" else None
        self.results.append(row)
        self.save()
        print(_line(row), flush=True)
        return row

    def _run(self, case: Case) -> dict[str, Any]:
        torch.manual_seed(len(self.results))
        sets = [case.make() for _ in range(n_sets_for(case, self.device))]
        args = sets[0]
        if case.check is not None:
            correct, err = case.check(args)
        else:
            out = case.triton_fn(*args)
            ref = case.torch_fn(*args)
            correct, err = _compare(out, ref, case.atol, case.rtol)
        t_us, method, spread = self.timer.time_us(case.triton_fn, sets)
        res: dict[str, Any] = {
            "time_us": round(t_us, 3),
            "method": method,
            "spread": round(spread, 3),
            "correct": correct,
            "max_abs_err": err,
            "n_input_sets": len(sets),
        }
        if case.bytes:
            gbps = case.bytes / t_us / 1e3
            res["gbps"] = round(gbps, 1)
            if self.ceilings.get("read_gbps"):
                res["pct_of_ceiling"] = round(100 * gbps / self.ceilings["read_gbps"], 1)
                res["ceiling"] = "read_gbps"
        if case.flops:
            tflops = case.flops / t_us / 1e6
            res["tflops"] = round(tflops, 2)
            if self.ceilings.get("matmul_tflops") and not case.bytes:
                res["pct_of_ceiling"] = round(100 * tflops / self.ceilings["matmul_tflops"], 1)
                res["ceiling"] = "matmul_tflops"
        if case.target_pct is not None and "pct_of_ceiling" in res:
            res["meets_target"] = res["pct_of_ceiling"] >= case.target_pct
        if case.torch_fn is not None and case.variant == "default":
            eager_us, eager_method, _ = self.timer.time_us(case.torch_fn, sets, graph=case.ref_graph)
            res["torch_eager_us"] = round(eager_us, 3)
            res["torch_eager_method"] = eager_method
            res["speedup_vs_eager"] = round(eager_us / t_us, 2)
            if case.compile_ref and self.device == "cuda":
                res.update(self._compiled(case, sets, t_us))
        return res

    def _compiled(self, case: Case, sets, t_us) -> dict[str, Any]:
        if self.compile_spent > self.compile_budget_s or self.elapsed() > 0.8 * self.budget_s:
            return {"torch_compile_us": None, "torch_compile_note": "skipped: compile budget spent"}
        t0 = time.monotonic()
        try:
            compiled = torch.compile(case.torch_fn, dynamic=False)
            compiled(*sets[0])
            torch.cuda.synchronize()
            self.compile_spent += time.monotonic() - t0
            us, method, _ = self.timer.time_us(compiled, sets, graph=case.ref_graph)
            return {
                "torch_compile_us": round(us, 3),
                "torch_compile_method": method,
                "speedup_vs_compile": round(us / t_us, 2),
            }
        except Exception as exc:
            self.compile_spent += time.monotonic() - t0
            return {"torch_compile_us": None, "torch_compile_note": f"{type(exc).__name__}: {exc}"[:300]}

    def save(self) -> None:
        if self.out_path is None:
            return
        doc = {"schema": SCHEMA, "provenance": self.provenance, "ceilings": self.ceilings, "results": self.results}
        tmp = self.out_path.with_suffix(".tmp")
        tmp.write_text(dumps(doc))
        tmp.replace(self.out_path)


def _finite(o):
    """NaN/inf → null, recursively: the artifact must be strict JSON."""
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


def dumps(doc) -> str:
    return json.dumps(_finite(doc), indent=1, default=str, allow_nan=False)


def _commit() -> str:
    if os.environ.get("KL_COMMIT"):
        return os.environ["KL_COMMIT"]
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
            ).stdout.strip()
            or "unknown"
        )
    except Exception:
        return "unknown"


def provenance() -> dict[str, Any]:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cuda = torch.cuda.is_available()
    return {
        "gpu": torch.cuda.get_device_name() if cuda else "cpu",
        "sm_count": torch.cuda.get_device_properties(0).multi_processor_count if cuda else None,
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "commit": _commit(),
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
    }


# ------------------------------------------------------------------------------------------------ table


def _fmt(v, spec="{:.1f}") -> str:
    return "-" if v is None else spec.format(v)


def _line(r: dict[str, Any]) -> str:
    rate = f"{_fmt(r.get('gbps'), '{:.0f}')} GB/s" if r.get("gbps") else f"{_fmt(r.get('tflops'))} TF/s"
    return (
        f"{r['kernel']:<22} {r['variant']:<16} {r['shape']:<28} {_fmt(r.get('time_us'), '{:.2f}'):>9} us "
        f"{rate:>12} {_fmt(r.get('pct_of_ceiling')):>6}% eager {_fmt(r.get('torch_eager_us'), '{:.2f}'):>8} "
        f"compile {_fmt(r.get('torch_compile_us'), '{:.2f}'):>8} ok={r.get('correct')}"
        + (f" ERROR {r['error']}" if r.get("error") else "")
    )


def table(results: list[dict[str, Any]], ceilings: dict[str, Any], defaults_only: bool = True) -> str:
    head = (
        f"ceilings: copy {ceilings.get('copy_gbps')} GB/s, read {ceilings.get('read_gbps')} GB/s, "
        f"bf16 matmul {ceilings.get('matmul_tflops')} TFLOP/s"
    )
    lines = [
        head,
        f"{'kernel':<22} {'shape':<28} {'us':>8} {'rate':>11} {'%ceil':>6} {'target':>6} "
        f"{'x eager':>7} {'x comp':>7} ok",
    ]
    for r in results:
        if defaults_only and r["variant"] != "default":
            continue
        rate = f"{_fmt(r.get('gbps'), '{:.0f}')}GB/s" if r.get("gbps") else f"{_fmt(r.get('tflops'))}TF/s"
        tgt = "" if r.get("target_pct") is None else ("MET" if r.get("meets_target") else "MISS")
        lines.append(
            f"{r['kernel']:<22} {r['shape']:<28} {_fmt(r.get('time_us'), '{:.2f}'):>8} {rate:>11} "
            f"{_fmt(r.get('pct_of_ceiling')):>6} {tgt:>6} {_fmt(r.get('speedup_vs_eager'), '{:.2f}'):>7} "
            f"{_fmt(r.get('speedup_vs_compile'), '{:.2f}'):>7} {'Y' if r.get('correct') else 'N'}"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ shapes

# Qwen3-0.6B: hidden 1024, 16 query / 8 KV heads, head_dim 128, intermediate 3072, vocabulary 151,936.
HIDDEN, HQ, HK, HEAD_DIM, INTER, VOCAB = 1024, 16, 8, 128, 3072, 151936
PREFILL_T = 4096
EPS = 1e-6


def randn(*shape, device, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, device=device, dtype=torch.float32) * scale).to(dtype)


def main_for(cases_fn, argv=None) -> None:
    """Entry point of one bench module: ``python -m benchmarks.kernels.bench_x [--smoke] [--out FILE]``."""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--budget", type=float, default=600.0)
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if device == "cpu":  # the smoke run executes the kernels on Triton's interpreter
        from kernellab.kernels.testing import patch_interpreter

        patch_interpreter()
    runner = Runner(device, args.out, args.budget, compile_budget_s=args.budget / 3)
    for case in cases_fn(device, real=device == "cuda"):
        runner.run(case)
    print(table(runner.results, runner.ceilings, defaults_only=False))
