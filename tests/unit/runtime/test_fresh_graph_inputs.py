"""The inputs a CUDA graph of several fresh prompts is captured and replayed with (``runtime/graphs.py``): padded
to its (tokens, prompts) bucket, with zero-length prompts and rows that belong to none, they give the eager step's
logits. Run here eagerly on the CPU through the same metadata and fill functions (the capture itself needs a GPU;
the H200 gate compares graph and eager)."""

from __future__ import annotations

import itertools

import torch

from kernellab.runtime import attention
from kernellab.runtime import ops as reference
from kernellab.runtime.engine import LLMEngine
from kernellab.runtime.graphs import fill_fresh_inputs, fresh_metadata
from kernellab.runtime.request.sampling import SamplingParams


def _varlen_like_flash(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    """FlashAttention's varlen contract on the CPU: bounds from the device offsets, ``max_q``/``max_k`` only upper
    bounds, rows outside every sequence left unwritten (NaN here, so any that leaked would show)."""
    out = torch.full_like(q, float("nan"))
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    for (qs, qe), (ks, ke) in zip(itertools.pairwise(bounds_q), itertools.pairwise(bounds_k), strict=True):
        assert qe - qs <= max_q and ke - ks <= max_k
        if qe > qs:
            out[qs:qe] = reference.causal_attention(q[qs:qe], k[ks:ke], v[ks:ke], scale, q.shape[1] // k.shape[1])
    return out


def test_padded_fresh_prompts_give_the_eager_logits(tiny_checkpoints, monkeypatch):
    eng = LLMEngine(
        model=str(tiny_checkpoints["qwen3"]),
        device="cpu",
        dtype="float32",
        num_kv_blocks=64,
        max_model_len=256,
        max_num_batched_tokens=64,
    )
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    lengths = (20, 33, 9, 40)  # the last is cut by the step budget: a chunk that starts its prompt, not sampled
    for i, n in enumerate(lengths):
        eng.add_request(f"p{i}", torch.randint(0, 500, (n,), generator=gen).tolist(), params)
    out = eng.scheduler.schedule()
    runner, model, kv = eng.runner, eng.runner.model, eng.runner.kv_caches
    assert all(s.num_computed_tokens == 0 and n > 1 for s, n in out.scheduled) and len(out.scheduled) == 4
    plan = runner.plan(out)
    assert len(plan.sampling) == 3 and plan.rows.shape[1] == 64  # 20 + 33 + 9 + the first 2 of 40

    ids, meta, _, _ = runner.prepare(out)
    eager = model.compute_logits(model(ids, meta, kv)[meta.logits_indices])

    # The graph's attention is FlashAttention's varlen call (a GPU's); here its contract, on the CPU.
    monkeypatch.setattr(attention, "flash_for", lambda q: _varlen_like_flash)
    t, s = 96, 8  # a bucket wider than the step's rows and prompts
    inputs = torch.full((4, t), 7, dtype=torch.int64)
    fresh = torch.full((2 * s + 1,), 5, dtype=torch.int64)
    fill_fresh_inputs(inputs.numpy(), fresh.numpy(), plan.rows, plan.cu, plan.logits_rows, t, s)
    n = plan.rows.shape[1]
    assert inputs[2, n:].eq(-1).all() and inputs[0, n:].eq(0).all() and inputs[1, n:].eq(0).all()
    assert fresh[: s + 1].tolist() == [0, 20, 53, 62, 64, 64, 64, 64, 64]
    assert fresh[s + 1 :].tolist() == [19, 52, 61, 0, 0, 0, 0, 0]
    cu, rows = fresh[: s + 1].to(torch.int32), fresh[s + 1 :].clone()
    graph_meta = fresh_metadata(inputs, cu, rows, t, s)
    padded = model.compute_logits(model(inputs[0, :t], graph_meta, kv)[graph_meta.logits_indices])
    torch.testing.assert_close(padded[: len(plan.sampling)], eager, atol=1e-5, rtol=1e-5)
    assert padded[len(plan.sampling) :].isfinite().all()  # padding logits rows read row 0, a real one


def test_argmax_agreement_reports_how_close_the_swapped_tokens_were():
    from kernellab.bench.steps import argmax_agreement

    eager = torch.tensor([[5.00, 4.98, 1.0], [3.0, 1.0, 0.0]])
    ours = eager.clone()
    ours[0, 0] -= 0.015  # row 0: the top two, 0.02 apart, swap when each moves by 0.015
    ours[0, 1] += 0.015
    diff, same, gaps = argmax_agreement(ours, eager)
    assert abs(diff - 0.015) < 1e-6 and same == 1 and gaps == [0.02]
    assert gaps[0] <= 2 * diff  # a swap needs the two tokens within twice the largest move
    assert argmax_agreement(eager, eager) == (0.0, 2, [])
