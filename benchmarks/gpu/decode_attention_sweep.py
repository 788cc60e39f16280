#!/usr/bin/env python3
"""The paged decode attention on the H200, per KV-cache dtype: launch settings and kernel forms, then the offline
workload with the best of them against the current defaults.

1. Kernel sweep at the gate's shapes (Qwen3-0.6B: 16 query / 8 KV heads, head_dim 128, blocks of 16; batches of
   64-256 at contexts of 384-2,048 and batch 1 at 4,096), for the
   bf16 cache (``LAUNCH``), the FP8 cache (``FP8_LAUNCH``) and the int8 cache (``INT8_LAUNCH``): ``block_n`` ×
   ``num_warps`` × ``num_stages`` × for int8 the form: V dense like K with its tiles widened to fp16 by a
   conversion per value or by byte permutes (``i8_asm``), or V transposed within its blocks (the engine's int8
   layout) into int8 tensor-core dots as stored (``mma``); each checked against the fp32 reference (``ops``;
   over the dequantized cache for 8-bit) and timed with ``triton.testing.do_bench``; GB/s of the bytes each
   must read. (Batch 1 is timed too, but one call there is bound by the host's launch, not the kernel.)
2. Offline nano-vllm workload (256 prompts, greedy, ``ignore_eos``) on engines kept side by side: the bf16 cache
   at ``LAUNCH`` as it stands, the bf16 cache at the sweep's best (when it differs), the int8 cache at its best,
   and the int8 cache as it was before the transposed layout (V dense, widened by byte permutes), in interleaved
   rounds; the launch dicts (and ``ops.INT8_V_TRANSPOSED``) are set before each engine is built (its CUDA graphs
   and its cache keep them) and the launch dicts before each of its runs (eager steps read them at call time).

    export ROOT=$PWD KERNELLAB_COMMIT=<sha>; source benchmarks/gpu/env.sh
    python3 $ROOT/benchmarks/gpu/decode_attention_sweep.py --out "$OUT"          # on the device machine
    python3 benchmarks/gpu/decode_attention_sweep.py --out /tmp/x --device cpu   # rehearsal (interpreter, tiny)

``--packed --int8-forms pack,pack4``: the packed int8 forms (several KV heads a program) at the 256-row cases where
the engine runs them, then the offline workload on each form's best tiles against the current launch (at 82ee2ef it
compared a form with one dot a product, since removed: results/gpu/engine_h200_dev/
decode_attention_sweep_packed_h100_82ee2ef.json).

Before the timed loop, ``--precompile`` child processes (8 on the GPU) compile every setting at the first case's
shapes into Triton's on-disk cache: a packed int8 setting's sm_90 compile takes ~15-18 s, which made a 24-setting
sweep run past a device call's time at 2026-12-07.

Writes ``decode_attention_sweep.json`` after each part (schema kernellab.bench.decode_attention_sweep/v1).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from pathlib import Path

import torch

READ_BW_GBS = 3630.0  # the H200's measured read bandwidth (tests/gpu/run_fp8.py)
# Qwen3-0.6B's attention; the KV block size from --block-size (through the environment: the precompiling children
# import this module afresh)
SHAPE = {"Hq": 16, "Hk": 8, "D": 128, "block_size": int(os.environ.get("KERNELLAB_SWEEP_BLOCK_SIZE", "16"))}
# KERNELLAB_SWEEP_DENSE_SCALES=1: the int8 kernel cases with dense scales instead of the engine's head-major ones
# (ops.scale_zeros), for a side-by-side of the two layouts; read at import, so the precompiling children see it too
DENSE_SCALES = os.environ.get("KERNELLAB_SWEEP_DENSE_SCALES", "0") == "1"
CACHES = ("bf16", "fp8", "int8")
KEYS = (
    "block_n", "num_warps", "num_stages", "widen", "i8_asm", "mma", "pack_heads", "pack_select", "pack_splits", "tma"
)  # fmt: skip
# the int8 forms, as values of FORM_KEYS; with mma (V transposed) the tiles are not widened, so i8_asm stays
FORM_KEYS = ("i8_asm", "mma", "pack_heads", "pack_select", "pack_splits", "tma")
INT8_FORMS = {
    "asm": (True, False, 0, 0, 0, 0),  # V dense like K, widened to fp16 by byte permutes
    "conv": (False, False, 0, 0, 0, 0),  # the same, one conversion per value
    "mma": (True, True, 0, 0, 0, 0),  # V transposed, int8 dots, one KV head a program
    "pack": (True, True, 8, 0, 0, 0),  # the same, up to 8 KV heads a program (paged_attention.heads_per_program)
    "packsel": (True, True, 8, 1, 0, 0),  # the same, every row in each head's dots, the head's rows kept
    "packsel2": (True, True, 8, 2, 0, 0),  # the same, the 16-bit halves summed in the dots (fewer registers)
    "packsel2s3": (True, True, 8, 2, 3, 0),  # in 3 slices a sequence: 768 programs fill two waves of 3 CTAs an SM
    "packsels3": (True, True, 8, 1, 3, 0),  # packsel in 3 slices, likewise
    "packs1": (True, True, 8, 0, 1, 0),  # the masked form in one slice: 256 programs, 0.97 waves of 2 CTAs, no merge
    "packs2": (True, True, 8, 0, 2, 0),  # in 2 slices (below 256 rows the default count may take 3)
    "pack4": (True, True, 4, 0, 0, 0),  # up to 4
    "pack2": (True, True, 2, 0, 0, 0),  # up to 2
    "tma": (True, True, 0, 0, 0, 1),  # int8 dots, one KV head a program, each tile one block copied by TMA
    "tmastack": (True, True, 0, 0, 0, 2),  # the same, q's and P's 16-bit halves stacked as one dot's rows
}


def _cfg_form(cfg: dict) -> tuple:
    """The form of one swept int8 setting, comparable with ``INT8_FORMS``' values (absent keys read as 0)."""
    return tuple(cfg.get(k) or 0 for k in FORM_KEYS)


def _launch_dicts():
    from kernellab.kernels import paged_attention as pa

    return {"bf16": pa.LAUNCH, "fp8": pa.FP8_LAUNCH, "int8": pa.INT8_LAUNCH}


def _apply_launch(cache: str, launch: dict) -> None:
    """The kernels' launch dict of ``cache`` replaced in place by ``launch`` (read at each launch and capture)."""
    d = _launch_dicts()[cache]
    d.clear()
    d.update(launch)


def _case(batch: int, ctx: int, device: str, refs: bool = True) -> dict:
    """Random q and caches of ``batch`` sequences of ``ctx`` tokens in every cache dtype, with the fp32 reference
    outputs (None without ``refs``)."""
    from kernellab.runtime import ops

    Hq, Hk, D, bs = SHAPE["Hq"], SHAPE["Hk"], SHAPE["D"], SHAPE["block_size"]
    nblocks = batch * (ctx // bs)
    gen = torch.Generator(device=device).manual_seed(batch)
    k = torch.randn(nblocks, bs, Hk, D, device=device, generator=gen, dtype=torch.bfloat16)
    v = torch.randn(nblocks, bs, Hk, D, device=device, generator=gen, dtype=torch.bfloat16)
    q = torch.randn(batch, Hq, D, device=device, generator=gen, dtype=torch.bfloat16)
    tables = torch.randperm(nblocks, device=device).to(torch.int32).view(batch, -1)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    c = {"q": q, "tables": tables, "lens": lens, "caches": {}}
    ref = ops.paged_decode_attention(q.float(), k.float(), v.float(), tables, lens, D**-0.5) if refs else None
    c["caches"]["bf16"] = (k, v, {}, ref)
    for name, dtype in (("fp8", ops.FP8_DTYPE), ("int8", ops.INT8_DTYPE)):
        (k8, ks), (v8, vs) = ops.quantize_kv(k, dtype), ops.quantize_kv(v, dtype)
        sc = {"k_scales": ks, "v_scales": vs}
        ref = ops.paged_decode_attention(q, k8, v8, tables, lens, D**-0.5, **sc).float() if refs else None
        c["caches"][name] = (k8, v8, sc, ref)
    # the engine's int8 layout: the same values, V transposed within its blocks (ops.v_cache_zeros) and the scales
    # head-major within them (ops.scale_zeros), unless DENSE_SCALES
    k8, v8, sc, ref = c["caches"]["int8"]
    c["int8_v_t"] = ops.v_cache_zeros(v8.shape, v8.dtype, v8.device).copy_(v8)
    if not DENSE_SCALES:
        sc = {n: ops.scale_zeros(tuple(s.shape), ops.INT8_DTYPE, s.device).copy_(s) for n, s in sc.items()}
        c["caches"]["int8"] = (k8, v8, sc, ref)
    return c


def _kwargs(name: str, cfg: dict, c: dict) -> tuple:
    """The cache tensors and keyword arguments of one setting's launch on case ``c``."""
    k, v, sc, _ = c["caches"][name]
    kw = {k_: cfg[k_] for k_ in ("block_n", "num_warps", "num_stages")}
    if name != "bf16":
        kw["fp8_widen"] = cfg["widen"]
    if name == "int8":
        kw["i8_asm"], kw["i8_mma"], kw["i8_pack_heads"] = cfg["i8_asm"], cfg["mma"], cfg["pack_heads"]
        kw["i8_pack_select"] = int(cfg.get("pack_select") or 0)
        kw["splits"] = cfg.get("pack_splits") or None
        kw["i8_tma"] = int(cfg.get("tma") or 0)  # 2: the halves stacked
        v = c["int8_v_t"] if cfg["mma"] else c["caches"]["int8"][1]
    return k, v, {**sc, **kw}


def _warm(case: tuple[int, int], settings: list[tuple[str, dict]], launch_dicts: dict, device: str) -> int:
    """In a child process: launch each setting once on ``case`` (the timed launches' shapes, so the same
    specialization), filling Triton's on-disk cache for the parent; returns how many launched. (On the CPU: the
    interpreter, nothing to cache; the path only.)"""
    if device == "cpu":
        from kernellab.kernels.testing import patch_interpreter

        patch_interpreter()
    from kernellab.kernels.paged_attention import paged_decode_attention

    for name, launch in launch_dicts.items():  # the parent's dicts (the packed form's row threshold included)
        _apply_launch(name, launch)
    c = _case(*case, device, refs=False)
    done = 0
    for name, cfg in settings:
        k, v, kw = _kwargs(name, cfg, c)
        try:
            paged_decode_attention(c["q"], k, v, c["tables"], c["lens"], SHAPE["D"] ** -0.5, **kw)
            done += 1
        except Exception:  # the parent's own launch records the error
            pass
    if device == "cuda":
        torch.cuda.synchronize()
    return done


def precompile(case: tuple[int, int], configs: dict[str, list[dict]], procs: int, device: str) -> None:
    """Compile every setting in ``procs`` child processes at once (each an sm_90 compile of ~15 s, most of a serial
    sweep's time), so the timed loop finds them in Triton's cache."""
    import concurrent.futures
    import multiprocessing

    settings = [(name, cfg) for name in configs for cfg in configs[name]]
    procs = min(procs, len(settings))
    if procs < 2:
        return
    t = time.perf_counter()
    chunks = [settings[i::procs] for i in range(procs)]
    dicts = {name: dict(d) for name, d in _launch_dicts().items()}
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(procs, mp_context=ctx) as pool:
        done = sum(pool.map(_warm, [case] * procs, chunks, [dicts] * procs, [device] * procs))
    print(
        f"precompiled {done}/{len(settings)} settings in {procs} processes, {time.perf_counter() - t:.0f}s", flush=True
    )


def sweep(cases: list[tuple[int, int]], device: str, configs: dict[str, list[dict]], launch_only: bool = False) -> dict:
    from kernellab.kernels.paged_attention import paged_decode_attention

    gpu = device == "cuda"
    if gpu:
        from triton.testing import do_bench

        def bench(fn):
            return do_bench(fn, warmup=10, rep=60) * 1e3  # µs
    else:

        def bench(fn):
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e6

    D, Hk = SHAPE["D"], SHAPE["Hk"]
    rows = []
    for batch, ctx in cases:
        c = _case(batch, ctx, device)
        tokens = batch * ctx
        row = {"batch": batch, "context": ctx, **{name: [] for name in configs}}
        for name in configs:
            ref = c["caches"][name][3]
            nbytes = 2 * tokens * Hk * (D * 2 if name == "bf16" else D + 4)
            for cfg in configs[name]:
                k, v, kw = _kwargs(name, cfg, c)

                def run(c=c, k=k, v=v, kw=kw):
                    return paged_decode_attention(c["q"], k, v, c["tables"], c["lens"], D**-0.5, **kw)

                if launch_only:  # one launch each, for a profiler (ncu) to catch
                    run()
                    continue
                try:
                    err = float((run().float() - ref).norm() / ref.norm())
                    us = bench(run)
                except Exception as exc:  # a setting the compiler refuses: recorded, not fatal
                    row[name].append({**cfg, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
                    continue
                gbs = nbytes / us / 1e3
                row[name].append(
                    {
                        **cfg,
                        "us": round(us, 2),
                        "gbs": round(gbs, 1),
                        "pct_of_read_bw": round(100 * gbs / READ_BW_GBS, 1),
                        "rel_err_vs_reference": err,
                    }
                )
        rows.append(row)
        line = []
        for name in configs:
            ok = [r for r in row[name] if "us" in r]
            if ok:
                b = min(ok, key=lambda r: r["us"])
                line.append(
                    f"{name} {b['us']:.1f} µs ({b['pct_of_read_bw']} %, {_ident(b)}, err {b['rel_err_vs_reference']:.1e})"
                )
        print(f"B={batch:4d} ctx={ctx:5d}: " + "; ".join(line), flush=True)
        del c
        if gpu:
            torch.cuda.empty_cache()
    return {"shape": SHAPE, "rows": rows}


def _ident(cfg: dict) -> str:
    return "/".join(str(cfg.get(k)) for k in KEYS if k in cfg)


def pick(result: dict, name: str, current: dict, batched: set[tuple[int, int]]) -> dict | None:
    """The setting with the least total time over the batched cases (the offline workload's decode), among those
    whose error is at most 1.25× the smallest any setting reached in each case (not the current setting's: a
    current form that computed garbage on the GPU must not let every other through)."""
    rows = [r for r in result["rows"] if (r["batch"], r["context"]) in batched]
    totals: dict[str, tuple[float, dict]] = {}
    for cfg_rows in zip(*(r[name] for r in rows), strict=True):
        if any("us" not in x for x in cfg_rows):
            continue
        ok = True
        for r, x in zip(rows, cfg_rows, strict=True):
            least = min(y["rel_err_vs_reference"] for y in r[name] if "us" in y)
            ok &= x["rel_err_vs_reference"] <= 1.25 * least
        if ok:
            cfg = {k: cfg_rows[0][k] for k in current}
            totals[_ident(cfg)] = (sum(x["us"] for x in cfg_rows), cfg)
    return min(totals.values(), key=lambda t: t[0])[1] if totals else None


def offline_ab(variants: dict[str, tuple[str, dict]], device: str, rounds: int, blocks: int | None = None) -> dict:
    """``variants``: name → (cache dtype, its launch dict); an int8 variant whose launch has ``mma`` off gets V
    dense like K, as before the transposed layout."""
    from kernellab.bench.offline import gate_offline_setup, run_engine
    from kernellab.runtime import ops
    from kernellab.runtime.config import EngineConfig
    from kernellab.runtime.engine import LLMEngine

    dicts = _launch_dicts()
    saved = {k: dict(v) for k, v in dicts.items()}

    # engines side by side: 20,480 blocks cover the workload's 256 sequences at once (~18,000 blocks at the end)
    blocks = blocks or (20480 if device == "cuda" else 512)
    engines, cfgs = {}, {}
    prompts = outs = None
    for name, (cache, launch) in variants.items():
        cfg, prompts, outs = gate_offline_setup(
            device, kv_cache_dtype="auto" if cache == "bf16" else cache, num_kv_blocks=blocks
        )
        _apply_launch(cache, launch)
        ops.INT8_V_TRANSPOSED = bool(launch.get("mma", True))
        engines[name] = LLMEngine(EngineConfig(**cfg))  # graphs captured with this setting, the cache laid out
        ops.INT8_V_TRANSPOSED = True
        cfgs[name] = cfg
    runs = []
    names = list(variants)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            cache, launch = variants[name]
            _apply_launch(cache, launch)
            eng = engines[name]
            if not eng.reset_prefix_cache():
                raise RuntimeError("the engine is not idle between runs")
            run = run_engine(eng, prompts, outs, "nanovllm-256", cfgs[name]["dtype"])
            runs.append({"variant": name, "round": r, **{k: run[k] for k in ("output_tok_per_s", "seconds")}})
            print(f"offline round {r} {name:10s} {run['output_tok_per_s']:>9.0f} tok/s", flush=True)
    for cache, launch in saved.items():
        _apply_launch(cache, launch)
    median = {n: statistics.median(x["output_tok_per_s"] for x in runs if x["variant"] == n) for n in names}
    base = names[0]
    return {
        "engine": {n: {k: v for k, v in c.items() if k != "model"} for n, c in cfgs.items()},
        "variants": {n: {"cache": c, "launch": launch} for n, (c, launch) in variants.items()},
        "runs": runs,
        "median_tok_s": median,
        f"over_{base}": {n: round(median[n] / median[base], 4) for n in names},
    }


def _run_offline(result: dict, path: Path, variants: dict[str, tuple[str, dict]], args) -> int:
    """The offline A/B of ``variants`` (``--rounds`` of them; none at 0) into ``result``, written to ``path``."""
    if args.rounds < 1:
        return 0
    result["offline"] = offline_ab(variants, args.device, args.rounds, args.offline_blocks)
    path.write_text(json.dumps(result, indent=1))
    print(f"offline medians: {result['offline']['median_tok_s']}")
    return 0


def _packed_offline(result: dict, path: Path, cfgs: list[dict], form_names: list[str], current: dict, batched,
                    args) -> int:  # fmt: skip
    """``--packed``: each packed form's best tile setting (``pick`` among that form's settings), then the offline
    A/B of the current int8 launch against each form with its best as ``pack_launch`` (and the bf16 cache, where
    the card holds four engines' pools: 139 GB)."""
    best = {}
    for fname in form_names:
        idx = [i for i, c in enumerate(cfgs) if _cfg_form(c) == INT8_FORMS[fname]]
        sub = {"rows": [{**r, "int8": [r["int8"][i] for i in idx]} for r in result["kernel"]["rows"]]}
        cfg = pick(sub, "int8", dict.fromkeys(("block_n", "num_warps", "num_stages")), batched)  # the tile keys
        if cfg is not None:
            best[fname] = cfg
    result["best_pack_launch"] = best
    print(f"best packed: {json.dumps(best)}", flush=True)
    path.write_text(json.dumps(result, indent=1))
    gpu = args.device == "cuda"
    big = not gpu or torch.cuda.get_device_properties(0).total_memory > 100e9
    variants = {"bf16": ("bf16", current["bf16"])} if big else {}
    variants["int8"] = ("int8", current["int8"])
    for fname, cfg in best.items():
        variants[f"int8-{fname}"] = (
            "int8",
            {**current["int8"], **dict(zip(FORM_KEYS[2:], INT8_FORMS[fname][2:], strict=True)), "pack_launch": cfg},
        )
    return _run_offline(result, path, variants, args)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--rounds", type=int, default=2, help="offline rounds per variant")
    ap.add_argument("--caches", default=",".join(CACHES), help="the cache dtypes to sweep (bf16 is always timed)")
    ap.add_argument("--stages", default="2", help="num_stages values to sweep, comma-separated")
    ap.add_argument("--tiles", help="block_n values, comma-separated (default 64,128 on the GPU)")
    ap.add_argument("--warps", help="num_warps values, comma-separated (default 4,8 on the GPU)")
    ap.add_argument("--int8-forms", default=",".join(INT8_FORMS), help=f"int8 forms to sweep, of {list(INT8_FORMS)}")
    ap.add_argument("--cases", help="BATCHxCONTEXT cases, comma-separated (default: the gate's five)")
    ap.add_argument("--launch-only", action="store_true", help="launch each setting once, untimed (for ncu)")
    ap.add_argument(
        "--precompile",
        type=int,
        help="child processes compiling the settings first (default 8 on the GPU, 0 on the CPU)",
    )
    ap.add_argument(
        "--packed",
        action="store_true",
        help="the packed int8 forms of --int8-forms only, at 256-row cases (bf16 at its launch); the offline A/B "
        "then runs each form's best as its pack_launch against the current int8 launch",
    )
    ap.add_argument(
        "--block-size",
        type=int,
        help="the KV cache's block size in the kernel cases (default 16, the engine's; the offline A/B keeps 16)",
    )
    ap.add_argument(
        "--offline-blocks",
        type=int,
        help="KV blocks of each offline engine, of its cache's block size (16 tokens, int8 64; default 20,480)",
    )
    ap.add_argument(
        "--offline-int8",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="an extra int8 engine in the offline A/B: INT8_LAUNCH updated with JSON, e.g. "
        'pack256=\'{"pack_heads": 8, "pack_min_rows": 256, "pack_launch": {"block_n": 32, "num_stages": 2}}\'',
    )
    args = ap.parse_args()
    if args.block_size:
        os.environ["KERNELLAB_SWEEP_BLOCK_SIZE"] = str(args.block_size)
        SHAPE["block_size"] = args.block_size
    gpu = args.device == "cuda"
    if not gpu:  # Triton's interpreter, read when a kernel is decorated, with the fixes the CPU tests use
        os.environ["TRITON_INTERPRET"] = "1"
        from kernellab.kernels.testing import patch_interpreter

        patch_interpreter()
    from kernellab.results import provenance

    current = {name: dict(d) for name, d in _launch_dicts().items()}
    if gpu:
        # the offline workload's contexts run from ~100 to ~2,000 tokens (mean ~840): a short and a long batched
        # case beside 1,024, since a form's tile size and per-tile overhead weigh differently at each
        cases = [(64, 1024), (256, 1024), (256, 384), (128, 2048), (1, 4096)]
        tiles, warps = (64, 128), (4, 8)
    else:  # the interpreter: the script's path, a handful of settings
        cases = [(2, 64), (4, 64)]
        tiles, warps = (16, 32), (4,)
    stages = [int(x) for x in args.stages.split(",")]
    if args.tiles:
        tiles = tuple(int(x) for x in args.tiles.split(","))
    if args.warps:
        warps = tuple(int(x) for x in args.warps.split(","))
    if args.cases:
        cases = [(int(b), int(c)) for b, c in (x.split("x") for x in args.cases.split(","))]
    form_names = args.int8_forms.split(",")
    if args.packed:
        form_names = [f for f in form_names if INT8_FORMS[f][2] > 1]
        if not args.cases:
            cases = [(256, 1024), (256, 384)] if gpu else [(2, 64)]
        if not gpu:  # the interpreter's few rows: packed as the GPU packs 256
            _launch_dicts()["int8"]["pack_min_rows"] = 0
    int8_forms = [INT8_FORMS[f] for f in form_names]
    swept = [c for c in CACHES if c == "bf16" or c in args.caches.split(",")]
    if args.packed:
        swept = ["bf16", "int8"]
    configs: dict[str, list[dict]] = {}
    for name in swept:
        if args.packed and name == "bf16":  # the baseline only
            configs[name] = [dict(current[name])]
            continue
        forms = int8_forms if name == "int8" else [()]
        configs[name] = [
            {
                **current[name],
                "block_n": bn,
                "num_warps": w,
                "num_stages": st,
                **(dict(zip(FORM_KEYS, form, strict=True)) if form else {}),  # int8's form
                # a packed form named is timed as itself at every case, not only from the launch's pack_min_rows
                **({"pack_min_rows": 0} if form and form[2] > 1 else {}),
            }
            for bn, w, st, form in itertools.product(tiles, warps, stages, forms)
        ]
        if current[name] not in configs[name] and not args.packed:
            configs[name].append(dict(current[name]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.launch_only:
        precompile(cases[0], configs, args.precompile if args.precompile is not None else 8 if gpu else 0, args.device)
    result = {
        "schema": "kernellab.bench.decode_attention_sweep/v1",
        "provenance": provenance(args.device),
        "current_launch": current,
        "int8_scales": "dense" if DENSE_SCALES else "head-major",
        "kernel": sweep(cases, args.device, configs, args.launch_only),
    }
    if args.launch_only:
        return 0
    path = out / "decode_attention_sweep.json"
    path.write_text(json.dumps(result, indent=1))
    batched = {c for c in cases if c[0] > 1}
    if args.packed:
        return _packed_offline(result, path, configs["int8"], form_names, current, batched, args)
    best = {name: pick(result["kernel"], name, current[name], batched) for name in swept}
    result["best_launch"] = best
    print(f"best: {json.dumps(best)}", flush=True)
    path.write_text(json.dumps(result, indent=1))
    variants = {"bf16": ("bf16", current["bf16"])}
    if best["bf16"] != current["bf16"]:
        variants["bf16-best"] = ("bf16", best["bf16"])
    if "int8" in swept:
        variants["int8"] = ("int8", current["int8"])
    if best.get("int8") and best["int8"] != current["int8"]:
        variants["int8-best"] = ("int8", best["int8"])
    for spec in args.offline_int8:
        vname, _, js = spec.partition("=")
        variants[vname] = ("int8", {**current["int8"], **json.loads(js)})
    if "int8" in swept and "asm" in args.int8_forms.split(","):  # before V was transposed: dense V, byte permutes
        variants["int8-dense"] = ("int8", {**current["int8"], "mma": False, "i8_asm": True})
    return _run_offline(result, path, variants, args)


if __name__ == "__main__":
    raise SystemExit(main())
