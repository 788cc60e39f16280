"""The 8-bit KV caches on the GPU (FP8 e4m3 and int8, both with per-token scales), one section of the engine
gate (``run_engine.py --only fp8_kv``).

1. Kernel: the paged decode attention reading bf16 vs FP8 caches at the offline workload's shapes, in µs and
   GB/s of the bytes each must read, against the card's measured read bandwidth.
2. Numerics gate (issue 12): teacher-forced argmax agreement with HF fp32 where every scored position attends a
   context read back from the cache (``kernellab.bench.numerics.kv_cache_gate``), the FP8 cache no worse than
   HF bf16 minus 0.5 points; per-layer cosine against an fp32 engine; greedy graph == eager with FP8.
3. Speed: the offline nano-vllm workload with the FP8 cache (target 27,000 tok/s), and batch-1 ITL at context
   2,048, next to the bf16 cache in the same run.
"""

from __future__ import annotations

import gc
import statistics

import torch

READ_BW_GBS = 3630.0  # the H200's measured read bandwidth (docs/gpu-engine.md; issue 12)
OFFLINE_FP8_TARGET = 27000.0


def _decode_case(batch: int, ctx: int, Hq: int, Hk: int, D: int, bs: int) -> dict:
    from triton.testing import do_bench

    from kernellab.kernels.paged_attention import paged_decode_attention
    from kernellab.runtime import ops
    from kernellab.runtime.config import default_block_size

    nblocks = batch * (ctx // bs)
    gen = torch.Generator(device="cuda").manual_seed(batch)
    k = torch.randn(nblocks, bs, Hk, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    v = torch.randn(nblocks, bs, Hk, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    q = torch.randn(batch, Hq, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    tables = torch.randperm(nblocks, device="cuda").to(torch.int32).view(batch, -1)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    scale = D**-0.5
    t_bf16 = do_bench(lambda: paged_decode_attention(q, k, v, tables, lens, scale), warmup=25, rep=200)
    tokens = batch * ctx
    bytes_bf16 = 2 * tokens * Hk * D * 2
    bytes_8bit = 2 * tokens * Hk * (D + 4)
    row = {
        "batch": batch,
        "context": ctx,
        "bf16_us": round(t_bf16 * 1e3, 2),
        "bf16_gbs": round(bytes_bf16 / t_bf16 / 1e6, 1),
    }
    for name, dtype in (("fp8", ops.FP8_DTYPE), ("int8", ops.INT8_DTYPE)):
        cache_bs = default_block_size(name)  # each cache in the engine's block size (int8: 64-token blocks)
        if cache_bs != bs:  # the same tokens in blocks of that size, the table drawn again
            k, v = k.view(-1, cache_bs, Hk, D), v.view(-1, cache_bs, Hk, D)
            tables = torch.randperm(k.shape[0], device="cuda").to(torch.int32).view(batch, -1)
        k8, ks = ops.quantize_kv(k, dtype)
        v8, vs = ops.quantize_kv(v, dtype)
        v8 = ops.v_cache_zeros(v8.shape, dtype, v8.device).copy_(v8)  # the engine's layout (int8: V transposed)
        sc = {"k_scales": ks, "v_scales": vs}
        ref = ops.paged_decode_attention(q, k8, v8, tables, lens, scale, **sc)
        out = paged_decode_attention(q, k8, v8, tables, lens, scale, **sc)
        err = float((out.float() - ref.float()).norm() / ref.float().norm())
        t = do_bench(
            lambda k8=k8, v8=v8, sc=sc, tb=tables: paged_decode_attention(q, k8, v8, tb, lens, scale, **sc),
            warmup=25,
            rep=200,
        )
        row |= {
            f"{name}_us": round(t * 1e3, 2),
            f"{name}_speedup" if name != "fp8" else "speedup": round(t_bf16 / t, 3),
            f"{name}_gbs": round(bytes_8bit / t / 1e6, 1),
            f"{name}_pct_of_read_bw": round(100 * bytes_8bit / t / 1e6 / READ_BW_GBS, 1),
            f"{name}_rel_err_vs_reference": err,
        }
        del k8, v8, ks, vs
    return row


def _decode_kernel(report: dict, log) -> None:
    from kernellab.runtime.config import default_block_size

    Hq, Hk, D, bs = 16, 8, 128, 16
    rows = []
    for batch, ctx in ((64, 1024), (256, 1024), (1, 4096)):
        row = _decode_case(batch, ctx, Hq, Hk, D, bs)
        rows.append(row)
        log(
            f"fp8 decode kernel B={batch} ctx={ctx}: bf16 {row['bf16_us']} µs ({row['bf16_gbs']} GB/s), "
            f"fp8 {row['fp8_us']} µs ({row['fp8_gbs']} GB/s, {row['fp8_pct_of_read_bw']} %), "
            f"rel err {row['fp8_rel_err_vs_reference']:.1e}; int8 {row['int8_us']} µs ({row['int8_pct_of_read_bw']} %), "
            f"rel err {row['int8_rel_err_vs_reference']:.1e}"
        )
        torch.cuda.empty_cache()
    report["kernel"] = {
        "shape": {"Hq": Hq, "Hk": Hk, "D": D, "block_size": bs, "int8_block_size": default_block_size("int8")},
        "rows": rows,
    }


def _numerics(hf_bf16, weights, report: dict, engine, hf_model, log) -> None:
    from kernellab.bench.numerics import graph_equals_eager, kv_cache_gate

    gen = torch.Generator().manual_seed(1)
    seqs = torch.randint(0, 10000, (256, 96), generator=gen).tolist()
    chunk = dict(max_num_batched_tokens=64)
    engines = {
        "bf16_cache": engine(weights, **chunk),
        "fp8_cache": engine(weights, kv_cache_dtype="fp8", **chunk),
        "int8_cache": engine(weights, kv_cache_dtype="int8", **chunk),
        "fp32_reference": engine(weights, dtype="float32", kernels="none", cuda_graphs=False, **chunk),
    }
    hf_fp32 = hf_model(torch.float32)
    hf_fp32.load_state_dict({k: v.float() for k, v in hf_bf16.state_dict().items()})
    gate = kv_cache_gate(engines, hf_fp32, hf_bf16, seqs, reference="fp32_reference")
    report["gate"] = gate
    pct = gate["agreement_vs_hf_fp32_pct"]
    log(
        f"fp8 gate: agreement vs HF fp32 fp8 {pct['fp8_cache']:.2f}%  int8 {pct['int8_cache']:.2f}%  bf16 cache "
        f"{pct['bf16_cache']:.2f}%  HF bf16 {pct['hf_bf16']:.2f}%  → pass fp8={gate['pass']['fp8_cache']} "
        f"int8={gate['pass']['int8_cache']}"
    )
    del hf_fp32, engines
    gc.collect()

    # greedy graph replays (multi-step windows) == eager single steps, with each 8-bit cache
    for kv in ("fp8", "int8"):
        eng = engine(weights, kv_cache_dtype=kv)
        check = graph_equals_eager(eng, seqs[:16])
        report["graph_equals_eager" if kv == "fp8" else f"graph_equals_eager_{kv}"] = check
        log(f"{kv} graph == eager: {check['pass']}")
        del eng


def _speed(weights, report: dict, engine, log) -> None:
    from kernellab.bench.latency import engine_itl
    from kernellab.bench.offline import run_engine
    from kernellab.bench.workloads import nanovllm

    prompts, outs = nanovllm()
    runs = []
    for kv in ("auto", "fp8", "int8"):
        eng = engine(weights, kv_cache_dtype=kv, max_num_seqs=256, num_kv_blocks=None)
        run = run_engine(eng, prompts, outs, "nanovllm-256", "bfloat16")
        run["kv_cache_dtype"] = "bf16" if kv == "auto" else kv
        run["kv_blocks"] = eng.runner.num_blocks
        runs.append(run)
        log(
            f"offline nano-vllm kv={run['kv_cache_dtype']}: {run['output_tok_per_s']:.0f} tok/s, {run['kv_blocks']} blocks"
        )
        del eng
        gc.collect()
        torch.cuda.empty_cache()
    itl = {}
    for kv in ("auto", "fp8", "int8"):
        eng = engine(weights, kv_cache_dtype=kv, max_num_seqs=8, max_model_len=4096)
        itl["bf16" if kv == "auto" else kv] = round(statistics.median(engine_itl(eng, 2048, new_tokens=48)) * 1e3, 3)
        del eng
    log(f"batch-1 ITL @2048: bf16 cache {itl['bf16']} ms, fp8 cache {itl['fp8']} ms, int8 cache {itl['int8']} ms")
    fp8 = next(r for r in runs if r["kv_cache_dtype"] == "fp8")
    int8 = next(r for r in runs if r["kv_cache_dtype"] == "int8")
    report["offline"] = runs
    report["itl_ms_at_2048"] = itl
    report["targets"] = {
        "offline_fp8_tok_s_min": OFFLINE_FP8_TARGET,
        "offline_fp8_tok_s": fp8["output_tok_per_s"],
        "offline_fp8_met": fp8["output_tok_per_s"] >= OFFLINE_FP8_TARGET,
        "offline_int8_tok_s": int8["output_tok_per_s"],
        "offline_int8_met": int8["output_tok_per_s"] >= OFFLINE_FP8_TARGET,
    }


def fp8_kv(hf_bf16, weights, report: dict, engine, hf_model, log) -> None:
    """Run the three parts into ``report["fp8_kv"]``; ``engine``/``hf_model``/``log`` are run_engine's helpers."""
    from kernellab.kernels import paged_attention

    section: dict = {"launch": {"fp8": dict(paged_attention.FP8_LAUNCH), "int8": dict(paged_attention.INT8_LAUNCH)}}
    report["fp8_kv"] = section
    for part in (
        lambda: _decode_kernel(section, log),
        lambda: _numerics(hf_bf16, weights, section, engine, hf_model, log),
        lambda: _speed(weights, section, engine, log),
    ):
        part()
        gc.collect()
        torch.cuda.empty_cache()
