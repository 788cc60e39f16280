#!/usr/bin/env python3
"""Asynchronous scheduling on and off (``LLMEngine.async_scheduling``: a decode window's next window launched
before its tokens are read), on the same engines, interleaved rounds:

Each on/off pair also at shorter windows: launched ahead, a window no longer needs to be long to hide the host's
turn-around, and an arrival waits for the window in flight and the one launched ahead of it.

- batch-1 inter-token latency at context 128 and 2,048 (the gate's latency engine: 8 sequences, windows of 8);
- the gate's offline workload (nano-vllm's 256 prompts, windows of 16, 256 sequences);
- what it costs an arrival: 32 sequences decode 512 tokens each while single requests of 128 prompt tokens
  arrive one after another (each 0-2 windows after the last one's first token, seeded), time from add_request
  to the arrival's first token;
- greedy tokens identical in every run (the offline runs' first prompt, the latency runs' tokens) and the gate's
  graph == eager check with windows launched ahead (``kernellab.bench.numerics.graph_equals_eager``).

    PYTHONPATH=. python3 benchmarks/gpu/async_scheduling_ab.py --out "$OUT"   # on the device machine
    python3 benchmarks/gpu/async_scheduling_ab.py --out /tmp/ab --device cpu   # a rehearsal of the path

Random weights of the exact Qwen3-0.6B shape on the GPU; on a CPU a tiny Qwen3 with the decode buckets run
eagerly (``ModelRunner.eager_windows``), so the script's path runs, not its effect.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch

# name: (asynchronous scheduling, decode window of the offline engine, of the latency engine). "sync" is the gate's
# setting before asynchronous scheduling; the shorter windows are what an arrival waits for (below).
VARIANTS = {
    "sync": (False, 16, 8),
    "async": (True, 16, 8),
    "async-w8": (True, 8, 4),
    "async-w4": (True, 4, 2),
}


def arrival_ttft(engine, arrivals: int, background: int, seed: int) -> list[float]:
    """Seconds from add_request to the first token of ``arrivals`` single requests (128 random prompt tokens,
    one output token) that arrive while ``background`` greedy sequences decode; each arrives a random 0-2 steps
    after the previous one's first token."""
    from kernellab.runtime.request.sampling import SamplingParams

    rng = random.Random(seed)
    vocab = min(engine.model_config.vocab_size, 10000)
    long = SamplingParams(temperature=0.0, max_tokens=min(512, engine.max_model_len - 40), ignore_eos=True)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for i in range(background):
        engine.add_request(f"bg{i}", [rng.randrange(vocab) for _ in range(40)], long)
    for _ in range(3):  # the background rows prefill and start decoding
        engine.step()
    times: list[float] = []
    pending: tuple[str, float] | None = None
    wait = rng.randint(0, 2)
    n = 0
    while engine.has_unfinished_requests():
        if pending is None and n < arrivals:
            if wait == 0:
                rid = f"arrival{n}"
                n += 1
                pending = (rid, time.perf_counter())
                engine.add_request(rid, [rng.randrange(vocab) for _ in range(128)], one)
            else:
                wait -= 1
        for o in engine.step():
            if pending is not None and o.request_id == pending[0]:
                times.append(time.perf_counter() - pending[1])
                pending, wait = None, rng.randint(0, 2)
        if n >= arrivals and pending is None:
            for i in range(background):
                engine.abort(f"bg{i}")
    while engine.has_unfinished_requests():
        engine.step()
    return times


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = ap.parse_args()
    from kernellab.bench.latency import engine_itl
    from kernellab.bench.numerics import graph_equals_eager
    from kernellab.bench.offline import gate_offline_setup, run_engine
    from kernellab.results import provenance, write
    from kernellab.runtime.config import EngineConfig
    from kernellab.runtime.engine import LLMEngine

    gpu = args.device == "cuda"
    cfg, prompts, outs = gate_offline_setup(args.device)
    # the latency engine first, with a pool of its own size: the offline engine then sizes its pool from what is left
    lat_cfg = dict(cfg, max_num_seqs=8, max_model_len=4096 if gpu else 512, num_scheduler_steps=0, num_kv_blocks=4096)
    if not gpu:
        prompts, outs = prompts[:8], outs[:8]
    t = time.perf_counter()
    latency = LLMEngine(EngineConfig(**lat_cfg))
    offline = LLMEngine(EngineConfig(**cfg))
    if not gpu:
        offline.runner.eager_windows(16)
        latency.runner.eager_windows(8)
    print(f"engines ready in {time.perf_counter() - t:.1f}s", flush=True)
    contexts = (128, 2048) if gpu else (128,)
    runs: list[dict] = []
    names = list(VARIANTS)
    default_windows = offline.runner.max_window, latency.runner.max_window
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            row: dict = {"variant": name, "round": r}
            launch_ahead, offline_window, latency_window = VARIANTS[name]
            for eng, window in ((offline, offline_window), (latency, latency_window)):
                eng.async_scheduling = launch_ahead
                eng.runner.max_window = window
            for ctx in contexts:
                times = engine_itl(latency, ctx, new_tokens=64 if gpu else 24)
                row[f"itl_ms_p50@{ctx}"] = round(statistics.median(times) * 1e3, 4)
                row[f"itl_ms_mean@{ctx}"] = round(statistics.fmean(times) * 1e3, 4)
            arrivals = arrival_ttft(offline, 24 if gpu else 4, 32 if gpu else 4, seed=r)
            row["arrival_ttft_ms_p50"] = round(statistics.median(arrivals) * 1e3, 3)
            row["arrival_ttft_ms_p90"] = round(sorted(arrivals)[int(0.9 * (len(arrivals) - 1))] * 1e3, 3)
            if not offline.reset_prefix_cache():
                raise RuntimeError("the engine is not idle between runs")
            run = run_engine(offline, prompts, outs, "nanovllm-256", cfg["dtype"])
            row.update(
                output_tok_per_s=run["output_tok_per_s"],
                seconds=run["seconds"],
                output_tokens=run["output_tokens"],
                first=run["first_prompt_token_ids"],
            )
            runs.append(row)
            itl = "  ".join(f"ITL@{c} {row[f'itl_ms_p50@{c}']:.3f} ms" for c in contexts)
            print(
                f"round {r} {name:9s} {row['output_tok_per_s']:>9.0f} tok/s  {itl}  "
                f"arrival TTFT p50 {row['arrival_ttft_ms_p50']:.2f} ms",
                flush=True,
            )
    same = len({tuple(x["first"]) for x in runs}) == 1 and len({x["output_tokens"] for x in runs}) == 1
    reference = runs[0]["first"]
    for x in runs:
        x["same_tokens_as_first_run"] = x.pop("first") == reference
    for eng, window in ((offline, default_windows[0]), (latency, default_windows[1])):
        eng.async_scheduling, eng.runner.max_window = True, window  # as built
    g = torch.Generator().manual_seed(3)
    check_prompts = [torch.randint(0, 10000, (int(n),), generator=g).tolist() for n in torch.randint(16, 200, (16,))]
    check = graph_equals_eager(offline, check_prompts, max_tokens=64 if gpu else 12)
    print(f"graph == eager (windows launched ahead, and read first): {check}", flush=True)
    summary: dict = {}
    metrics = ["output_tok_per_s", *(f"itl_ms_p50@{c}" for c in contexts), "arrival_ttft_ms_p50"]
    for m in metrics:
        med = {v: statistics.median([x[m] for x in runs if x["variant"] == v]) for v in VARIANTS}
        summary[m] = {v: round(x, 4) for v, x in med.items()}
        summary[m]["over_sync"] = {v: round(med[v] / med["sync"], 4) for v in VARIANTS if v != "sync"}
    for m, s in summary.items():
        print(f"{m:22s} " + "  ".join(f"{v} {s[v]:.3f}" for v in VARIANTS))
    result = {
        "schema": "kernellab.bench.async_scheduling_ab/v1",
        "provenance": provenance(args.device),
        "engine": {"offline": dict(cfg), "latency": lat_cfg},
        "workload": {
            "offline": "nano-vllm 256 prompts (100-1024 tokens, as many out), greedy, ignore_eos",
            "itl": "one greedy sequence, 64 tokens after a context of 128 / 2,048 random tokens",
            "arrivals": "32 sequences decoding 512 tokens; single 128-token requests arriving 0-2 steps apart",
        },
        "same_tokens": same,
        "graph_equals_eager": check,
        "runs": runs,
        "summary": summary,
    }
    write(Path(args.out) / "async_scheduling_ab.json", result)  # checked against its schema
    return 0 if same and check["pass"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
