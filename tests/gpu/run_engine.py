#!/usr/bin/env python3
"""The engine gate on a GPU, in one go: numerics, end-to-end speed, the HF transformers peer, and the
kernel acceptance ablation. Random weights of the exact Qwen3-0.6B shape (HF's own initialisation, shared
by every system compared). Prints a short table last; writes JSON into --out (default $OUT).

    python3 tests/gpu/run_engine.py --out "$OUT"            # on the device machine
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from tests.gpu.run_fp8 import fp8_kv

T0 = time.time()
MODEL = "qwen3-0.6b"


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def hf_model(dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    from kernellab.runtime.request.registry import resolve_model

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(**{"model_type": "qwen3", **resolve_model(MODEL).hf_config})
    with torch.device("cuda"):
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()


def engine(weights, **kw):
    from kernellab.runtime.config import EngineConfig
    from kernellab.runtime.engine import LLMEngine

    # Explicit KV pools: several engines share the card here; the offline run alone sizes it from free memory.
    base = dict(
        model=MODEL,
        device="cuda",
        dtype="bfloat16",
        random_weights=True,
        max_model_len=2048,
        max_num_seqs=64,
        max_num_batched_tokens=16384,
        kernels="experimental",
        num_kv_blocks=4096,
    )
    base.update(kw)
    return LLMEngine(EngineConfig(**base), weights=weights)


def forward_prefill(eng, prompts, collect=None, all_logits=False):
    """Prefill each prompt (one step each, no prefix cache) and return logits (all positions or last)."""
    from kernellab.runtime.request.sampling import SamplingParams

    eng.block_manager.enable_prefix_caching = False
    outs = []
    for i, p in enumerate(prompts):
        eng.add_request(f"p{i}", p, SamplingParams(temperature=0.0, max_tokens=1))
        sched = eng.scheduler.schedule()
        ids, meta, _, _ = eng.runner.prepare(sched)
        layers = [] if collect is not None else None
        with torch.inference_mode():
            hidden = eng.runner.model(ids, meta, eng.runner.kv_caches, collect=layers)
            logits = eng.runner.model.compute_logits(hidden if all_logits else hidden[meta.logits_indices])
        if collect is not None:
            collect.append([h.float() for h in layers])
        outs.append(logits)
        eng.abort(f"p{i}")
    return outs


def numerics(hf_bf16, weights, report):
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, 10000, (int(n),), generator=gen).tolist() for n in torch.randint(32, 257, (64,), generator=gen)
    ]
    ours, ref = engine(weights), engine(weights, dtype="float32", kernels="none", cuda_graphs=False, num_kv_blocks=64)
    ours_layers, ref_layers = [], []
    forward_prefill(ours, prompts, ours_layers)
    forward_prefill(ref, prompts, ref_layers)
    cos = []
    for layer in range(len(ref_layers[0])):
        per_prompt = [
            torch.nn.functional.cosine_similarity(o[layer], r[layer], dim=-1)
            for o, r in zip(ours_layers, ref_layers, strict=True)
        ]
        allc = torch.cat(per_prompt)
        cos.append({"layer": layer, "mean": allc.mean().item(), "min": allc.min().item()})
    worst = min(c["mean"] for c in cos)
    report["numerics"]["layer_cosine"] = {
        "per_layer": cos,
        "worst_layer_mean": worst,
        "gate": 0.9999,
        "pass": worst >= 0.9999,
        "prompts": len(prompts),
    }
    log(f"layer cosine: worst layer mean {worst:.6f}, min token {min(c['min'] for c in cos):.6f}")
    del ref

    # Teacher-forced argmax vs HF fp32 over 256 prompts × 32 positions, next to HF bf16's own agreement.
    seqs = torch.randint(0, 10000, (256, 96), generator=gen)
    hf_fp32 = hf_model(torch.float32)
    hf_fp32.load_state_dict({k: v.float() for k, v in hf_bf16.state_dict().items()})
    agree_ours = agree_hf = 0
    ours_logits = forward_prefill(ours, seqs.tolist(), all_logits=True)
    with torch.inference_mode():
        for i in range(0, 256, 32):
            batch = seqs[i : i + 32].cuda()
            ref_arg = hf_fp32(batch).logits[:, -32:].argmax(-1)
            hf_arg = hf_bf16(batch).logits[:, -32:].argmax(-1)
            our_arg = torch.stack([ours_logits[i + j][-32:].argmax(-1) for j in range(batch.shape[0])])
            agree_ours += (our_arg == ref_arg).sum().item()
            agree_hf += (hf_arg == ref_arg).sum().item()
    n = 256 * 32
    a_ours, a_hf = 100 * agree_ours / n, 100 * agree_hf / n
    report["numerics"]["teacher_forced"] = {
        "positions": n,
        "ours_bf16_pct": a_ours,
        "hf_bf16_pct": a_hf,
        "pass": a_ours >= a_hf - 0.5,
    }
    log(f"teacher-forced argmax vs HF fp32: ours {a_ours:.2f}%  HF bf16 {a_hf:.2f}%")
    del hf_fp32

    # Greedy CUDA-graph output == eager output of the same runner.
    from kernellab.bench.numerics import graph_equals_eager

    report["numerics"]["graph_equals_eager"] = check = graph_equals_eager(ours, prompts[:16])
    log(f"graph == eager greedy: {check['pass']}")
    # A chat turn after a cached system prompt: the chunk-after-context graph against the eager step.
    from kernellab.bench.numerics import chunk_graph_matches_eager

    g = torch.Generator().manual_seed(8)
    system = torch.randint(0, 10000, (CACHED_PREFIX,), generator=g).tolist()
    turns = [torch.randint(0, 10000, (12,), generator=g).tolist() for _ in range(8)]
    report["numerics"]["chunk_graph_matches_eager"] = check = chunk_graph_matches_eager(ours, system, turns)
    log(f"chunk graph ~ eager: {check}")


def offline(weights, report, hf=None):
    from kernellab.bench.offline import run_engine
    from kernellab.bench.workloads import nanovllm

    prompts, outs = nanovllm()
    torch.cuda.reset_peak_memory_stats()
    # decode windows as the engine sets them (4, launched ahead: asynchronous scheduling; 16 read one by one before)
    eng = engine(weights, max_num_seqs=256, num_kv_blocks=None)
    log(f"offline engine ready: {eng.runner.num_blocks} KV blocks, graphs={eng.runner.graphs is not None}")
    run = run_engine(eng, prompts, outs, "nanovllm-256", "bfloat16")
    run["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    run["kv_cache_gib"] = round(
        eng.runner.num_blocks * eng.config.block_size * eng.model_config.kv_bytes_per_token(2) / 2**30, 2
    )
    report["offline"].append(run)
    log(
        f"offline nano-vllm: {run['output_tokens']} tokens in {run['seconds']:.2f}s = {run['output_tok_per_s']:.0f} tok/s"
    )
    del eng
    if hf is not None:
        report["offline"].append(hf_continuous_batching(hf, prompts[:32], outs[:32]))


def offline_sweep(weights, report):
    """The nano-vllm workload at several multi-step widths, with the time split between steps that prefill
    and pure-decode windows, and a kernel profile of one decode window at full batch."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from kernellab.bench.workloads import nanovllm
    from kernellab.runtime.request.sampling import SamplingParams

    prompts, outs = nanovllm()
    sweep = []
    # The jagged FlashAttention prefill against the per-prompt loop, on a packed batch of real lengths.
    from kernellab.runtime import ops

    gen = torch.Generator(device="cuda").manual_seed(5)
    lens = [len(p) for p in prompts[:12]]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    q = torch.randn(cu[-1], 16, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
    k = torch.randn(cu[-1], 8, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
    v = torch.randn(cu[-1], 8, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
    loop = torch.cat([ops.causal_attention(q[s:e], k[s:e], v[s:e], 128**-0.5, 2) for s, e in itertools.pairwise(cu)])
    jag = ops.varlen_causal_attention(q, k, v, cu, 128**-0.5)
    err = float((jag.float() - loop.float()).norm() / loop.float().norm())
    report["varlen_jagged_vs_loop_rel_err"] = err
    log(f"varlen jagged vs loop: rel err {err:.2e}")
    for steps in (8,):
        eng = engine(weights, max_num_seqs=256, num_kv_blocks=None, num_scheduler_steps=steps)
        eng.add_request("w", prompts[0][:32], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        while eng.has_unfinished_requests():
            eng.step()
        for i, (p, n) in enumerate(zip(prompts, outs, strict=True)):
            eng.add_request(f"b{i}", p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        phases = {"mixed": [0.0, 0, 0], "decode": [0.0, 0, 0]}
        produced, profiled = 0, None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        while eng.has_unfinished_requests():
            running = len(eng.scheduler.running)
            decode_only = not eng.scheduler.waiting and all(
                s.num_computed_tokens == s.num_tokens - 1 for s in eng.scheduler.running
            )
            ts = time.perf_counter()
            if profiled is None and decode_only and running >= 200:
                with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    got = sum(len(o.new_token_ids) for o in eng.step())
                rows = sorted(prof.key_averages(), key=lambda e: e.device_time_total, reverse=True)[:10]
                profiled = [
                    {"name": e.key[:70], "cuda_ms": round(e.device_time_total / 1e3, 3), "calls": e.count} for e in rows
                ]
            else:
                got = sum(len(o.new_token_ids) for o in eng.step())
            ph = phases["decode" if decode_only else "mixed"]
            ph[0] += time.perf_counter() - ts
            ph[1] += 1
            ph[2] += got
            produced += got
        seconds = time.perf_counter() - t0
        row = {
            "num_scheduler_steps": steps,
            "seconds": round(seconds, 3),
            "output_tok_per_s": round(produced / seconds, 1),
            "phases": {k: {"seconds": round(v[0], 3), "steps": v[1], "tokens": v[2]} for k, v in phases.items()},
        }
        if profiled:
            row["decode_window_profile"] = profiled
        sweep.append(row)
        log(f"offline K={steps}: {row['output_tok_per_s']:.0f} tok/s; {row['phases']}")
        for r in profiled or []:
            log(f"   {r['cuda_ms']:9.3f} ms cuda {r['calls']:5d}x {r['name']}")
        del eng
        gc.collect()
        torch.cuda.empty_cache()
    report["offline_sweep"] = sweep


def hf_continuous_batching(hf, prompts, outs):
    from transformers import GenerationConfig

    gen_cfg = GenerationConfig(max_new_tokens=1024, do_sample=False, eos_token_id=-1)
    t0 = time.perf_counter()
    produced = 0
    with hf.continuous_batching_context_manager(generation_config=gen_cfg, block=True, timeout=10) as mgr:
        for p, n in zip(prompts, outs, strict=True):
            mgr.add_request(p, max_new_tokens=n, eos_token_id=-1)
        done = 0
        while done < len(prompts):
            r = mgr.get_result(timeout=1)
            if r is not None and r.is_finished():
                done += 1
                produced += len(r.generated_tokens)
    seconds = time.perf_counter() - t0
    log(f"HF continuous batching (first 32 sequences): {produced / seconds:.0f} tok/s")
    return {
        "system": "hf-continuous-batching",
        "workload": "nanovllm-first32",
        "dtype": "bfloat16",
        "num_prompts": len(prompts),
        "output_tokens": produced,
        "seconds": round(seconds, 3),
        "output_tok_per_s": round(produced / seconds, 1),
    }


def latency(weights, report, hf=None):
    from kernellab.bench.latency import bench_latency

    eng = engine(weights, max_num_seqs=8, max_model_len=4096)
    data = bench_latency(eng, prompt_lens=(2048,), contexts=(128, 2048), hf=hf)
    report["latency"] = data
    for r in data["rows"]:
        log(f"latency {r['system']} {r['metric']}@{r['tokens']}: {r['ms_p50']} ms")


def profile(weights, report):
    """Where a 2,048-token prefill and a batch-1 decode window spend their time (CUDA kernels and host)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from kernellab.bench.latency import engine_itl, engine_ttft

    eng = engine(weights, max_num_seqs=8, max_model_len=4096)
    engine_ttft(eng, 2048, reps=1)
    system = torch.randint(0, 10000, (CACHED_PREFIX,), generator=torch.Generator().manual_seed(4)).tolist()
    engine_ttft(eng, 32, reps=1, seed=5, prefix=system)  # warm: the prefix in the cache, the path compiled
    summary = {}
    for name, fn in (
        ("ttft2048", lambda: engine_ttft(eng, 2048, reps=1, seed=9)),
        ("decode_b1", lambda: engine_itl(eng, 128, new_tokens=32)),
        ("ttft32_after_cached_prefix", lambda: engine_ttft(eng, 32, reps=1, seed=6, prefix=system)),
    ):
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
        averages = prof.key_averages()

        def row(e):
            return {
                "name": e.key[:80],
                "cuda_ms": round(e.device_time_total / 1e3, 3),
                "calls": e.count,
                "cpu_ms": round(e.cpu_time_total / 1e3, 3),
                "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 3),
            }

        summary[name] = [row(e) for e in sorted(averages, key=lambda e: e.device_time_total, reverse=True)[:12]]
        host = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:10]  # host-side costs
        summary[name + "_host"] = [row(e) for e in host]
        log(f"profile {name}:")
        for r in summary[name]:
            log(f"   {r['cuda_ms']:9.3f} ms cuda  {r['calls']:5d}x  {r['name']}")
        for r in summary[name + "_host"][:6]:
            log(f"   {r['self_cpu_ms']:9.3f} ms host  {r['calls']:5d}x  {r['name']}")
    # The host cost of one eager Triton launch (prefill chunks that continue a cached context run eagerly)
    from kernellab.kernels.rms_norm import add_rms_norm

    x = torch.randn(32, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(1024, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        add_rms_norm(x, x.clone(), w, 1e-6)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(200):
        add_rms_norm(x, x, w, 1e-6, residual_out=x)
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    summary["eager_add_rms_norm_launch_us"] = {"host": round(host / 200 * 1e6, 2)}
    log(f"profile eager add_rms_norm launch: {host / 200 * 1e6:.1f} µs of host time each")
    report["profile"] = summary


def prefill_steps(weights, report):
    """Steps that prefill (a 64-client burst's full and quarter steps, prompts joining a decoding batch), timed one
    at a time with the piecewise CUDA graphs and eagerly (interleaved), their logits compared, and the burst's full
    step profiled both ways: GPU kernel time against the step's wall time says whether it is host-bound."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from kernellab.bench.steps import (
        FRESH_PADDED_MIXES,
        MIXES_H200,
        _Engine,
        _timed_step,
        fresh_graph_matches_eager,
        piecewise_matches_eager,
        step_times,
    )

    t = time.perf_counter()
    sized = dict(max_num_seqs=256, max_model_len=4096, num_kv_blocks=16384)
    eng = engine(weights, **sized)
    pw = eng.runner.piecewise
    section = {
        "engine_build_s": round(time.perf_counter() - t, 2),
        "piecewise": None
        if pw is None
        else {
            "buckets": list(pw.buckets),
            "graphs": sum(len(g) for g in pw.graphs.values()),
            "capture_s": round(pw.capture_s, 2),
            "reserved_gib": round(pw.reserved_bytes / 2**30, 3),
        },
    }
    report["prefill_steps"] = section
    log(f"prefill steps: engine built in {section['engine_build_s']}s; piecewise {section['piecewise']}")
    section["numerics"] = check = piecewise_matches_eager(eng, MIXES_H200)
    log(
        f"piecewise ~ eager: pass={check['pass']} max |diff| {check.get('max_abs_diff')} argmax {check.get('argmax_agree_pct')}%"
    )
    section["fresh_graph_numerics"] = check = fresh_graph_matches_eager(eng, MIXES_H200 + FRESH_PADDED_MIXES)
    log(
        f"fresh-prompt graphs ~ eager: pass={check['pass']} max |diff| {check.get('max_abs_diff')} argmax "
        f"{check.get('argmax_agree_pct')}%"
    )
    section["steps"] = step_times(eng, MIXES_H200, reps=6)
    for r in section["steps"]:
        log(
            f"step {r['mix']:18s} {r['step_rows']:4d} rows {r['step_tokens']:6d} tok  graph {r.get('graph_ms')} ms  piecewise {r.get('piecewise_ms')} ms  eager {r['eager_ms']} ms  x{r.get('speedup')}"
        )
    # one profiled step of the burst's full step, each way
    name, _, prompts = MIXES_H200[0]
    e = _Engine(eng, torch.Generator().manual_seed(11))
    eng.block_manager.enable_prefix_caching = False
    prof_rows = {}
    for mode in ("piecewise", "eager") if pw is not None else ("eager",):
        eng.runner.use_piecewise = mode == "piecewise"
        eng.runner.use_graphs = False  # the burst's full step has no whole-step graph: the same either way
        _timed_step(e, prompts)  # warm
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            dt, _, _ = _timed_step(e, prompts)
        kernels = [ev for ev in prof.key_averages() if ev.device_time_total > 0 and ev.cpu_time_total == 0]
        gpu_ms = sum(ev.device_time_total for ev in kernels) / 1e3
        top = sorted(kernels, key=lambda ev: ev.device_time_total, reverse=True)[:8]
        prof_rows[mode] = {
            "wall_ms_profiled": round(dt * 1e3, 3),
            "gpu_kernel_ms": round(gpu_ms, 3),
            "top": [
                {"name": ev.key[:70], "cuda_ms": round(ev.device_time_total / 1e3, 3), "calls": ev.count} for ev in top
            ],
        }
        log(f"profile {name} {mode}: wall {dt * 1e3:.2f} ms (profiled), GPU kernels {gpu_ms:.2f} ms")
    eng.runner.use_piecewise = pw is not None
    eng.runner.use_graphs = eng.runner.graphs is not None
    section["profile_" + name] = prof_rows
    varlen_on = "varlen_causal_attention" in eng.runner.model.ops.enabled
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    if varlen_on:
        # The same mixes on an engine without the packed prefill attention (an experimental op this engine runs):
        # its Python launch (three tensor descriptors and a Triton launch a layer) against its device time, in the
        # mixed steps whose attention runs eagerly between the piecewise graphs and in the whole-step graphs.
        off = engine(weights, **sized, disabled_kernels=("varlen_causal_attention",))
        section["steps_varlen_causal_attention_off"] = step_times(off, MIXES_H200, reps=6)
        del off
        for a, b in zip(section["steps"], section["steps_varlen_causal_attention_off"], strict=True):
            log(
                f"step {a['mix']:18s} varlen_causal_attention on / off: graph {a.get('graph_ms')} / "
                f"{b.get('graph_ms')} ms  piecewise {a.get('piecewise_ms')} / {b.get('piecewise_ms')} ms  eager "
                f"{a['eager_ms']} / {b['eager_ms']} ms"
            )


def kernel_numerics(op, kernel, reference, model=None) -> dict:
    """The op against its torch reference at real model shapes (Qwen3-0.6B's by default), fresh random inputs
    each seed."""
    from tests.gpu.op_inputs import make_inputs

    def as_tuple(x):
        return x if isinstance(x, tuple) else (x,)

    errs = []
    for seed in range(3):
        args = make_inputs(op, seed, model)
        ref_args, k_args = args["a"], args.get("k", args["a"])
        if op == "l2_prefetch":  # a cache hint: it must return nothing and leave every byte as it was
            before = [t.clone() for t in k_args]
            pairs = [(kernel(*k_args), reference(*ref_args)), *zip(k_args, before, strict=True)]
        else:
            pairs = list(zip(as_tuple(kernel(*k_args)), as_tuple(reference(*ref_args)), strict=True))
        if op == "store_kv":
            pairs += [(k_args[2], ref_args[2]), (k_args[3], ref_args[3])]
        if op == "qk_norm_rope_store_kv":
            pairs += [(k_args[8], ref_args[8]), (k_args[9], ref_args[9])]
        if op in ("paged_decode_attention_qk_norm_rope", "decode_attention_o_proj"):  # the new tokens' cache rows too
            pairs += [(k_args[7], ref_args[7]), (k_args[8], ref_args[8])]
        for a, b in pairs:
            if a is None:
                continue
            if not a.is_floating_point():
                errs.append(float((a != b).float().mean()))
            else:
                errs.append(float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)))
    worst = max(errs)
    tol = 0.0 if op in ("argmax", "l2_prefetch") else 2e-2
    return {"rel_err_max": worst, "tolerance": tol, "pass": worst <= tol}


def ablation(weights, report, model=MODEL, only=None):
    """Turn each enabled op off in turn (``only``: just these) and measure the complete workload without it,
    in interleaved rounds against the all-on engine until the effect's interval settles
    (``kernellab.bench.ablation``: the decision rule and its statistics)."""
    from kernellab import kernels as lib
    from kernellab.bench.ablation import aa_thresholds, decide, interleaved
    from kernellab.bench.latency import engine_itl, engine_ttft
    from kernellab.bench.offline import run_engine
    from kernellab.runtime import ops as reference
    from kernellab.runtime.dispatch import REPLACEABLE, ops_on_path

    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 10000, (128,), generator=gen).tolist() for _ in range(64)]

    def build(disabled=()):
        # no prefix cache: every round replays the same prompts and must do the same work
        return engine(weights, model=model, disabled_kernels=tuple(disabled), enable_prefix_caching=False)

    def measure(eng):
        thr = run_engine(eng, prompts, [128] * 64, "decode-64x128", "bfloat16")["output_tok_per_s"]
        itl = statistics.median(engine_itl(eng, 128, new_tokens=48)) * 1e3
        ttft = statistics.median(engine_ttft(eng, 2000, reps=6)) * 1e3  # steps that prefill: their ops' figure
        return {"tok_per_s": round(thr, 1), "itl_ms": round(itl, 4), "ttft_ms": round(ttft, 4)}

    standing, standing_runs = standing_statuses()
    all_on_engine = build()
    enabled = list(all_on_engine.runner.model.ops.enabled)
    all_on = {**measure(all_on_engine), "enabled": enabled}
    log(f"ablation all-on: {all_on['tok_per_s']:.0f} tok/s, ITL {all_on['itl_ms']:.3f} ms")
    none_engine = build(REPLACEABLE)
    rows = {"__all__": all_on, "__none__": measure(none_engine)}
    del none_engine
    log(f"ablation torch-only: {rows['__none__']['tok_per_s']:.0f} tok/s, ITL {rows['__none__']['itl_ms']:.3f} ms")
    # A/A: a second build of the same engine. Two builds differ by more than two runs of one build (memory
    # placement, graph pools): no kernel counts as helping by less than this interval's extent.
    twin = build()
    # all rounds: from three, the t-interval of a noisy figure alone can set the threshold past real gains
    full = {"min_rounds": ABLATION_ROUNDS["max_rounds"], "max_rounds": ABLATION_ROUNDS["max_rounds"]}
    aa, aa_record = interleaved(lambda: measure(all_on_engine), lambda t=twin: measure(t), **full)
    del twin
    # each figure its own bar: a noisy one (a prompt's TTFT) must not raise the steady ones' (ablation.py)
    rule = {**ABLATION_ROUNDS, "min_effect_pct": aa_thresholds(aa)}
    rows["__aa__"], rows["__rule__"] = aa_record, rule
    log(
        f"ablation A/A: {', '.join(f'{f} [{e.lo_pct:+.1f}, {e.hi_pct:+.1f}]' for f, e in aa.items())} → min effect "
        f"{', '.join(f'{f} {t:.1f}%' for f, t in rule['min_effect_pct'].items())}"
    )
    on_path = set(ops_on_path(all_on_engine.model_config.qk_norm))
    for op in [op for op in enabled if op in on_path and (only is None or op in only)]:
        off_engine = build((op,))
        effects, record = interleaved(lambda: measure(all_on_engine), lambda off=off_engine: measure(off), **rule)
        del off_engine
        num = kernel_numerics(op, lib.KERNELS[op], getattr(reference, op), None if model == MODEL else model)
        # this run alone, and with the standing decision kept when this run is not settled (ablation.py)
        run_status = decide(effects, num["pass"], rule["min_effect_pct"])
        status = decide(
            effects, num["pass"], rule["min_effect_pct"], previous=standing.get(op), previous_run=standing_runs.get(op)
        )
        thr, itl = effects["tok_per_s"], effects["itl_ms"]
        last = record["rounds"][-1]["without"]
        rows[op] = {
            **last,
            "numerics": num,
            "status": status,
            "run_status": run_status,
            "standing_status": standing.get(op),
            "e2e_gain_tok_per_s_pct": thr.mean_pct,
            "e2e_gain_itl_pct": itl.mean_pct,
            **({"e2e_gain_ttft_pct": effects["ttft_ms"].mean_pct} if "ttft_ms" in effects else {}),
            **record,
        }
        log(
            f"ablation -{op}: {thr.mean_pct:+.1f}% tok/s [{thr.lo_pct:+.1f}, {thr.hi_pct:+.1f}], ITL {itl.mean_pct:+.1f}%"
            f" [{itl.lo_pct:+.1f}, {itl.hi_pct:+.1f}], TTFT {_effect_text(effects.get('ttft_ms'))} over {thr.rounds} rounds"
            f"{'' if record['settled'] else ' (unsettled)'}, rel err {num['rel_err_max']:.2e} → {status}"
            f"{f' (this run alone: {run_status}; kept)' if run_status != status else ''}"
        )
        Path(report["_path"]).write_text(json.dumps(report, indent=2, default=str))
    rows["__pdl__"] = pdl_ab(build, measure, all_on_engine, rule)
    return rows


def _effect_text(e) -> str:
    return "-" if e is None else f"{e.mean_pct:+.1f}% [{e.lo_pct:+.1f}, {e.hi_pct:+.1f}]"


def standing_statuses() -> tuple[dict[str, str], dict[str, str | None]]:
    """The dispatcher's table as it stands (runtime/kernel_status.json): the statuses an unsettled ablation keeps,
    and the last run's own verdicts, which a contrary settled run needs to change a status."""
    from kernellab.bench.ablation import standing_run

    path = Path(__file__).resolve().parents[2] / "runtime" / "kernel_status.json"
    ops = json.loads(path.read_text())["ops"]
    return {op: e["status"] for op, e in ops.items()}, {op: standing_run(e) for op, e in ops.items()}


def pdl_ab(build, measure, all_on_engine, rule) -> dict:
    """Programmatic dependent launch is a launch option, not an op: the all-on engine against one built (graphs
    captured) and run with every launch PDL-free (``kernels._common.pdl(False)``), in the same interleaved rounds
    and under the same rule as the kernels."""
    from kernellab.bench.ablation import decide, interleaved
    from kernellab.kernels._common import pdl

    with pdl(False):
        held = {"off": build()}

    def without():
        with pdl(False):
            return measure(held["off"])

    effects, record = interleaved(lambda: measure(all_on_engine), without, **rule)
    held.clear()
    thr, itl = effects["tok_per_s"], effects["itl_ms"]
    status = decide(effects, True, rule["min_effect_pct"])
    log(
        f"ablation -pdl: {thr.mean_pct:+.1f}% tok/s [{thr.lo_pct:+.1f}, {thr.hi_pct:+.1f}], ITL {itl.mean_pct:+.1f}%"
        f" [{itl.lo_pct:+.1f}, {itl.hi_pct:+.1f}] over {thr.rounds} rounds → {status}"
    )
    return {
        **record["rounds"][-1]["without"],
        "status": status,
        "e2e_gain_tok_per_s_pct": thr.mean_pct,
        "e2e_gain_itl_pct": itl.mean_pct,
        **record,
    }


# The rule: a kernel stays when it makes the workload faster on a figure, with 95 % confidence, by at least
# 1 % and at least what two builds of the same engine differ by on that figure (the A/A interval); 3 to 8
# rounds per op.
ABLATION_ROUNDS = {"min_rounds": 3, "max_rounds": 8}


CACHED_PREFIX = 512  # the shared system prompt of the lone chat request's TTFT ("cached prefix")
# The Llama family's shapes (head_dim 64, 9/3 and 32/8 heads): the embedded default model and Llama-3.2-1B.
PATH_SHAPES = ("qwen3-0.6b", "smollm2-135m", "llama-3.2-1b")
# The ops on the Llama family's path that Qwen3's ablation cannot judge (its decoder fuses them).
LLAMA_ONLY_OPS = ("rotary_embedding", "store_kv")


def model_paths(report):
    """Every registered model on the fast path: for each shape (random weights), at the dispatcher's defaults
    (accepted kernels): what of the fast path it runs on and why any part is off, the decode step at 256
    sequences (40 → 256 tokens) and a lone short request's TTFT; then the Llama family's own ablation of the
    ops on its path that Qwen3's gate never runs, on the embedded model's shape."""
    from kernellab.bench.latency import engine_decode_step, engine_ttft
    from kernellab.bench.steps import fresh_graph_matches_eager

    rows = {}
    for shape in PATH_SHAPES:
        eng = engine(None, model=shape, kernels="accepted", max_num_seqs=256, num_kv_blocks=8192)
        fp = eng.fast_path
        step = engine_decode_step(eng, 256, prompt_len=40, new_tokens=256)
        ttft = engine_ttft(eng, 32, reps=10)
        # a chat request after a shared 512-token system prompt that the prefix cache holds
        system = torch.randint(0, 10000, (CACHED_PREFIX,), generator=torch.Generator().manual_seed(4)).tolist()
        cached = engine_ttft(eng, 32, reps=10, seed=5, prefix=system)
        rows[shape] = {
            "fast_path": fp,
            "decode_256": step,
            "ttft_32_ms": round(statistics.median(ttft) * 1e3, 3),
            "ttft_32_after_cached_prefix_ms": round(statistics.median(cached) * 1e3, 3),
            "cached_prefix_tokens": CACHED_PREFIX,
            # a burst's first step (several fresh prompts) as its whole-step graph replays it and as eager runs it
            "fresh_graph_matches_eager": fresh_graph_matches_eager(eng, (("burst-8x256", 0, (256,) * 8),)),
        }
        log(
            f"path {shape:14s} graphs {'on ' if fp['cuda_graphs'] else 'off'} window {fp['decode_window']}  "
            f"decode step @256 {step['step_ms']:.3f} ms  {step['tok_per_s']:.0f} tok/s  "
            f"TTFT(32) {rows[shape]['ttft_32_ms']:.2f} ms, after a cached {CACHED_PREFIX}-token prefix "
            f"{rows[shape]['ttft_32_after_cached_prefix_ms']:.2f} ms; fresh-prompt graph ~ eager "
            f"{rows[shape]['fresh_graph_matches_eager']['pass']}"
        )
        if not fp["cuda_graphs"]:
            log(f"  graphs off: {fp['cuda_graphs_off']}")
        del eng
        gc.collect()
        torch.cuda.empty_cache()
    qwen = rows["qwen3-0.6b"]["decode_256"]["step_ms"]
    rows["targets"] = {
        "smollm2_step_vs_qwen3_max": 1.0,
        "llama_1b_step_vs_qwen3_max": 1.5,
        "lone_ttft_ms_max": 5.0,
        "smollm2_step_vs_qwen3": round(rows["smollm2-135m"]["decode_256"]["step_ms"] / qwen, 3),
        "llama_1b_step_vs_qwen3": round(rows["llama-3.2-1b"]["decode_256"]["step_ms"] / qwen, 3),
    }
    report["paths"] = rows
    rows["ablation_smollm2-135m"] = ablation(None, report, model="smollm2-135m", only=LLAMA_ONLY_OPS)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument(
        "--skip",
        action="append",
        default=[],
        help="offline_sweep, profile, prefill_steps, numerics, offline, latency, ablation, paths, fp8_kv, hf",
    )
    ap.add_argument("--only", action="append", default=[], help="run only these sections")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from kernellab.results import provenance

    path = out / "engine_h200.json"
    report = {
        "schema": "kernellab.gpu.engine/v1",
        "provenance": provenance("cuda"),
        "model": MODEL,
        "weights": "random (HF Qwen3 initialisation, seed 0), exact Qwen3-0.6B shape",
        "numerics": {},
        "offline": [],
        "latency": None,
        "ablation": None,
        "errors": [],
        "_path": str(path),
    }
    hf = hf_model(torch.bfloat16)
    weights = [(k, v) for k, v in hf.state_dict().items()]
    log(f"{torch.cuda.get_device_name()} torch {torch.__version__}; HF model ready")
    for name, fn in (
        ("offline_sweep", lambda: offline_sweep(weights, report)),
        ("profile", lambda: profile(weights, report)),
        ("prefill_steps", lambda: prefill_steps(weights, report)),
        ("numerics", lambda: numerics(hf, weights, report)),
        ("latency", lambda: latency(weights, report, None if "hf" in args.skip else hf)),
        ("offline", lambda: offline(weights, report, None if "hf" in args.skip else hf)),
        ("ablation", lambda: report.__setitem__("ablation", ablation(weights, report))),
        ("paths", lambda: model_paths(report)),
        ("fp8_kv", lambda: fp8_kv(hf, weights, report, engine, hf_model, log)),
    ):
        if name in args.skip or (args.only and name not in args.only):
            continue
        try:
            fn()
        except Exception as exc:  # keep going: a later section's numbers are still worth having
            report["errors"].append({"section": name, "error": repr(exc), "trace": traceback.format_exc()[-3000:]})
            log(f"{name} FAILED: {exc!r}")
            traceback.print_exc()
        path.write_text(json.dumps(report, indent=2, default=str))
        gc.collect()
        torch.cuda.empty_cache()
    report.pop("_path")
    path.write_text(json.dumps(report, indent=2, default=str))
    print_table(report)
    return 1 if report["errors"] else 0


def print_table(report) -> None:
    print("\n=== engine gate (H200, Qwen3-0.6B shape, bf16) ===")
    n = report["numerics"]
    for key in ("layer_cosine", "teacher_forced", "graph_equals_eager", "chunk_graph_matches_eager"):
        if key in n:
            print(f"{key:24s} pass={n[key]['pass']}")
    steps = report.get("prefill_steps") or {}
    if "numerics" in steps:
        print(f"piecewise ~ eager         pass={steps['numerics']['pass']}")
    if "fresh_graph_numerics" in steps:
        print(f"fresh-prompt graphs ~ eager pass={steps['fresh_graph_numerics']['pass']}")
    for r in steps.get("steps", []):
        print(
            f"step {r['mix']:20s} graph {r.get('graph_ms', '-'):>8} ms  piecewise {r.get('piecewise_ms', '-'):>8} ms  "
            f"eager {r['eager_ms']:>8} ms"
        )
    for r in report["offline"]:
        print(f"offline {r['system']:24s} {r['workload']:18s} {r['output_tok_per_s']:>10.0f} tok/s")
    if report["latency"]:
        for r in report["latency"]["rows"]:
            print(f"latency {r['system']:24s} {r['metric']}@{r['tokens']:<5d} {r['ms_p50']:>9.3f} ms")
    if report["ablation"]:
        for op, r in report["ablation"].items():
            if not isinstance(r, dict) or "tok_per_s" not in r:
                continue
            gain = (
                f"  gain {r['e2e_gain_tok_per_s_pct']:+.1f}% / ITL {r['e2e_gain_itl_pct']:+.1f}%"
                if "effects" in r
                else ""
            )
            print(
                f"ablation {op:24s} {r.get('status', ''):12s} {r['tok_per_s']:>8.0f} tok/s  ITL {r['itl_ms']:.3f} ms"
                + gain
            )
    fp8 = report.get("fp8_kv") or {}
    if "gate" in fp8:
        pct = fp8["gate"]["agreement_vs_hf_fp32_pct"]
        print(f"fp8 KV gate              pass={fp8['gate']['pass']['fp8_cache']}  {pct}")
    for r in fp8.get("offline", []):
        print(f"offline fp8 section kv={r['kv_cache_dtype']:5s} {r['output_tok_per_s']:>10.0f} tok/s")
    print(f"errors: {len(report['errors'])}")


if __name__ == "__main__":
    sys.exit(main())
