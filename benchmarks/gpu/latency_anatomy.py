#!/usr/bin/env python3
"""Where batch-1 latency goes on a GPU: a 2,048-token prompt's time to first token and a batch-1 decode window,
each split into host work before the device starts, the graph launch call, the device's span from its first kernel
to its last, the time kernels actually run (the union of their intervals: PDL chains overlap) and the idle gaps
between them, and what is left after the device finishes (the token's way back, output objects).

    PYTHONPATH=. python3 benchmarks/gpu/latency_anatomy.py --out "$OUT"   # on the device machine

Random weights of the exact Qwen3-0.6B shape, the gate's latency engine (8 sequences, 4,096 context).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import traceback
from pathlib import Path

import torch


def _engine(model: str = "qwen3-0.6b", **kw):
    from kernellab.runtime.config import EngineConfig
    from kernellab.runtime.engine import LLMEngine

    base = dict(
        model=model,
        device="cuda",
        dtype="bfloat16",
        random_weights=True,
        max_model_len=4096,
        max_num_seqs=8,
        max_num_batched_tokens=16384,
        kernels="experimental",  # as the gate's latency section
        num_kv_blocks=4096,
    )
    base.update(kw)
    return LLMEngine(EngineConfig(**base))


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    """Total length (ms) of the union of [start, end) intervals given in µs."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total / 1e3


def trace_anatomy(fn, label: str) -> dict:
    """Run ``fn`` under the profiler and read the timeline: kernels' span, busy time, gaps; graph launch calls."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        wall = time.perf_counter() - t0
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    prof.export_chrome_trace(path)
    events = json.loads(Path(path).read_text())["traceEvents"]
    os.unlink(path)
    kernels = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e.get("cat") == "kernel" and "dur" in e]
    copies = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in ("gpu_memcpy", "gpu_memset")]
    launches = [e for e in events if e.get("cat") == "cuda_runtime" and e.get("name") == "cudaGraphLaunch"]
    syncs = [e for e in events if e.get("cat") == "cuda_runtime" and "Synchronize" in e.get("name", "")]
    if not kernels:
        return {"label": label, "error": "no kernels in the trace"}
    kernels.sort()
    start, end = kernels[0][0], max(k[1] for k in kernels)
    busy = _union_ms([(s, e) for s, e, _ in kernels] + copies)
    gaps = []
    pairs: dict[str, list[float]] = {}  # "previous -> next" kernel: [boundaries, µs idle] (gaps under 100 µs)
    cur, prev = kernels[0][1], kernels[0][2]
    for s, e, name in kernels[1:]:
        gap = max(s - cur, 0.0)
        if s > cur:
            gaps.append((s - cur, name))
        if gap < 100:  # larger ones are the host between two requests, not a boundary inside one
            agg = pairs.setdefault(f"{_short(prev)} -> {_short(name)}", [0, 0.0])
            agg[0] += 1
            agg[1] += gap
        if e >= cur:
            cur, prev = e, name
    gaps.sort(reverse=True)
    first_launch = min((e["ts"] for e in launches), default=None)
    row = {
        "label": label,
        "wall_ms_profiled": round(wall * 1e3, 3),
        "kernels": len(kernels),
        "device_span_ms": round((end - start) / 1e3, 3),
        "device_busy_ms": round(busy, 3),
        "idle_gaps_ms": round(sum(g for g, _ in gaps) / 1e3, 3),
        "gaps_over_5us": sum(1 for g, _ in gaps if g > 5),
        "largest_gaps_us": [[round(g, 1), n[:60]] for g, n in gaps[:6]],
        # where the idle time between kernels sits: each kind of boundary's count, total and mean gap (µs), the
        # costliest first (a PDL-launched kernel that starts before its predecessor ends counts a gap of 0)
        "gaps_by_boundary": [
            {"boundary": k, "count": n, "total_us": round(t, 1), "mean_us": round(t / n, 2)}
            for k, (n, t) in sorted(pairs.items(), key=lambda kv: -kv[1][1])[:16]
        ],
        "graph_launches": len(launches),
        "graph_launch_call_us": [round(e["dur"], 1) for e in launches[:10]],
        "launch_to_first_kernel_us": round(start - first_launch, 1) if first_launch is not None else None,
        "sync_calls": len(syncs),
    }
    return row


def _short(name: str) -> str:
    """A kernel's name without its template arguments and signature (``nvjet_…`` GEMMs keep their tile)."""
    return name.split("(")[0].split("<")[0][:48]


class _Timed:
    """Wraps a callable and keeps the host time of each call."""

    def __init__(self, fn):
        self.fn, self.times = fn, []

    def __call__(self, *a, **kw):
        t = time.perf_counter()
        try:
            return self.fn(*a, **kw)
        finally:
            self.times.append(time.perf_counter() - t)


def ttft_parts(eng, prompt_len: int, reps: int = 12) -> dict:
    """One fresh prompt of ``prompt_len`` tokens at a time: wall time from add_request to the token, and the host
    time of add_request, schedule and the graph replay call; the device time of the replay from CUDA events."""
    from kernellab.runtime.request.sampling import SamplingParams

    runner = eng.runner
    gen = torch.Generator().manual_seed(3)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    sched, replay = _Timed(eng.scheduler.schedule), _Timed(runner.graphs.prefill)
    eng.scheduler.schedule, runner.graphs.prefill = sched, replay
    gpu_ms, wall, add, sched_s, replay_s = [], [], [], [], []
    try:
        for i in range(reps + 2):
            prompt = torch.randint(0, 10000, (prompt_len,), generator=gen).tolist()
            sched.times.clear()
            replay.times.clear()
            torch.cuda.synchronize()
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            eng.add_request(f"anat{i}", prompt, params)
            t1 = time.perf_counter()
            start.record()
            while eng.has_unfinished_requests():
                eng.step()
            stop.record()
            t2 = time.perf_counter()
            stop.synchronize()
            if i >= 2:
                wall.append(t2 - t0)
                add.append(t1 - t0)
                gpu_ms.append(start.elapsed_time(stop))
                sched_s.append(sum(sched.times))
                replay_s.append(sum(replay.times))
    finally:
        eng.scheduler.schedule, runner.graphs.prefill = sched.fn, replay.fn
    med = statistics.median
    return {
        "prompt_tokens": prompt_len,
        "wall_ms_p50": round(med(wall) * 1e3, 3),
        "add_request_ms_p50": round(med(add) * 1e3, 3),
        "schedule_ms_p50": round(med(sched_s) * 1e3, 3),
        "replay_call_ms_p50": round(med(replay_s) * 1e3, 3),
        "events_span_ms_p50": round(med(gpu_ms), 3),
    }


class _Stamped:
    """Wraps a callable: appends ``(label + ">", host time)`` on entry and ``(label + "<", host time)`` on return to
    ``stamps``; with ``events``, a CUDA event is recorded at each as well (what the device has reached by then)."""

    def __init__(self, fn, label: str, stamps: list, events: bool = False):
        self.fn, self.label, self.stamps, self.events = fn, label, stamps, events

    def _stamp(self, tag: str) -> None:
        ev = None
        if self.events:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
        self.stamps.append((self.label + tag, time.perf_counter(), ev))

    def __call__(self, *a, **kw):
        self._stamp(">")
        try:
            return self.fn(*a, **kw)
        finally:
            self._stamp("<")


def ttft_timeline(eng, prompt_len: int, reps: int = 12) -> dict:
    """One fresh prompt of ``prompt_len`` tokens, stamped through the engine's path: host time (µs from the
    add_request call) at entry (``>``) and return (``<``) of add_request, schedule, the runner's execute, the graph
    replay's input fill, the replay call itself, the sampler and its argmax launch, the token-advancing step and the
    loop's end; CUDA events around the replay and after the argmax give the device's side: when the graph began
    (the event before the replay completes once the device has run everything queued before it, the input copy),
    when it ended, and when the argmax ended. Medians over ``reps`` requests; what sits between the host's stamp
    before the replay and the device's graph start is the replay call's launch latency, what sits between the
    argmax's end on the device and the sampler's return is the token's way back."""
    from kernellab.runtime.request.sampling import SamplingParams

    runner, sched = eng.runner, eng.scheduler
    graphs = runner.graphs
    bucket = graphs.prefill_bucket(prompt_len)
    if bucket is None:
        return {"prompt_tokens": prompt_len, "error": "no prefill graph of this length"}
    graph = graphs.graphs[("prefill", bucket)]
    stamps: list = []
    patches = [
        (eng, "add_request", False),
        (sched, "schedule", False),
        (runner, "execute", False),
        (graphs, "prefill", False),
        (graph, "replay", True),
        (runner, "sampler", False),
        (runner.sampler, "argmax", True),
        (eng, "_advance", False),
    ]
    saved = []
    for obj, name, ev in patches:
        fn = getattr(obj, name)
        saved.append((obj, name, name in vars(obj), fn))
        setattr(obj, name, _Stamped(fn, name, stamps, ev))
    gen = torch.Generator().manual_seed(5)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rows: dict[str, list[float]] = {}
    try:
        for i in range(reps + 2):
            prompt = torch.randint(0, 10000, (prompt_len,), generator=gen).tolist()
            torch.cuda.synchronize()
            stamps.clear()
            e0 = torch.cuda.Event(enable_timing=True)
            e0.record()
            t0 = time.perf_counter()
            eng.add_request(f"tl{i}", prompt, params)
            while eng.has_unfinished_requests():
                eng.step()
            t_end = time.perf_counter()
            torch.cuda.synchronize()
            if i < 2:
                continue
            rows.setdefault("loop_end", []).append((t_end - t0) * 1e6)
            seen: dict[str, int] = {}
            for label, t, ev in stamps:
                k = seen[label] = seen.get(label, 0) + 1
                key = label if k == 1 else f"{label}#{k}"
                rows.setdefault(key, []).append((t - t0) * 1e6)
                if ev is not None:
                    rows.setdefault("device:" + key, []).append(e0.elapsed_time(ev) * 1e3)
    finally:
        for obj, name, own, fn in saved:
            if own:
                setattr(obj, name, fn)
            else:
                delattr(obj, name)
    med = {k: round(statistics.median(v), 1) for k, v in rows.items()}
    return {"prompt_tokens": prompt_len, "bucket": bucket, "us_p50": dict(sorted(med.items(), key=lambda kv: kv[1]))}


def replay_only(graphs, key, reps: int = 20) -> dict:
    """A captured graph on its own: the replay call's host time, and wall time to its end from an idle device."""
    graph = graphs.graphs[key]
    calls, walls, gpu = [], [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        graph.replay()
        t1 = time.perf_counter()
        stop.record()
        stop.synchronize()
        t2 = time.perf_counter()
        calls.append(t1 - t0)
        walls.append(t2 - t0)
        gpu.append(start.elapsed_time(stop))
    med = statistics.median
    return {
        "graph": list(key),
        "replay_call_ms_p50": round(med(calls) * 1e3, 3),
        "wall_to_done_ms_p50": round(med(walls) * 1e3, 3),
        "events_ms_p50": round(med(gpu), 3),
    }


def _decode_steps(eng, context: int, tokens: int):
    """A sequence of ``context`` prompt tokens, prefilled now; the returned callable decodes ``tokens`` more."""
    from kernellab.runtime.request.sampling import SamplingParams

    prompt = torch.randint(0, 10000, (context,), generator=torch.Generator().manual_seed(5)).tolist()
    eng.add_request("anat-decode", prompt, SamplingParams(temperature=0.0, max_tokens=tokens + 1, ignore_eos=True))
    eng.step()
    torch.cuda.synchronize()

    def run():
        while eng.has_unfinished_requests():
            eng.step()
        torch.cuda.synchronize()

    return run


def itl_parts(eng, context: int = 128, steps: int = 8, reps: int = 12) -> dict:
    """Batch-1 decode at ``context``, from the graph up: one decode graph replayed back to back (CUDA events), the
    runner's multi-step window called directly (the small copies and argmax between replays, one host sync), and
    the engine's step (scheduling, the window, the tokens' bookkeeping)."""
    from kernellab.runtime.request.sampling import SamplingParams

    runner, graphs = eng.runner, eng.runner.graphs
    prompt = torch.randint(0, 10000, (context,), generator=torch.Generator().manual_seed(7)).tolist()
    eng.add_request("anat-itl", prompt, SamplingParams(temperature=0.0, max_tokens=4 * steps * reps, ignore_eos=True))
    eng.step()  # prefill
    eng.step()  # one window: the decode graph's inputs are this sequence's
    seq = eng.scheduler.running[0]
    torch.cuda.synchronize()
    graph = graphs.graphs[("decode", 1)]
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(64):
        graph.replay()
    stop.record()
    stop.synchronize()
    b2b = start.elapsed_time(stop) / 64
    # the window alone, at the sequence's own position (rewrites the same slots each time)
    pos = seq.num_computed_tokens
    ids, table = [seq.token_ids[pos]], [seq.block_table]
    walls = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graphs.decode_multi(ids, [pos], table, [steps], steps, runner.sampler.argmax)
        walls.append((time.perf_counter() - t0) / steps)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        graphs.decode_multi(ids, [pos], table, [steps], steps, runner.sampler.argmax)
    stop.record()
    stop.synchronize()
    window_pipelined = start.elapsed_time(stop) / (reps * steps)
    engine_steps = []
    while eng.has_unfinished_requests() and len(engine_steps) < reps:
        t0 = time.perf_counter()
        produced = sum(len(o.new_token_ids) for o in eng.step())
        engine_steps.append((time.perf_counter() - t0) / max(produced, 1))
    eng.abort("anat-itl")
    med = statistics.median
    return {
        "context": context,
        "window": steps,
        "graph_back_to_back_ms": round(b2b, 4),
        "window_call_ms_per_token_p50": round(med(walls) * 1e3, 4),
        "window_calls_events_ms_per_token": round(window_pipelined, 4),
        "engine_step_ms_per_token_p50": round(med(engine_steps) * 1e3, 4),
    }


def variant(model: str, min_slice: int, fused: bool = True) -> dict:
    """Batch-1 ITL at contexts 128 and 2,048 with one setting of the decode attention's minimum slice (and with or
    without the fused QK-norm + RoPE + KV write in it), and whether the graph replays decode the same greedy tokens
    as eager single steps."""
    from kernellab.bench.latency import engine_itl
    from kernellab.bench.numerics import graph_equals_eager
    from kernellab.kernels import paged_attention

    default_min_slice = paged_attention.MIN_SLICE_TOKENS
    paged_attention.MIN_SLICE_TOKENS = min_slice  # read at each launch, so before the graphs are captured
    off = () if fused else ("paged_decode_attention_qk_norm_rope",)
    eng = _engine(model, disabled_kernels=off)
    row: dict = {"min_slice": min_slice, "fused_rope_attention": fused}
    for ctx in (128, 2048):
        engine_itl(eng, ctx, new_tokens=16)
        row[f"itl{ctx}_ms_p50"] = round(statistics.median(engine_itl(eng, ctx, new_tokens=96)) * 1e3, 4)
    prompt = torch.randint(0, 10000, (300,), generator=torch.Generator().manual_seed(11)).tolist()
    row["graph_equals_eager"] = graph_equals_eager(eng, [prompt], max_tokens=40)["pass"]
    paged_attention.MIN_SLICE_TOKENS = default_min_slice
    del eng
    torch.cuda.empty_cache()
    return row


def decode_ab(model: str, specs: list[str]) -> list[dict]:
    """The fused decode attention's settings against the unfused ops: batch-1 ITL at 128 and the decode step at 64
    sequences (the gate ablation's throughput batch), one engine per setting. A spec: ``off`` (unfused),
    ``fused`` or ``fused-fma`` (FMA contraction allowed) at every batch, or with ``@N`` only up to N decode rows."""
    from kernellab.bench.latency import engine_decode_step, engine_itl
    from kernellab.kernels import paged_attention
    from kernellab.runtime import model as model_mod

    rows = []
    default_limit = model_mod.FUSED_DECODE_MAX_ROWS
    for spec in specs:
        name, _, limit = spec.partition("@")
        paged_attention.ROPE_FP_FUSION = name == "fused-fma"
        model_mod.FUSED_DECODE_MAX_ROWS = int(limit) if limit else 1 << 30
        off = ("paged_decode_attention_qk_norm_rope",) if name == "off" else ()
        eng = _engine(model, disabled_kernels=off, max_num_seqs=64)
        engine_itl(eng, 128, new_tokens=16)
        itl = statistics.median(engine_itl(eng, 128, new_tokens=96)) * 1e3
        engine_decode_step(eng, 64, new_tokens=32)
        dec = engine_decode_step(eng, 64, new_tokens=128)
        row = {
            "spec": spec,
            "itl128_ms": round(itl, 4),
            "decode64_step_ms": dec["step_ms"],
            "tok_per_s": dec["tok_per_s"],
        }
        print("decode_ab", json.dumps(row), flush=True)
        rows.append(row)
        del eng
        torch.cuda.empty_cache()
    paged_attention.ROPE_FP_FUSION = False
    model_mod.FUSED_DECODE_MAX_ROWS = default_limit
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument(
        "--variants",
        default="",
        help="decode attention minimum slices to sweep, e.g. 64:nofuse,64,256 (nofuse: unfused RoPE)",
    )
    ap.add_argument("--min-slice", type=int, default=0, help="the main engine's decode attention minimum slice")
    ap.add_argument("--decode-ab", default="", help="e.g. off,fused,fused-fma,fused@16 (decode_ab) then stop")
    ap.add_argument("--traces", action="store_true", help="also profiler timelines (they slow what they trace)")
    ap.add_argument("--window16", action="store_true", help="also batch-1 ITL with decode windows of 16")
    args = ap.parse_args()
    from kernellab.bench.latency import engine_itl, engine_ttft
    from kernellab.results import provenance

    report: dict = {"schema": "kernellab.gpu.latency_anatomy/v1", "provenance": provenance("cuda"), "model": args.model}
    report["errors"] = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.decode_ab:
        report["decode_ab"] = decode_ab(args.model, args.decode_ab.split(","))
        (out / f"latency_anatomy_decode_ab_{args.model}.json").write_text(json.dumps(report, indent=2))
        return 0
    if args.variants:
        report["variants"] = []
        for v in args.variants.split(","):
            try:
                ms, _, flag = v.partition(":")
                row = variant(args.model, int(ms), flag != "nofuse")
            except Exception as exc:
                traceback.print_exc()
                row = {"variant": v, "error": repr(exc)}
            print("variant", json.dumps(row), flush=True)
            report["variants"].append(row)
    if args.min_slice:
        from kernellab.kernels import paged_attention

        paged_attention.MIN_SLICE_TOKENS = args.min_slice
    eng = _engine(args.model)
    report["fast_path"] = eng.fast_path
    engine_ttft(eng, 2048, reps=1)
    sections = {
        "ttft2048": lambda: ttft_parts(eng, 2048),
        "ttft32": lambda: ttft_parts(eng, 32),
        "timeline2048": lambda: ttft_timeline(eng, 2048),
        "timeline32": lambda: ttft_timeline(eng, 32),
        "replay_prefill2048": lambda: replay_only(eng.runner.graphs, ("prefill", 2048)),
        "replay_decode1": lambda: replay_only(eng.runner.graphs, ("decode", 1)),
        "itl_parts128": lambda: itl_parts(eng, 128),
        "itl_parts2048": lambda: itl_parts(eng, 2048),
    }
    if args.traces:
        sections["trace_ttft2048"] = lambda: trace_anatomy(lambda: engine_ttft(eng, 2048, reps=1, seed=9), "ttft2048")
        sections["trace_prefill_graph"] = lambda: trace_anatomy(
            lambda: replay_only(eng.runner.graphs, ("prefill", 2048), reps=3), "prefill graph 2048, 3 replays"
        )
        sections["trace_decode_window"] = lambda: trace_anatomy(_decode_steps(eng, 128, 16), "itl128: 16 tokens")
    for name, fn in sections.items():
        try:
            report[name] = fn()
        except Exception as exc:  # keep the other sections' figures
            traceback.print_exc()
            report["errors"].append(f"{name}: {exc!r}")
    if args.window16:
        eng = None
        torch.cuda.empty_cache()
        eng = _engine(args.model, num_scheduler_steps=16)
        engine_itl(eng, 128, new_tokens=16)
        report["itl128_window16_ms_p50"] = round(statistics.median(engine_itl(eng, 128, new_tokens=64)) * 1e3, 3)
    for k, v in report.items():
        if k not in ("provenance",):
            print(k, json.dumps(v))
    (out / f"latency_anatomy_{args.model}.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
