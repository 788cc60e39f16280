#!/usr/bin/env python3
"""Instructions per token of the paged decode attention's inner loop, from its sm_90 SASS, on a machine without a
GPU: what a kernel form costs in issue slots before the H200 times it.

Each form is launched once under Triton's interpreter at the gate's shape (Qwen3-0.6B: 16 query / 8 KV heads,
head_dim 128, blocks of 16, one slice per sequence), its specialization recorded as the GPU's JIT would make it
(``compile_check.describe``, plus the 16-divisibility of every pointer and of every integer argument that has it,
which is what lets the compiler vectorize loads), then compiled for ``sm_90`` in a child process with the ptxas
Triton carries, disassembled with its ``cuobjdump`` and the longest backward branch taken as the tile loop.
Prints and writes (``--out``) per form: registers, shared memory, the loop's instructions and their count per
context token, and its ten most frequent opcodes.

    python benchmarks/kernels/sass_loop.py --out results/kernels/sass_decode_attention.json

Forms: the bf16 cache; the int8 cache with V laid out like K, its tiles widened to fp16 by byte permutes (the form
before the transposed layout); the int8 cache with V transposed within its blocks (int8 tensor-core dots); the
FP8 cache (widened to fp16).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

SHAPE = {"batch": 2, "context": 256, "Hq": 16, "Hk": 8, "D": 128, "block_size": 16}


def record() -> dict:
    """Each form's launch (``compile_check`` form) with ``aligned``: the arguments divisible by 16."""
    os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from kernellab.kernels import compile_check
    from kernellab.kernels.paged_attention import INT8_LAUNCH, paged_decode_attention
    from kernellab.kernels.testing import patch_interpreter
    from kernellab.runtime import ops

    patch_interpreter()
    B, ctx, Hq, Hk, D, bs = (SHAPE[k] for k in ("batch", "context", "Hq", "Hk", "D", "block_size"))
    gen = torch.Generator().manual_seed(0)
    blocks = B * ctx // bs
    k = torch.randn(blocks, bs, Hk, D, generator=gen).bfloat16()
    v = torch.randn(blocks, bs, Hk, D, generator=gen).bfloat16()
    q = torch.randn(B, Hq, D, generator=gen).bfloat16()
    tables = torch.arange(blocks, dtype=torch.int32).view(B, -1)
    lens = torch.full((B,), ctx, dtype=torch.int32)
    forms = {"bf16": (k, v, {}, {})}
    for name, dtype in (("int8_dense_widened", ops.INT8_DTYPE), ("fp8_widened", ops.FP8_DTYPE)):
        (k8, ks), (v8, vs) = ops.quantize_kv(k, dtype), ops.quantize_kv(v, dtype)
        forms[name] = (k8, v8, {"k_scales": ks, "v_scales": vs}, {"i8_mma": False} if dtype == torch.int8 else {})
        if dtype == torch.int8:
            v_t = ops.v_cache_zeros(v8.shape, dtype, v8.device).copy_(v8)  # the engine's int8 layout
            forms["int8_transposed_v_dots"] = (k8, v_t, forms[name][2], {"i8_mma": True, "i8_pack_heads": 0})
            # the packed form as the engine launches it at 256 rows or more (its own tile settings)
            pack = {"i8_mma": True, "i8_pack_heads": INT8_LAUNCH["pack_heads"], **INT8_LAUNCH["pack_launch"]}
            forms["int8_packed_heads"] = (k8, v_t, forms[name][2], pack)
            for sel in (1, 2):  # the packed forms whose operands are shared and outputs selected
                if sel != INT8_LAUNCH.get("pack_select"):
                    forms[f"int8_packed_select{sel}"] = (k8, v_t, forms[name][2], {**pack, "i8_pack_select": sel})
    # the descriptor forms read one block a tile: the engine's int8 cache at its 64-token blocks (head-major scales)
    bs64 = 64
    k64, v64 = (x.view(B, ctx, Hk, D).view(-1, bs64, Hk, D) for x in (k, v))
    (k8, ks), (v8, vs) = ops.quantize_kv(k64, ops.INT8_DTYPE), ops.quantize_kv(v64, ops.INT8_DTYPE)
    v_t = ops.v_cache_zeros(v8.shape, ops.INT8_DTYPE, v8.device).copy_(v8)
    sc = {
        n: ops.scale_zeros(tuple(x.shape), ops.INT8_DTYPE, x.device).copy_(x)
        for n, x in (("k_scales", ks), ("v_scales", vs))
    }
    tables64 = torch.arange(B * ctx // bs64, dtype=torch.int32).view(B, -1)
    tma_forms = {"int8_tma": 1, "int8_tma_stacked": 2}
    for name, tma in tma_forms.items():
        forms[name] = (k8, v_t, sc, {"i8_mma": True, "i8_pack_heads": 0, "i8_tma": tma, **INT8_LAUNCH["tma_launch"]})
    out = {}
    min_rows, INT8_LAUNCH["pack_min_rows"] = INT8_LAUNCH["pack_min_rows"], 0  # this shape's few rows packed too
    try:
        for name, (kc, vc, scales, kw) in forms.items():
            table = tables64 if name in tma_forms else tables
            with compile_check.record_launches(aligned=True) as seen:
                paged_decode_attention(q, kc, vc, table, lens, D**-0.5, splits=1, **scales, **kw)
            (launch,) = seen
            c = launch["constexprs"]
            if c.get("WIDEN_F16") and kc.dtype == torch.int8:
                c["I8_ASM"] = True  # the GPU's form (byte permutes are inline PTX: the CPU launch turns them off)
            c["PDL"], launch["options"]["launch_pdl"] = True, True  # as the H200 launches it
            out[name] = launch
    finally:
        INT8_LAUNCH["pack_min_rows"] = min_rows
    return out


def _loop(sass: str) -> list[str]:
    """The longest backward branch's body: the tile loop."""
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2).strip()))
    at = {a: i for i, (a, _) in enumerate(ins)}
    best: list[str] = []
    for i, (a, text) in enumerate(ins):
        m = re.search(r"BRA .*?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < a and int(m.group(1), 16) in at:
            body = [t for _, t in ins[at[int(m.group(1), 16)] : i + 1]]
            best = body if len(body) > len(best) else best
    return best


def compile_forms(launches: dict) -> dict:
    """In this process, without the interpreter: each launch compiled for sm_90 and its loop counted."""
    import triton

    from kernellab.kernels.compile_check import compile_launch

    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    rows = {}
    for name, launch in launches.items():
        kernel = compile_launch(launch)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kernel.asm["cubin"])
            f.flush()
            sass = subprocess.run([tools / "cuobjdump", "-sass", f.name], capture_output=True, text=True).stdout
            res = subprocess.run([tools / "cuobjdump", "-res-usage", f.name], capture_output=True, text=True).stdout
        loop = _loop(sass)
        block_n = launch["constexprs"].get("BLOCK_N") or launch["constexprs"]["block_size"]  # descriptor: a block
        heads = launch["constexprs"].get("HEADS", 1)  # KV heads a program walks together (the packed form)
        ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for t in loop)
        regs = re.search(r"REG:(\d+)", res)
        rows[name] = {
            "registers": int(regs.group(1)) if regs else None,
            "shared_bytes": kernel.metadata.shared,
            "block_n": block_n,
            "loop_instructions": len(loop),
            "heads": heads,
            "per_token": round(len(loop) / block_n / heads, 2),
            "top_opcodes": dict(ops.most_common(10)),
            "memory_and_sync": {
                k: n
                for k, n in sorted(ops.items())
                if k.startswith(("BAR", "STS", "LDS", "LDG", "DEPBAR", "SYNCS", "ARRIVES", "WARPSYNC"))
            },
            "constexprs": launch["constexprs"],
        }
        print(f"{name:24s} {rows[name]['registers']} regs, {kernel.metadata.shared} B shared, loop {len(loop)} / "
              f"{block_n} tokens x {heads} heads = {rows[name]['per_token']:.1f} a token and head",
              flush=True)  # fmt: skip
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="write the JSON artifact here")
    ap.add_argument("--compile", help=argparse.SUPPRESS)  # the child: a JSON file of launches
    args = ap.parse_args()
    if args.compile:
        print(json.dumps(compile_forms(json.loads(Path(args.compile).read_text()))))
        return 0
    launches = record()
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(launches, f, default=str)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, __file__, "--compile", f.name], env=env, capture_output=True, text=True)
    os.unlink(f.name)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    lines = proc.stdout.strip().splitlines()
    print("\n".join(lines[:-1]))
    rows = json.loads(lines[-1])
    if args.out:
        from kernellab.results import provenance, write

        write(
            Path(args.out),
            {
                "schema": "kernellab.bench.sass_loop/v1",
                "provenance": provenance("cpu"),
                "what": "paged decode attention tile loop, sm_90 SASS (compiled and disassembled on the CPU)",
                "shape": SHAPE,
                "forms": rows,
            },
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
