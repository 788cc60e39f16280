#!/usr/bin/env python3
"""Why the gate's latency engine reads a slower TTFT than the anatomy's and the knob A/B's engines.

At 20fe239 on one H200 the gate's latency section measured a 2,048-token prompt's TTFT at 5.356 ms (p50) while
``latency_anatomy.py`` measured 5.087 with the same ``kernels="experimental"`` configuration (at 75f3247: 5.59
against ``knob_ab.py``'s 5.33). The engines differ in where their weights come from (the gate copies an HF
model's state dict, itself left on the GPU; the others draw their own) and in what the process did before. This
script builds, in one process, interleaved in rounds:

- ``hf``: the gate's latency engine (``tests/gpu/run_engine.py: latency``), weights from an HF Qwen3 built with
  ``from_config`` (seed 0, bf16, left alive beside it);
- ``random``: the same ``EngineConfig`` with ``random_weights=True`` (the anatomy's and knob A/B's engines);

and measures each round: the TTFT median of 10 fresh 2,048-token prompts (``engine_ttft``, as the gate), the
prefill graph alone (its 2,048 bucket replayed on its last inputs, CUDA events, median of 10) and the SM clock
the driver reports after them. Same figures, same engines: the weights' source is the cause; a gap that opens
only in the gate's process points at what ran before.

    python3 benchmarks/gpu/ttft_engines_ab.py --out "$OUT/ttft_engines" --rounds 6
    python3 benchmarks/gpu/ttft_engines_ab.py --out /tmp/te --device cpu --rounds 2   # the path, on a CPU
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch


def _sm_clock_mhz() -> int | None:
    """The SM clock the driver reports now (MHz), or None where nvidia-smi does not answer."""
    query = ["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits"]
    try:
        return int(subprocess.check_output(query, text=True, timeout=10).split()[0])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def _graph_ms(eng, bucket: int, reps: int = 10) -> float | None:
    """The whole-step prefill graph of ``bucket`` tokens replayed on its last inputs, CUDA events (ms, median)."""
    graphs = getattr(eng.runner, "graphs", None)
    graph = None if graphs is None else graphs.graphs.get(("prefill", bucket))
    if graph is None or not torch.cuda.is_available():
        return None
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return round(statistics.median(times), 4)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = ap.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    from kernellab.bench.engine_ab import interleaved_rounds, median_summary
    from kernellab.bench.latency import engine_ttft
    from kernellab.results import provenance, write
    from kernellab.runtime.config import EngineConfig
    from kernellab.runtime.engine import LLMEngine
    from kernellab.runtime.request.registry import resolve_model

    gpu = args.device == "cuda"
    model = "qwen3-0.6b"
    if gpu:
        shape = resolve_model(model).hf_config
    else:  # the script's path on a CPU: a tiny Qwen3 checkpoint (the random engine's shape), torch ops, no graphs
        import tempfile

        from kernellab.bench.synthetic import shape_config, write_checkpoint

        model = str(Path(tempfile.mkdtemp()) / "tiny")
        write_checkpoint(Path(model), "tiny-qwen3", device="cpu")
        shape = shape_config("tiny-qwen3")
        args.tokens = min(args.tokens, 64)
    torch.manual_seed(0)
    with torch.device(args.device):
        hf = AutoModelForCausalLM.from_config(
            AutoConfig.for_model(**{"model_type": "qwen3", **shape}), dtype=torch.bfloat16 if gpu else torch.float32
        ).eval()
    weights = list(hf.state_dict().items())
    base = dict(
        model=model,
        device=args.device,
        dtype="bfloat16" if gpu else "float32",
        random_weights=True,
        max_model_len=4096 if gpu else 256,
        max_num_seqs=8,
        max_num_batched_tokens=16384 if gpu else 256,
        kernels="experimental",
        num_kv_blocks=4096 if gpu else 64,
    )
    t = time.perf_counter()
    engines = {
        "hf": LLMEngine(EngineConfig(**base), weights=weights),
        "random": LLMEngine(EngineConfig(**base)),
    }
    print(f"engines ready in {time.perf_counter() - t:.1f}s", flush=True)
    embed = hf.get_input_embeddings().weight
    # which engine holds the HF model's weights (the embedding compared): hf must, random must not
    holds_hf = {
        name: bool(torch.equal(eng.runner.model.model.embed_tokens.weight.to(embed.dtype), embed))
        for name, eng in engines.items()
    }

    def measure(eng) -> dict:
        row = {f"ttft_ms_p50@{args.tokens}": round(statistics.median(engine_ttft(eng, args.tokens)) * 1e3, 4)}
        graph = _graph_ms(eng, args.tokens)
        if graph is not None:
            row[f"prefill_graph_ms@{args.tokens}"] = graph
        clock = _sm_clock_mhz() if gpu else None
        if clock is not None:
            row["sm_clock_mhz"] = float(clock)
        return row

    runs = interleaved_rounds(engines, args.rounds, "engine", measure)
    summary = median_summary(runs, "engine", list(engines))
    result = {
        "schema": "kernellab.bench.ttft_engines_ab/v1",
        "provenance": provenance(args.device),
        "engine": base,
        "engines": {
            "hf": "weights copied from an HF Qwen3 built with from_config (seed 0), the HF model left alive "
            "(tests/gpu/run_engine.py's latency engine)",
            "random": "random_weights=True: the engine draws its own (latency_anatomy.py, knob_ab.py)",
        },
        "workload": f"TTFT of fresh {args.tokens}-token prompts (engine_ttft, median of 10); the prefill graph "
        "replayed alone (CUDA events, median of 10); interleaved rounds",
        "holds_hf_weights": holds_hf,
        "runs": runs,
        "summary": summary,
    }
    write(Path(args.out) / "ttft_engines_ab.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
