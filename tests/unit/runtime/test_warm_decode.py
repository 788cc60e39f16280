"""The startup warm-up of the eager decode attention (``runtime/attention.warm_decode_launches``): every launch a
step that mixes decode rows with prompts can make is one the warm-up made, so no kernel compiles on a serving
step for it. Triton's interpreter records each launch's specialization (``compile_check.record_launches``: the
argument types and the constants Triton compiles in); on the GPU these are what a compile is keyed on, with the
integers' divisibility, which the tables' fixed width keeps the same."""

from __future__ import annotations

import os
import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not os.environ.get("TRITON_INTERPRET"), reason="runs the kernels under the interpreter")

HQ, HK, D, BS, WIDTH, ROWS = 4, 2, 32, 16, 16, 12


def _key(launch: dict) -> str:
    import json

    return json.dumps([launch["kernel"], launch["signature"], launch["constexprs"], launch["options"]], sort_keys=True)


@pytest.mark.parametrize("kv_dtype", ["model", "int8"])
def test_the_warm_up_makes_every_launch_a_mixed_step_can(kv_dtype):
    from kernellab.kernels.compile_check import record_launches
    from kernellab.kernels.testing import patch_interpreter
    from kernellab.runtime import ops as reference
    from kernellab.runtime.attention import LayerKV, warm_decode_launches
    from kernellab.runtime.dispatch import build_ops

    patch_interpreter()
    ops = build_ops("experimental", torch.device("cpu"), status={"paged_decode_attention": {"status": "accepted"}})
    assert "paged_decode_attention" in ops.enabled
    gen = torch.Generator().manual_seed(0)
    blocks = 64
    k = torch.randn(blocks, BS, HK, D, generator=gen)
    v = torch.randn(blocks, BS, HK, D, generator=gen)
    if kv_dtype == "int8":
        (k, ks), (v, vs) = reference.quantize_kv(k, torch.int8), reference.quantize_kv(v, torch.int8)
        kv = LayerKV(k, v, ks, vs)
    else:
        kv = LayerKV(k, v)
    with record_launches() as warm:
        assert warm_decode_launches(ops, kv, WIDTH, ROWS, HQ, D**-0.5, torch.float32) == ROWS
    warmed = {_key(x) for x in warm}
    rng = random.Random(1)
    seen = set()
    for rows in [*range(1, ROWS + 1), *(rng.randint(1, ROWS) for _ in range(3))]:
        lens = [rng.randint(1, 40) for _ in range(rows)]  # the launch depends on the width, not the lengths
        tables = torch.full((rows, WIDTH), -1, dtype=torch.int32)
        for r, n in enumerate(lens):
            tables[r, : -(-n // BS)] = torch.randperm(blocks, generator=gen)[: -(-n // BS)].to(torch.int32)
        q = torch.randn(rows + 7, HQ, D, generator=gen)  # the step's rows: decode first, then prompt tokens
        with record_launches() as step:
            ops.paged_decode_attention(
                q[:rows], kv.k, kv.v, tables, torch.tensor(lens, dtype=torch.int32), D**-0.5,
                k_scales=kv.k_scales, v_scales=kv.v_scales,
            )  # fmt: skip
        seen |= {_key(x) for x in step}
    assert seen <= warmed, sorted(seen - warmed)[:2]
    assert len(warmed) > 1  # several splits: the row count does change the launch
