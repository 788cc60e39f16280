"""The startup warm-up of the Triton prefill attention (``runtime/attention.warm_prefill_launches``): every launch a
step's fresh prompts can make outside a graph, one prompt or several, is one the warm-up made, so no kernel
compiles on a serving step for it. Launches are compared by what the GPU compiles them for (the interpreter's
record of argument types, constants and the integers' divisibility by 16: ``compile_check.describe``)."""

from __future__ import annotations

import itertools
import json
import os
import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not os.environ.get("TRITON_INTERPRET"), reason="runs the kernels under the interpreter")

HQ, HK, D, MAX_PROMPTS = 4, 2, 32, 40


def _key(launch: dict) -> str:
    return json.dumps([launch["kernel"], launch["signature"], launch["constexprs"], launch["options"],
                       sorted(launch["aligned"])], sort_keys=True, default=str)  # fmt: skip


def test_fresh_prompt_counts_cover_each_bound_and_divisibility():
    from kernellab.runtime.attention import fresh_prompt_counts

    assert fresh_prompt_counts(1) == []
    assert fresh_prompt_counts(8) == [2]
    assert fresh_prompt_counts(40) == [2, 16, 17, 32, 33]
    assert fresh_prompt_counts(256) == [2, 16, 17, 32, 33, 64, 65, 128, 129, 256]


def test_the_warm_up_makes_every_launch_a_step_of_fresh_prompts_can(monkeypatch):
    from kernellab.kernels.compile_check import record_launches
    from kernellab.kernels.testing import patch_interpreter
    from kernellab.runtime import attention
    from kernellab.runtime.attention import fresh_prompt_counts, warm_prefill_launches
    from kernellab.runtime.dispatch import build_ops

    monkeypatch.setattr(attention, "PREFILL_TRITON_EAGER", True)  # the op outside graphs too
    patch_interpreter()
    ops = build_ops("experimental", torch.device("cpu"), status={"varlen_causal_attention": {"status": "accepted"}})
    assert "varlen_causal_attention" in ops.enabled
    with record_launches(aligned=True) as warm:
        calls = warm_prefill_launches(ops, HQ, HK, D, MAX_PROMPTS, D**-0.5, torch.float32, torch.device("cpu"))
    assert calls == 2 + len(fresh_prompt_counts(MAX_PROMPTS))
    warmed = {_key(x) for x in warm}
    rng = random.Random(0)
    width = (HQ + 2 * HK) * D
    seen = set()
    for prompts in [1, 1, 2, 16, 17, 31, 32, 33, 40, *(rng.randint(1, MAX_PROMPTS) for _ in range(4))]:
        lens = [rng.randint(2, 40) for _ in range(prompts)]
        t = sum(lens)
        qkv = torch.randn(t, width)
        q = torch.randn(t, HQ, D)  # the QK-norm + RoPE kernel's dense outputs; v stays a view of the QKV row
        k = torch.randn(t, HK, D)
        v = qkv[:, (HQ + HK) * D :].view(t, HK, D)
        cu = [0, *itertools.accumulate(lens)]
        cu_device = torch.tensor(cu, dtype=torch.int32) if prompts > 1 else None
        with record_launches(aligned=True) as step:
            ops.varlen_causal_attention(q, k, v, cu, D**-0.5, cu_device=cu_device)
        assert step, "the op launched no kernel"
        for launch in step:
            assert _key(launch) in warmed, (prompts, lens, launch)
            seen.add(_key(launch))
    assert len(seen) >= 4  # single-prompt and packed forms, several bounds: the check was not vacuous


def test_nothing_is_warmed_where_the_op_is_off():
    from kernellab.runtime.attention import warm_prefill_launches
    from kernellab.runtime.dispatch import build_ops

    ops = build_ops("accepted", torch.device("cpu"), status={"varlen_causal_attention": {"status": "experimental"}})
    assert warm_prefill_launches(ops, HQ, HK, D, MAX_PROMPTS, D**-0.5, torch.float32, torch.device("cpu")) == 0


def test_nothing_is_warmed_where_the_op_runs_in_graphs_only():
    """By default (``PREFILL_TRITON_EAGER`` off) the op runs only inside whole-step graphs, whose warm-ups before
    each capture compile their own forms: a step between piecewise graphs never launches it."""
    from kernellab.runtime import attention
    from kernellab.runtime.dispatch import build_ops

    assert attention.PREFILL_TRITON_EAGER is False
    ops = build_ops("experimental", torch.device("cpu"), status={"varlen_causal_attention": {"status": "accepted"}})
    assert "varlen_causal_attention" in ops.enabled
    assert attention.triton_prefill(ops, graphed=True) and not attention.triton_prefill(ops, graphed=False)
    assert (
        attention.warm_prefill_launches(ops, HQ, HK, D, MAX_PROMPTS, D**-0.5, torch.float32, torch.device("cpu")) == 0
    )
