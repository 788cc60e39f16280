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
for count in (1, 4):
    for pdl in (False, True):
        values = {"COUNT": count, "CHUNK": p.CHUNK_BYTES, "LANES": p.LANES, "PDL": pdl}
        src = ASTSource(fn, sig, {(names.index(k),): v for k, v in values.items()})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1, "launch_pdl": pdl})
        ptx = k.asm["ptx"]
        found[f"{count}-{pdl}"] = [ptx.count("cp.async.bulk.prefetch.L2.global"), ptx.count("griddepcontrol"),
                                   len(k.asm["cubin"]) > 0]
print(json.dumps(found))
"""


def test_it_compiles_to_the_bulk_prefetch_for_hopper():
    """Without the interpreter (a child process), Triton lowers the kernel for sm_90 through ptxas: one bulk
    prefetch per tensor range in the loop, the two PDL instructions only when launched with PDL."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found == {"1-False": [1, 0, True], "1-True": [1, 2, True], "4-False": [4, 0, True], "4-True": [4, 2, True]}
