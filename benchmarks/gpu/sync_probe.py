#!/usr/bin/env python3
"""Where a step waits for the device before its sampled tokens: each engine step of the serving benchmark's
workloads (nano-vllm's 256 prompts, 64 × 512-token interactive prompts) run in process with PyTorch's sync debug
mode on, recording every synchronizing CUDA call (its kernellab stack and when in the step it came), the step's
launch / device-wait split (runtime/host_gate.py) and the caching allocator's counters (device allocations,
frees, retries), then a profiler pass over the first steps that counts the CUDA runtime calls by name.

    PYTHONPATH=. python3 benchmarks/gpu/sync_probe.py --out "$OUT"   # on the device machine

Random weights of the exact Qwen3-0.6B shape, the serving benchmark's h200 EngineConfig.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch

ALLOC_KEYS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


def _stack() -> str:
    frames = [f for f in traceback.extract_stack()[:-2] if "kernellab" in f.filename and "sync_probe" not in f.filename]
    return " < ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames[-6:]))


SIZES = {"cuda": (256, 100, 1024, 64, 512), "cpu": (12, 8, 40, 6, 48)}  # nano-vllm seqs, min, max; clients, prompt


def _requests(name: str, device: str) -> list[tuple[list[int], int]]:
    import random

    from kernellab.bench.workloads import nanovllm

    seqs, lo, hi, clients, prompt = SIZES[device]
    if name == "nanovllm":
        prompts, outs = nanovllm(seqs, lo, hi)
        return [(p, min(n, 96)) for p, n in zip(prompts, outs, strict=True)]
    rng = random.Random(7)
    return [([rng.randint(0, 10000) for _ in range(prompt)], 128) for _ in range(clients)]


def _stats() -> dict:
    return torch.cuda.memory_stats() if torch.cuda.is_available() else {}


def _sync_debug(mode: int) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode(mode)


_MARK = iter(range(20000, 1 << 30))  # a first token unique to each run: no prefix-cache hits between runs


def _add(engine, name: str, tag: str) -> None:
    from kernellab.runtime.request.sampling import SamplingParams

    mark = next(_MARK)
    for i, (prompt, n) in enumerate(_requests(name, engine.runner.device.type)):
        engine.add_request(
            f"{tag}-{i}", [mark, *prompt[1:]], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        )


def run(engine, name: str, tag: str, trace_steps: int) -> list[dict]:
    gate = engine.host_gate
    _add(engine, name, tag)
    steps: list[dict] = []
    syncs: list[tuple[float, str]] = []
    t_step = [0.0]

    def seen(message, category, filename, lineno, file=None, line=None):
        syncs.append((time.perf_counter() - t_step[0], _stack()))

    try:
        with warnings.catch_warnings():  # restores showwarning on the way out
            warnings.simplefilter("always")
            warnings.showwarning = seen
            while engine.has_unfinished_requests():
                traced = len(steps) < trace_steps
                _sync_debug(1 if traced else 0)
                before = _stats()
                syncs.clear()
                if gate is not None:
                    gate.host()
                t_step[0] = time.perf_counter()
                engine.step()
                dt = time.perf_counter() - t_step[0]
                launch, wait = None, 0.0
                if gate is not None:
                    launch, wait = gate.launch_s, gate.wait_s
                    gate.idle()
                _sync_debug(0)
                if not traced:
                    continue
                after = _stats()
                rows, tokens = engine.last_schedule
                steps.append(
                    {
                        "rows": rows,
                        "tokens": tokens,
                        "dt_ms": round(dt * 1e3, 2),
                        "launch_ms": None if launch is None else round(launch * 1e3, 2),
                        "wait_ms": round(wait * 1e3, 2),
                        "syncs": [(round(t * 1e3, 2), s) for t, s in syncs],
                        "alloc": {k: after.get(k, 0) - before.get(k, 0) for k in ALLOC_KEYS},
                        "reserved_mib": round(after.get("reserved_bytes.all.current", 0) / 2**20),
                    }
                )
    finally:
        _sync_debug(0)
    return steps


def profile_steps(engine, name: str, n_steps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    _add(engine, name, "prof")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        for _ in range(n_steps):
            engine.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.loads(Path(f.name).read_text())["traceEvents"]
    while engine.has_unfinished_requests():
        engine.step()
    calls, dur = Counter(), Counter()
    for e in events:
        if e.get("cat") == "cuda_runtime" and "dur" in e:
            calls[e["name"]] += 1
            dur[e["name"]] += e["dur"]
    # the longest runtime calls (a host blocked on the device: a sync, a synchronous copy, cudaFree) and the
    # kernellab Python frames around them
    py = [e for e in events if e.get("cat") == "python_function" and "dur" in e and "kernellab" in e.get("name", "")]
    slow = sorted(
        (e for e in events if e.get("cat") == "cuda_runtime" and e.get("dur", 0) > 500), key=lambda e: -e["dur"]
    )[:12]
    longest = []
    for e in slow:
        around = [p for p in py if p["ts"] <= e["ts"] and p["ts"] + p["dur"] >= e["ts"] + e["dur"]]
        around.sort(key=lambda p: -p["ts"])  # innermost first
        longest.append({"call": e["name"], "ms": round(e["dur"] / 1e3, 2), "in": [p["name"] for p in around[:6]]})
    return {
        "calls": {
            name: {"calls": calls[name], "total_ms": round(dur[name] / 1e3, 2)} for name, _ in dur.most_common(15)
        },
        "longest": longest,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--trace-steps", type=int, default=14)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))  # cpu: a rehearsal with tiny-qwen3
    args = ap.parse_args()
    from kernellab.bench.synthetic import write_checkpoint
    from kernellab.results import provenance
    from kernellab.runtime.config import EngineConfig
    from kernellab.runtime.engine import LLMEngine

    model_dir = Path(tempfile.mkdtemp(prefix="probe-")) / "model"
    gpu = args.device == "cuda"
    write_checkpoint(model_dir, "qwen3-0.6b" if gpu else "tiny-qwen3", device=args.device)
    cfg = dict(
        model=str(model_dir),
        device=args.device,
        dtype="bfloat16" if gpu else "float32",
        max_num_seqs=256 if gpu else 16,
        max_num_batched_tokens=16384 if gpu else 512,
        max_model_len=4096 if gpu else 512,
        num_kv_blocks=20480 if gpu else 256,
    )
    engine = LLMEngine(EngineConfig(**cfg))
    result: dict = {"schema": "kernellab.bench.sync_probe/v1", "engine": cfg, "provenance": provenance(args.device)}
    for name in ("nanovllm", "interactive"):
        run(engine, name, f"warm-{name}", 0)
        steps = run(engine, name, f"probe-{name}", args.trace_steps)
        result[name] = steps
        print(f"== {name}: rows tokens dt launch wait | syncs after 1 ms | device allocs/frees/retries")
        for s in steps:
            late = [f"{t}ms {where}" for t, where in s["syncs"] if t > 1.0]
            a = s["alloc"]
            print(
                f"{s['rows']:4d} {s['tokens']:6d} {s['dt_ms']:7.2f} {s['launch_ms']!s:>7} {s['wait_ms']:6.2f} | "
                f"{len(s['syncs'])} syncs | {a['num_device_alloc']}/{a['num_device_free']}/{a['num_alloc_retries']}"
            )
            for line in late[:4]:
                print("      ", line[:220])
    result["profile_nanovllm_first_steps"] = profile_steps(engine, "nanovllm", 10)
    print("== CUDA runtime calls, nano-vllm's first 10 steps:")
    for k, v in result["profile_nanovllm_first_steps"]["calls"].items():
        print(f"  {k:40s} {v['calls']:6d} {v['total_ms']:9.2f} ms")
    for e in result["profile_nanovllm_first_steps"]["longest"]:
        print(f"  {e['ms']:8.2f} ms {e['call']} in {' < '.join(e['in'])[:200]}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "sync_probe.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
