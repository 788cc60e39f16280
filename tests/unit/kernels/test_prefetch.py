"""The L2 prefetch (``kernels/prefetch.py``): a cache hint, so off the GPU it must change nothing and refuse bad
ranges; on the H200 it must compile to the bulk prefetch instruction (checked here with Triton's own compiler for
sm_90; its effect on the GPU is the gate's ablation, its chain order ``tests/gpu/test_kernels_gpu.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from kernellab.kernels import prefetch
from kernellab.runtime import ops


def test_off_the_gpu_it_changes_nothing(gen):
    w = torch.randn(64, 32, generator=gen).to(torch.bfloat16)
    x = torch.randn(8, generator=gen)
    before = (w.clone(), x.clone())
    assert prefetch.l2_prefetch(w, x) is None
    assert ops.l2_prefetch(w, x) is None
    assert torch.equal(w, before[0]) and torch.equal(x, before[1])
    assert prefetch.l2_prefetch() is None


def test_bad_ranges_get_a_clear_error(gen):
    w = torch.randn(64, 32, generator=gen)
    with pytest.raises(ValueError, match="at most 4"):
        prefetch.l2_prefetch(w, w, w, w, w)
    with pytest.raises(ValueError, match="contiguous"):
        prefetch.l2_prefetch(w.t())
    with pytest.raises(ValueError, match="16-byte"):
        prefetch.l2_prefetch(torch.zeros(3, dtype=torch.bfloat16))  # 6 bytes


CHILD = """
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernellab.kernels import prefetch as p
fn = p._l2_prefetch_kernel
names = fn.arg_names
sig = {n: "*u8" if n.startswith("p") else "i32" for n in names[:8]} | dict.fromkeys(names[8:], "constexpr")
found = {}
for lines in (False, True):
    chunk, block = (p.LINE_BYTES, 8 * p.LANES) if lines else (p.CHUNK_BYTES, p.LANES)
    for count in (1, 4):
        for pdl in (False, True):
            values = {"COUNT": count, "CHUNK": chunk, "BLOCK": block, "LINES": lines, "PDL": pdl}
            src = ASTSource(fn, sig, {(names.index(k),): v for k, v in values.items()})
            k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1, "launch_pdl": pdl})
            ptx = k.asm["ptx"]
            found[f"{'lines' if lines else 'bulk'}-{count}-{pdl}"] = [
                ptx.count("cp.async.bulk.prefetch.L2.global"), ptx.count("prefetch.global.L2 "),
                ptx.count("griddepcontrol"), len(k.asm["cubin"]) > 0]
print(json.dumps(found))
"""


def test_it_compiles_to_the_prefetch_instructions_for_hopper():
    """Without the interpreter (a child process), Triton lowers the kernel for sm_90 through ptxas: one bulk
    prefetch per tensor range in the loop (one element a lane), or eight line prefetches (eight lines a lane);
    the two PDL instructions only when launched with PDL."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    expected = {}
    for count in (1, 4):
        for pdl in (False, True):
            expected[f"bulk-{count}-{pdl}"] = [count, 0, 2 * pdl, True]
            expected[f"lines-{count}-{pdl}"] = [0, 8 * count, 2 * pdl, True]
    assert found == expected
