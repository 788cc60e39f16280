#!/usr/bin/env python3
"""A/B of one module-level setting of the engine or its kernels on the complete workload, interleaved rounds.

A "knob" is a module constant read when a CUDA graph is captured (``kernellab.kernels.paged_attention.
MIN_SLICE_TOKENS``, ``kernellab.runtime.model.FUSED_DECODE_MAX_ROWS``, ...): each value gets an engine of its own,
built with the constant set (graphs captured with it), and the rounds alternate the engines' order. Measured:

- batch-1 inter-token latency at each ``--contexts`` (the gate's latency engine: 64 greedy tokens after a random
  prompt of that length);
- with ``--decode-batches``, the decode step at those batch sizes (``engine_decode_step``: 40-token prompts,
  128 tokens each);
- with ``--ttft``, the time to first token of a fresh prompt of each length (``engine_ttft``, median of 10);
- with ``--replay``, the bucket-1 decode graph replayed alone, back to back (``decode_replay_ms@1``: device time a
  replay, stale inputs, no KV write): tells a batch-1 ITL difference on the device from one on the host;
- with ``--offline-blocks N``, the gate's offline workload (nano-vllm's 256 prompts, ``gate_offline_setup``) on a
  second set of engines, one per value, with N KV blocks each (``--offline-kv`` picks their cache dtype), built
  after the first set is freed, in interleaved rounds: the complete workload the kernel-lab rule asks for;
- the greedy tokens of one request must be the same from every engine, and the offline run's first prompt too.

    python3 benchmarks/gpu/knob_ab.py --out "$OUT/knob" \\
        --knob kernellab.kernels.paged_attention.MIN_SLICE_TOKENS --values 64,128 --contexts 128,512,2048
    python3 benchmarks/gpu/knob_ab.py --out "$OUT/launch" --knob kernellab.kernels.paged_attention.LAUNCH --sep ';' \\
        --values '{"block_n": 64, "num_warps": 4, "num_stages": 2}; {"block_n": 32, "num_warps": 4, "num_stages": 3}'
    python3 benchmarks/gpu/knob_ab.py --out "$OUT/op" --knob op:decode_attention_o_proj --values off,on
    python3 benchmarks/gpu/knob_ab.py --out "$OUT/seq" --knob kernellab.kernels.paged_attention.SEQ_MERGE_SLICES \\
        --values 2,16 --disable decode_attention_o_proj   # ops off in every engine
    python3 benchmarks/gpu/knob_ab.py --out "$OUT/widen" --knob kernellab.runtime.model.WIDEN_LOGITS \\
        --values True,False --contexts 128 --offline-blocks 10240 --offline-kv int8   # offline, int8 cache
    python3 benchmarks/gpu/knob_ab.py --out /tmp/knob --device cpu --knob ... --values ...   # the path, on a CPU

``config:FIELD`` builds each engine with that ``EngineConfig`` field at each value (``config:block_size`` with
``16,64``: the KV cache's block size). ``--set MODULE.NAME=LITERAL`` (or ``MODULE.DICT[KEY]=LITERAL``) sets a
constant for every engine, e.g. the int8 cache's descriptor tiles beside a block-size knob:
``--knob config:block_size --values 16,64 --set 'kernellab.kernels.paged_attention.INT8_LAUNCH[tma]=True'``.

``op:NAME`` with values ``off``/``on`` is an op of the dispatcher instead of a constant: "on" builds the engine with
that op allowed as if accepted, "off" with it disabled (``EngineConfig.disabled_kernels``); every other op as the
engine's ``kernels`` level and ``runtime/kernel_status.json`` have it (the gate's engine, experimental ops on).

Random weights of the exact Qwen3-0.6B shape on the GPU; a tiny Qwen3 with torch ops on the CPU (the script's path,
not the knob's effect).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import statistics
import time
from pathlib import Path


def parse_value(text: str):
    """``128`` → 128, ``0.5`` → 0.5, ``True`` → True; anything else stays a string."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--knob", required=True, help="module.CONSTANT, e.g. kernellab.kernels.paged_attention.X")
    ap.add_argument("--values", required=True, help="Python literals separated by --sep")
    ap.add_argument("--sep", default=",", help="the separator of --values (';' for dicts)")
    ap.add_argument("--contexts", default="128,2048", type=lambda s: [int(v) for v in s.split(",")])
    ap.add_argument("--decode-batches", default="", type=lambda s: [int(v) for v in s.split(",") if v])
    ap.add_argument(
        "--ttft", default="", type=lambda s: [int(v) for v in s.split(",") if v], help="prompt lengths: TTFT too"
    )
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument(
        "--model",
        default="",
        help="a registered shape (llama-3.2-1b, smollm2-135m; random weights) instead of the gate's Qwen3-0.6B",
    )
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument(
        "--disable", default="", type=lambda s: tuple(v for v in s.split(",") if v), help="ops off in every engine"
    )
    ap.add_argument(
        "--offline-blocks",
        type=int,
        default=0,
        help="KV blocks of each offline engine: the offline workload too (0: not run; 10,240 fit three H100 engines)",
    )
    ap.add_argument("--replay", action="store_true", help="the bucket-1 decode graph replayed alone too")
    ap.add_argument("--offline-kv", default="auto", help="the offline engines' kv_cache_dtype (auto, int8, fp8)")
    ap.add_argument("--offline-rounds", type=int, default=2)
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="MODULE.NAME=LITERAL",
        help="a module constant (or MODULE.DICT[KEY]) set for every engine, before any is built; repeatable",
    )
    args = ap.parse_args()
    args.values = [parse_value(v.strip()) for v in args.values.split(args.sep)]
    fixed = [apply_setting(text) for text in args.set]
    from kernellab.bench.engine_ab import interleaved_rounds, itl_figures, median_summary, same_greedy_tokens
    from kernellab.bench.latency import engine_decode_step, engine_ttft
    from kernellab.bench.offline import gate_offline_setup
    from kernellab.results import provenance, write
    from kernellab.runtime.config import EngineConfig
    from kernellab.runtime.dispatch import describe_fast_path
    from kernellab.runtime.engine import LLMEngine

    overrides: dict[str, dict] = {}  # config:FIELD: each value's EngineConfig field
    if args.knob.startswith("config:"):  # a field of EngineConfig (block_size, ...), each engine built with its value
        import dataclasses
        import types

        field = args.knob[7:]
        fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
        if field not in fields or field in ("model", "device"):
            raise SystemExit(f"config:FIELD takes a field of EngineConfig, not {field!r}")
        module, const = types.SimpleNamespace(value=None), "value"  # nothing to set at module level
        standing = getattr(EngineConfig(), field)  # resolved (block_size 0 → the default cache's 16)
        standing_note = repr(standing)
        overrides = {repr(v): {field: v} for v in args.values}
        args.values = [(repr(v), v) for v in args.values]
        disabled = {}
    elif args.knob.startswith("op:"):  # an op of the dispatcher, allowed or as its status has it
        from kernellab.runtime import dispatch
        from kernellab.runtime.op_names import REPLACEABLE

        op = args.knob[3:]
        if op not in REPLACEABLE or set(args.values) - {"off", "on"}:
            raise SystemExit(f"op:NAME takes a dispatcher op ({', '.join(REPLACEABLE)}) and the values off,on")
        table = dispatch.load_status()
        allowed = {**table, op: {"status": "accepted"}}
        module, const, standing = dispatch, "load_status", dispatch.load_status
        standing_note = f"{op}: {table.get(op, {}).get('status', 'no status')} in runtime/kernel_status.json"
        args.values = [(v, (lambda t=allowed if v == "on" else table: t)) for v in args.values]
        disabled = {"off": (op,), "on": ()}
    else:
        module_name, _, const = args.knob.rpartition(".")
        module = importlib.import_module(module_name)
        if not hasattr(module, const):
            raise SystemExit(f"{module_name} has no {const}")
        standing = getattr(module, const)
        standing_note = repr(standing)
        args.values = [(repr(v), v) for v in args.values]
        disabled = {}
    if len({name for name, _ in args.values}) != len(args.values) or len(args.values) < 2:
        raise SystemExit("--values needs two or more distinct values")
    gpu = args.device == "cuda"
    cfg, _, _ = gate_offline_setup(args.device)
    if args.model:
        cfg = {**cfg, "model": args.model}
    seqs = max([8, *args.decode_batches])
    eng_cfg = dict(
        cfg, max_num_seqs=seqs, max_model_len=4096 if gpu else 512, num_kv_blocks=max(2048, seqs * 24) if gpu else 256
    )
    engines = {}
    t = time.perf_counter()
    try:
        for name, value in args.values:
            setattr(module, const, value)
            off = tuple(eng_cfg.get("disabled_kernels", ())) + args.disable + disabled.get(name, ())
            engines[name] = LLMEngine(
                EngineConfig(**same_tokens({**eng_cfg, "disabled_kernels": off}, overrides.get(name)))
            )
            if not gpu:
                engines[name].runner.eager_windows(8)
    finally:
        setattr(module, const, standing)
    print(f"{len(engines)} engines ready in {time.perf_counter() - t:.1f}s ({args.knob} = {list(engines)})", flush=True)
    contexts = args.contexts if gpu else [c for c in args.contexts if c < 400] or [64]
    if not gpu:
        args.ttft = [min(n, 256) for n in args.ttft]

    values = dict(args.values)

    def measure(eng) -> dict:
        # the knob at this engine's value while it runs: graphs keep the form they were captured with, but eager
        # steps (prefill, a step no graph holds) read the constant when they run
        setattr(module, const, values[next(n for n, e in engines.items() if e is eng)])
        row = itl_figures(eng, contexts, 64 if gpu else 12)
        if args.replay:
            row["decode_replay_ms@1"] = replay_alone(eng, 200 if gpu else 4)
        for b in args.decode_batches:
            row[f"decode_step_ms@{b}"] = engine_decode_step(eng, b, new_tokens=128 if gpu else 8)["step_ms"]
        for n in args.ttft:
            row[f"ttft_ms_p50@{n}"] = round(statistics.median(engine_ttft(eng, n, reps=10 if gpu else 2)) * 1e3, 4)
        return row

    names = list(engines)
    try:
        runs = interleaved_rounds(engines, args.rounds, "value", measure)
        same = same_greedy_tokens(engines, 96 if gpu else 8)
        fast_path = {name: describe_fast_path(eng.runner.fast_path) for name, eng in engines.items()}
        summary = median_summary(runs, "value", names)
        engines.clear()  # the latency engines' memory, for the offline ones
        offline = offline_rounds(args, module, const, values, disabled, overrides) if args.offline_blocks else None
    finally:
        setattr(module, const, standing)
    print(f"same greedy tokens from every engine: {same}", flush=True)
    if offline is not None:
        same = same and offline["same_first_prompt_tokens"]
    result = {
        "schema": "kernellab.bench.knob_ab/v1",
        "provenance": provenance(args.device),
        "knob": args.knob,
        "standing": standing_note,
        "values": names,
        "engine": eng_cfg,
        "disabled_in_every_engine": list(args.disable),
        "set_in_every_engine": fixed,
        "workload": "one greedy sequence, 64 tokens after a random prompt of each context; decode steps of "
        "40-token prompts × 128 tokens at each batch; TTFT of fresh prompts of each --ttft length; interleaved "
        "rounds, one engine per value",
        "same_tokens": same,
        # what each engine ran on (dispatch.describe_fast_path): a knob that turns a path off shows here
        "fast_path": fast_path,
        "runs": runs,
        "summary": summary,
    }
    if overrides:  # config:FIELD: what each value's engine was built with
        result["engine_per_value"] = {name: same_tokens(eng_cfg, overrides[name]) for name in names}
    if offline is not None:
        result["offline"] = offline
    write(Path(args.out) / "knob_ab.json", result)
    return 0 if same else 1


def apply_setting(text: str) -> str:
    """``--set``: ``pkg.module.NAME=LITERAL`` sets a module constant, ``pkg.module.DICT[KEY]=LITERAL`` one key of a
    module-level dict (``kernellab.kernels.paged_attention.INT8_LAUNCH[tma]=True``); returns the text applied."""
    target, sep, literal = text.partition("=")
    if not sep:
        raise SystemExit(f"--set takes MODULE.NAME=LITERAL, not {text!r}")
    key = None
    if target.endswith("]") and "[" in target:
        target, _, key = target[:-1].partition("[")
    module_name, _, name = target.strip().rpartition(".")
    module = importlib.import_module(module_name)
    if not hasattr(module, name):
        raise SystemExit(f"{module_name} has no {name}")
    value = parse_value(literal.strip())
    if key is None:
        setattr(module, name, value)
    else:
        getattr(module, name)[parse_value(key.strip())] = value
    return text


def same_tokens(cfg: dict, override: dict | None) -> dict:
    """``cfg`` with a config knob's field set; a block size scales the KV pool's block count so that every engine
    holds the same tokens (as many as ``cfg``'s blocks of its own size)."""
    if not override:
        return cfg
    out = {**cfg, **override}
    if "block_size" in override and cfg.get("num_kv_blocks"):
        out["num_kv_blocks"] = max(1, cfg["num_kv_blocks"] * cfg.get("block_size", 16) // override["block_size"])
    return out


def replay_alone(eng, n: int) -> float:
    """ms a replay of the engine's bucket-1 decode graph, ``n`` back to back on its static inputs as the last step
    left them (slots set to -1: the cache is not written), timed on the device (CUDA events; wall time on a CPU)."""
    import torch

    graphs = eng.runner.graphs
    graph = graphs.graphs[("decode", 1)]
    with torch.inference_mode():  # the runner's buffers are inference tensors
        graphs.inputs[2].fill_(-1)
    if not graphs.inputs.is_cuda:
        t = time.perf_counter()
        with torch.inference_mode():
            for _ in range(n):
                graph.replay()
        return round((time.perf_counter() - t) * 1e3 / n, 4)
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    end.synchronize()
    return round(start.elapsed_time(end) / n, 4)


def offline_rounds(args, module, const: str, values: dict, disabled: dict, overrides: dict) -> dict:
    """The offline workload on engines of the gate's offline configuration, one per value (the latency engines
    freed first), ``--offline-rounds`` interleaved rounds; each engine runs with the knob at its value."""
    import gc

    import torch

    from kernellab.bench.engine_ab import interleaved_rounds, median_summary
    from kernellab.bench.offline import gate_offline_setup, run_engine
    from kernellab.runtime.config import EngineConfig
    from kernellab.runtime.engine import LLMEngine

    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    cfg, prompts, outs = gate_offline_setup(
        args.device, kv_cache_dtype=args.offline_kv, num_kv_blocks=args.offline_blocks
    )
    engines = {}
    for name, value in values.items():
        setattr(module, const, value)
        off = tuple(cfg.get("disabled_kernels", ())) + args.disable + disabled.get(name, ())
        engines[name] = LLMEngine(EngineConfig(**same_tokens({**cfg, "disabled_kernels": off}, overrides.get(name))))
    first: dict[str, list[int]] = {}

    def measure(eng) -> dict:
        name = next(n for n, e in engines.items() if e is eng)
        setattr(module, const, values[name])
        if not eng.reset_prefix_cache():
            raise RuntimeError("the engine is not idle between runs")
        run = run_engine(eng, prompts, outs, "nanovllm-256", cfg["dtype"])
        first.setdefault(name, run["first_prompt_token_ids"])
        return {"output_tok_per_s": run["output_tok_per_s"], "seconds": run["seconds"]}

    runs = interleaved_rounds(engines, args.offline_rounds, "value", measure)
    summary = median_summary(runs, "value", list(engines))
    same = len({tuple(t) for t in first.values()}) == 1
    print(f"offline: the same first prompt's tokens from every engine: {same}", flush=True)
    result = {
        "engine": cfg,
        "workload": f"nano-vllm's {len(prompts)} prompts, greedy, ignore_eos, {sum(outs)} output tokens",
        "same_first_prompt_tokens": same,
        "runs": runs,
        "summary": summary,
    }
    engines.clear()
    gc.collect()
    return result


if __name__ == "__main__":
    raise SystemExit(main())
