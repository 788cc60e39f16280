"""Prefill attention backends on the GPU, at Qwen3-0.6B's attention shape (16 query / 8 KV heads, D = 128, bf16).

Which PyTorch path should a prefill step take: SDPA's FlashAttention with the KV heads repeated or with
``enable_gqa``, cuDNN attention, ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention's packed variable-
length entry, with a paged ``block_table`` where the installed PyTorch has it), against the engine's own
``ops`` paths (one prompt; packed prompts padded into one batch; a chunk continuing a cached context, gathered).
Every candidate is checked against the fp32 reference before it is timed; one that raises is recorded as such.

    python benchmarks/gpu/prefill_attention.py --out "$OUT/prefill_attention.json" [--triton-sweep]

``--triton-sweep`` adds the engine's Triton kernel (``kernels/attention.py``) at ~40 launch settings on the
single-prompt cases, its Hopper form (tensor-descriptor tiles, a warp-specialised key loop, longest query tiles
first) among them. ``--tiles m64n64w4s3,...`` times the Hopper form (descriptors, longest tiles first) at just
those settings instead (``m`` query rows, ``n`` keys a tile, ``w`` warps, ``s`` stages), and ``--cases`` keeps the
cases whose names contain one of its comma-separated parts (``--cases 'one prompt'``).
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import re
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from kernellab.results import provenance
from kernellab.runtime import ops

HQ, HK, D, BS = 16, 8, 128, 16
SCALE = D**-0.5


def timed(fn: Callable[[], torch.Tensor], reps: int = 20) -> tuple[float, str]:
    """Median µs of one call. Captured in a CUDA graph where the call allows it (as the engine's prefill graphs
    run it: no host cost), else per eager call with the host work included; returns (µs, method)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
        step, method = graph.replay, "graph"
    except Exception:  # a host sync or an allocation pattern capture refuses
        torch.cuda.synchronize()
        step, method = fn, "eager"
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(5):
            step()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / 5)
    return sorted(times)[len(times) // 2], method


def reference(q, k, v, cu):
    """fp32 per-sequence causal attention (queries at the end of their keys)."""
    out = []
    for (qs, qe), (ks, ke) in zip(itertools.pairwise(cu["q"]), itertools.pairwise(cu["k"]), strict=True):
        out.append(ops.causal_attention(q[qs:qe].float(), k[ks:ke].float(), v[ks:ke].float(), SCALE, HQ // HK))
    return torch.cat(out)


def sdpa(q, k, v, backend, gqa: bool):
    from torch.nn.attention import sdpa_kernel

    qh, kh, vh = (x.transpose(0, 1)[None] for x in (q, k, v))
    if not gqa:
        kh, vh = kh.repeat_interleave(HQ // HK, dim=1), vh.repeat_interleave(HQ // HK, dim=1)
    with sdpa_kernel([backend]):
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=SCALE, enable_gqa=gqa)
    return o[0].transpose(0, 1)


def varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    if "enable_gqa" in params:  # older builds take fewer KV heads as they are
        kw["enable_gqa"] = True
    if "window_size" in params:
        kw["window_size"] = (-1, 0)  # causal, aligned to the end of the keys
    else:
        kw["is_causal"] = True
    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=SCALE, **kw)


def paged_cache(k, v, lens, gen):
    """Scatter each sequence's K/V into random blocks of a (N, BS, Hk, D) cache; returns caches and tables."""
    nblk = [-(-n // BS) for n in lens]
    perm = torch.randperm(sum(nblk), generator=gen).cuda().to(torch.int32)
    kc = torch.zeros(sum(nblk), BS, HK, D, dtype=k.dtype, device="cuda")
    vc = torch.zeros_like(kc)
    tables = torch.zeros(len(lens), max(nblk), dtype=torch.int32, device="cuda")
    start, tok = 0, 0
    for b, n in enumerate(lens):
        tables[b, : nblk[b]] = perm[start : start + nblk[b]]
        pos = torch.arange(n, device="cuda")
        slots = tables[b, pos // BS].long() * BS + pos % BS
        kc.view(-1, HK, D)[slots] = k[tok : tok + n]
        vc.view(-1, HK, D)[slots] = v[tok : tok + n]
        start, tok = start + nblk[b], tok + n
    return kc, vc, tables


def triton_configs(sweep: bool) -> list[dict]:
    """Launch settings of ``kernels.attention.causal_attention`` to time on one prompt: its default (pointer loads),
    and with ``--triton-sweep`` the Hopper form's settings (tensor-descriptor tiles, warp-specialised key loop,
    longest query tiles first) next to the pointer form's."""
    base = {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3}
    if not sweep:
        return [base]
    out = [{**base, "num_stages": st} for st in (2, 3, 4)] + [{**base, "block_n": 128, "num_stages": 2}]
    for (bm, bn), st, ws, heavy in itertools.product(((128, 64), (128, 128)), (2, 3, 4), (False, True), (False, True)):
        out.append({**base, "block_m": bm, "block_n": bn, "num_stages": st, "tma": True, "warp_specialize": ws,
                    "heavy_first": heavy})  # fmt: skip
    out += [{**base, "num_warps": 4, "block_n": bn, "tma": True, "heavy_first": True} for bn in (64, 128)]  # no WS at 4
    return out


def tile_configs(spec: str) -> list[dict]:
    """``--tiles``: ``m64n64w4s3,m128n128w8s3`` → the Hopper form's launch settings, longest tiles first."""
    out = []
    for part in spec.split(","):
        m = re.fullmatch(r"m(\d+)n(\d+)w(\d+)s(\d+)", part.strip())
        if m is None:
            raise SystemExit(f"--tiles: {part!r} is not of the form m64n64w4s3")
        bm, bn, w, st = (int(g) for g in m.groups())
        out.append({"block_m": bm, "block_n": bn, "num_warps": w, "num_stages": st, "tma": True, "heavy_first": True})
    return out


def triton_label(cfg: dict) -> str:
    flags = [f for f in ("tma", "warp_specialize", "heavy_first") if cfg.get(f)]
    return f"triton m{cfg['block_m']} n{cfg['block_n']} w{cfg['num_warps']} s{cfg['num_stages']}" + "".join(
        f" {f}" for f in flags
    )


def case(name: str, q_lens: list[int], ctx_lens: list[int], gen, configs: list[dict] | None = None) -> dict:
    kv_total = sum(ctx_lens)
    q = torch.randn(sum(q_lens), HQ, D, generator=gen).cuda().bfloat16()
    k = torch.randn(kv_total, HK, D, generator=gen).cuda().bfloat16()
    v = torch.randn(kv_total, HK, D, generator=gen).cuda().bfloat16()
    cu = {"q": [0], "k": [0]}
    for n, c in zip(q_lens, ctx_lens, strict=True):
        cu["q"].append(cu["q"][-1] + n)
        cu["k"].append(cu["k"][-1] + c)
    ref = reference(q, k, v, cu)
    cu_q = torch.tensor(cu["q"], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor(cu["k"], dtype=torch.int32, device="cuda")
    fresh = q_lens == ctx_lens
    cands: dict[str, Callable[[], torch.Tensor]] = {}
    if fresh and len(q_lens) == 1:
        from torch.nn.attention import SDPBackend

        for label, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            cands[f"sdpa-{label}-repeat"] = lambda b=backend: sdpa(q, k, v, b, gqa=False)
            cands[f"sdpa-{label}-gqa"] = lambda b=backend: sdpa(q, k, v, b, gqa=True)
        cands["ops.causal_attention"] = lambda: ops.causal_attention(q, k, v, SCALE, HQ // HK)
        from kernellab.kernels.attention import causal_attention

        out = torch.empty_like(q)  # one buffer, as a graph's step has it
        for cfg in configs or []:
            cands[triton_label(cfg)] = lambda c=cfg: causal_attention(q, k, v, SCALE, HQ // HK, out=out, **c)
    elif fresh:
        cands["ops.varlen_causal_attention (padded)"] = lambda: ops.varlen_causal_attention(q, k, v, cu["q"], SCALE)
        from kernellab.kernels.attention import PREFILL_TILES, packed_causal_attention

        tiles = PREFILL_TILES
        for bm, bn in ((tiles["block_m"], tiles["block_n"]), (128, 64), (64, 64)):  # the engine's tiles first
            cands[f"triton packed m{bm} n{bn}"] = lambda bm=bm, bn=bn: packed_causal_attention(
                q, k, v, cu_q, cu["q"][-1], SCALE, **{**tiles, "block_m": bm, "block_n": bn}
            )
    else:
        kc, vc, tables = paged_cache(k, v, ctx_lens, gen)
        used = torch.tensor(ctx_lens, dtype=torch.int32, device="cuda")
        cands["ops.paged_prefill_attention (gather)"] = lambda: ops.paged_prefill_attention(
            q, kc, vc, tables, cu_q, used, SCALE
        )
        cands["varlen_attn-block_table"] = lambda: varlen(
            q, kc, vc, cu_q, None, max(q_lens), max(ctx_lens), seqused_k=used, block_table=tables
        )
    cands["varlen_attn"] = lambda: varlen(q, k, v, cu_q, cu_k, max(q_lens), max(ctx_lens))
    pairs = sum(sum(c - n + i + 1 for i in range(n)) for n, c in zip(q_lens, ctx_lens, strict=True))
    flops = 4 * HQ * D * pairs
    rows = {}
    for label, fn in cands.items():
        try:
            err = (fn().float() - ref).abs().max().item()
            us, method = timed(fn) if err < 2e-2 else (None, None)
            rows[label] = {
                "max_abs_err": err,
                "us": us,
                "method": method,
                "tflops": round(flops / us / 1e6, 1) if us else None,
            }
        except Exception as e:  # a backend the installed build lacks: record why
            rows[label] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        print(f"{name:32s} {label:42s} {rows[label]}", flush=True)
    return {"q_lens": q_lens if len(q_lens) <= 8 else f"{len(q_lens)} seqs", "flops": flops, "paths": rows}


def fa3_cases(gen) -> dict:
    """SDPA's FlashAttention backend switched to PyTorch's registered FA3 implementation, where its kernels are
    installed (``torch.nn.attention.activate_flash_attention_impl``), on the single-prompt cases."""
    from torch.nn import attention
    from torch.nn.attention import SDPBackend

    try:
        attention.activate_flash_attention_impl("FA3")
    except Exception as e:
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    rows = {}
    try:
        for n in (2048, 4096):
            q = torch.randn(n, HQ, D, generator=gen).cuda().bfloat16()
            k, v = (torch.randn(n, HK, D, generator=gen).cuda().bfloat16() for _ in range(2))
            ref = reference(q, k, v, {"q": [0, n], "k": [0, n]})
            try:
                fn = lambda q=q, k=k, v=v: sdpa(q, k, v, SDPBackend.FLASH_ATTENTION, gqa=True)  # noqa: E731
                err = (fn().float() - ref).abs().max().item()
                us, method = timed(fn)
                rows[f"one prompt {n}"] = {"max_abs_err": err, "us": us, "method": method}
            except Exception as e:
                rows[f"one prompt {n}"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            print(f"FA3 one prompt {n}: {rows[f'one prompt {n}']}", flush=True)
    finally:
        attention.restore_flash_attention_impl()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--triton-sweep", action="store_true", help="time the Triton kernel's launch settings too")
    ap.add_argument("--tiles", default="", help="the Hopper form at these settings only (m64n64w4s3,...)")
    ap.add_argument("--cases", default="", help="only the cases whose names contain one of these (comma-separated)")
    args = ap.parse_args()
    configs = tile_configs(args.tiles) if args.tiles else triton_configs(args.triton_sweep)
    gen = torch.Generator().manual_seed(0)
    mixed = torch.randint(100, 1025, (8,), generator=gen).tolist()
    cases = {
        "one prompt 2048": ([2048], [2048]),
        "one prompt 4096": ([4096], [4096]),
        "8 prompts x 512": ([512] * 8, [512] * 8),
        "8 prompts 100..1024": (mixed, mixed),
        "chunk 512 after 1536 cached": ([512], [2048]),
        "4 chunks 256 after 256..1792": ([256] * 4, [512, 1024, 1536, 2048]),
    }
    if args.cases:
        keep = [c.strip() for c in args.cases.split(",")]
        cases = {name: c for name, c in cases.items() if any(k in name for k in keep)}
    t0 = time.perf_counter()
    try:
        from torch.nn import attention

        impls = attention.list_flash_attention_impls()
    except Exception as e:
        impls = f"{type(e).__name__}: {e}"
    report = {
        "schema": "kernellab.bench.prefill_attention/v1",
        "provenance": provenance("cuda"),
        "shape": {"Hq": HQ, "Hk": HK, "D": D, "block_size": BS, "dtype": "bfloat16"},
        "flash_attention_impls": impls,
        "cudnn_version": torch.backends.cudnn.version(),
        "cases": {name: case(name, ql, cl, gen, configs) for name, (ql, cl) in cases.items()},
    }
    report["fa3"] = fa3_cases(gen)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
