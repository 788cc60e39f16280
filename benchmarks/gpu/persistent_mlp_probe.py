#!/usr/bin/env python3
"""Is a grid barrier cheaper than a kernel boundary? The batch-1 MLP of 28 layers, three ways, on the GPU.

A decode layer at batch 1 is five kernels (QKV GEMV with the norm in front, the attention, o_proj, gate/up with the
norm, down with the SwiGLU) whose boundaries cost more than their bytes (docs/gpu-engine.md: ~27 µs a layer for
8.3 µs of weight reads on the H200). A persistent layer kernel would replace the boundaries with grid barriers.
This probe measures that trade on the MLP's two GEMVs (``kernels/persistent.py``):

- ``engine``: ``gemv.add_rms_norm_linear`` then ``gemv.silu_and_mul_linear``, as the engine runs them (PDL on
  Hopper);
- ``persistent``: one launch, one program an SM, a grid barrier between the phases, the first down-projection tile
  loaded before it (``--programs`` adds other program counts);
- ``persistent_pdl``: the same launched with PDL (not cooperative), its first gate/up tile loaded before it waits
  for the previous layer;
- ``two_launch`` / ``two_launch_pdl``: the persistent kernel's phases as two launches (the barrier's share).

Each variant is a CUDA graph of 28 chained MLPs (the output and residual sum of one feed the next) over 28
distinct weight sets (504 MB: no L2 reuse), replayed ``--replays`` times a round, variants interleaved over
``--rounds`` rounds; the figure is µs per layer (median round). Every variant's final output is compared with the
engine's (max |difference|; the row's sum of squares may be reduced in another order).

    python3 benchmarks/gpu/persistent_mlp_probe.py --out "$OUT/persistent_mlp"   # on the device machine (env.sh)
    python3 benchmarks/gpu/persistent_mlp_probe.py --out /tmp/pmlp --device cpu  # the path, under the interpreter
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

H, F, LAYERS = 1024, 3072, 28  # Qwen3-0.6B: hidden, intermediate (F), layers


def _variants(programs: list[int]) -> dict:
    from kernellab.kernels import gemv, persistent

    def engine(x, res, nw, wgu, wd):
        gu, r = gemv.add_rms_norm_linear(x, res, nw, 1e-6, wgu)
        return gemv.silu_and_mul_linear(gu, wd), r

    out = {"engine": engine}
    # safest first: a cooperative launch the driver or the graph capture refuses comes last, so it cannot spoil the
    # stream for the others
    out["two_launch"] = lambda x, res, nw, wgu, wd: persistent.mlp_decode(x, res, nw, 1e-6, wgu, wd, fused=False)
    out["two_launch_pdl"] = lambda x, res, nw, wgu, wd: persistent.mlp_decode(
        x, res, nw, 1e-6, wgu, wd, fused=False, pdl=True
    )
    # with PDL (Hopper): the next layer's kernel is scheduled early and loads its first weight tile before it waits;
    # a cooperative launch may not take the PDL attribute, so the fused form is tried without it
    out[f"persistent_pdl_p{programs[0]}"] = lambda x, res, nw, wgu, wd: persistent.mlp_decode(
        x, res, nw, 1e-6, wgu, wd, programs=programs[0], cooperative=False, pdl=True
    )
    for p in programs:
        out[f"persistent_p{p}"] = lambda x, res, nw, wgu, wd, p=p: persistent.mlp_decode(
            x, res, nw, 1e-6, wgu, wd, programs=p
        )
    return out


def _chain(fn, x, res, layers):
    for nw, wgu, wd in layers:
        x, res = fn(x, res, nw, wgu, wd)
    return x, res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--programs", default="", help="comma-separated program counts besides one an SM")
    args = ap.parse_args()

    from kernellab.kernels._common import num_sms
    from kernellab.results import provenance, write

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    if not cuda:  # the rehearsal runs the kernels under TRITON_INTERPRET=1
        from kernellab.kernels.testing import patch_interpreter

        patch_interpreter()
    dtype = torch.bfloat16 if cuda else torch.float32
    h, i, n_layers = (H, F, LAYERS) if cuda else (64, 96, 2)
    gen = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *s, scale: (torch.randn(*s, generator=gen, device=dev) * scale).to(dtype)  # noqa: E731
    layers = [(1 + rnd(h, scale=0.1), rnd(2 * i, h, scale=h**-0.5), rnd(h, i, scale=i**-0.5)) for _ in range(n_layers)]
    x0, res0 = rnd(1, h, scale=1.0), rnd(1, h, scale=1.0)
    sms = num_sms(dev) if cuda else 1
    programs = [sms] + [int(p) for p in args.programs.split(",") if p.strip()]
    variants = _variants(programs)

    record: dict = {
        "schema": "kernellab.bench.persistent_mlp_probe/v1",
        "provenance": provenance(str(dev)),
        "workload": {"hidden": h, "intermediate": i, "layers": n_layers, "dtype": str(dtype).removeprefix("torch."),
                     "replays_per_round": args.replays, "rounds": args.rounds, "programs": programs},
        "variants": {},
    }  # fmt: skip
    ref_out = None
    runners = {}
    for name, fn in variants.items():
        entry: dict = {}
        record["variants"][name] = entry
        try:
            y, r = _chain(fn, x0, res0, layers)  # compiles; a hang here is the barrier's (the caller's timeout)
            if cuda:
                torch.cuda.synchronize()
            if ref_out is None:
                ref_out = (y.float(), r.float())
            entry["max_abs_diff_vs_engine"] = max(
                (y.float() - ref_out[0]).abs().max().item(), (r.float() - ref_out[1]).abs().max().item()
            )
            again, _ = _chain(fn, x0, res0, layers)
            entry["repeatable"] = bool(torch.equal(again, y))
            if cuda:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    _chain(fn, x0, res0, layers)
                graph.replay()
                torch.cuda.synchronize()
                runners[name] = graph.replay
            else:
                runners[name] = lambda fn=fn: _chain(fn, x0, res0, layers)
            print(f"{name}: ready, max |diff| vs engine {entry['max_abs_diff_vs_engine']:.2e}", flush=True)
        except Exception as exc:  # a variant the driver refuses (e.g. too many programs) is a result
            entry["error"] = f"{type(exc).__name__}: {exc}"[:500]
            print(f"{name}: {entry['error']}", flush=True)

    times: dict[str, list[float]] = {n: [] for n in runners}
    replays = args.replays if cuda else 1
    for _ in range(args.rounds if cuda else 1):
        for name, run in runners.items():
            if cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(replays):
                    run()
                b.record()
                b.synchronize()
                us = a.elapsed_time(b) * 1e3
            else:
                t0 = time.perf_counter()
                run()
                us = (time.perf_counter() - t0) * 1e6
            times[name].append(us / replays / n_layers)
    base = statistics.median(times["engine"]) if times.get("engine") else None
    print(f"{'variant':<22} {'us/layer':>9} {'vs engine':>10} {'max|diff|':>10}")
    for name, ts in times.items():
        med = statistics.median(ts)
        entry = record["variants"][name]
        entry.update(us_per_layer_median=round(med, 3), us_per_layer_rounds=[round(t, 3) for t in ts])
        if base:
            entry["speedup_vs_engine"] = round(base / med, 4)
        print(f"{name:<22} {med:9.2f} {base / med if base else 0:10.3f} {entry['max_abs_diff_vs_engine']:10.2e}")
    args.out.mkdir(parents=True, exist_ok=True)
    write(args.out / "persistent_mlp_probe.json", record)


if __name__ == "__main__":
    main()
