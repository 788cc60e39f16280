"""Piecewise CUDA graphs (``runtime/graphs.py`` ``PiecewiseGraphs``): a step that prefills runs its row-wise
pieces over static buffers padded to a token bucket, with attention eager in between. Here the pieces run eagerly
on the CPU through the same buffers, padding and metadata as the captured replay; the capture itself needs a GPU,
where the gate compares replayed and eager steps."""

from __future__ import annotations

import pytest
import torch

from kernellab.runtime.engine import LLMEngine
from kernellab.runtime.graphs import PiecewiseGraphs, weak_view
from kernellab.runtime.request.sampling import SamplingParams


def tiny_engine(checkpoint, **kw) -> LLMEngine:
    return LLMEngine(model=str(checkpoint), device="cpu", dtype="float32", num_kv_blocks=128, max_model_len=256, **kw)


def mixed_step(eng: LLMEngine, gen: torch.Generator):
    """A scheduled step holding decode rows, a fresh prompt and a chunk after a cached prefix."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prefix = torch.randint(0, 500, (32,), generator=gen).tolist()  # two full blocks of 16
    eng.add_request("warm", [*prefix, 1, 2, 3], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    for i in range(3):
        eng.add_request(f"dec{i}", torch.randint(0, 500, (5 + 7 * i,), generator=gen).tolist(), params)
    eng.step()  # their prompts: from now on they decode
    eng.add_request("fresh", torch.randint(0, 500, (19,), generator=gen).tolist(), params)
    eng.add_request("chat", prefix + torch.randint(0, 500, (11,), generator=gen).tolist(), params)
    out = eng.scheduler.schedule()
    sizes = sorted(n for _, n in out.scheduled)
    assert sizes == [1, 1, 1, 11, 19], sizes  # the chat turn's prefix came from the cache
    return out


@pytest.mark.parametrize(("family", "backend"), [("qwen3", "auto"), ("llama", "auto"), ("qwen3", "triton")])
def test_padded_pieces_give_the_eager_logits(tiny_checkpoints, family, backend):
    """The torch references, and the Triton kernels under the interpreter (the GPU's ops: their KV write must skip
    the padding rows' slot -1)."""
    if backend == "triton":
        from kernellab.kernels.testing import patch_interpreter

        patch_interpreter()
    eng = LLMEngine(
        model=str(tiny_checkpoints[family]),
        device="cpu",
        dtype="float32",
        num_kv_blocks=64,
        max_model_len=256,
        backend=backend,
        kernels="experimental",
    )
    out = mixed_step(eng, torch.Generator().manual_seed(0))
    runner, model = eng.runner, eng.runner.model
    ids, meta, _, sampling = runner.prepare(out)
    eager = model.compute_logits(model(ids, meta, runner.kv_caches)[meta.logits_indices])

    pw = PiecewiseGraphs(model, runner.kv_caches, "cpu", max_tokens=64, buckets=(16, 48))
    assert pw.buckets == (16, 48, 64)
    pw.attn_out.fill_(float("nan"))  # padding rows carry whatever: nothing may read them into a real row
    plan = runner.plan(out)
    t = plan.rows.shape[1]
    assert pw.load(plan.rows) == 48 and t == 33
    rows = pw.rows(48)  # the bucket's contiguous (4, 48) block
    assert rows.is_contiguous() and rows.data_ptr() != pw.rows(16).data_ptr()
    assert rows[2, t:].eq(-1).all() and rows[1, t:].eq(0).all()  # padding writes no KV
    assert torch.equal(rows[:3, :t], torch.from_numpy(plan.rows))
    piece_meta = runner.metadata(plan, rows)
    hidden = pw.run(t, piece_meta)
    assert hidden.shape[0] == 48
    padded = model.compute_logits(hidden[piece_meta.logits_indices])
    assert [s.request_id for s in plan.sampling] == [s.request_id for s in sampling]
    torch.testing.assert_close(padded, eager, atol=1e-5, rtol=1e-5)
    for rid in ["dec0", "dec1", "dec2", "fresh", "chat"]:
        eng.abort(rid)


def test_a_step_past_the_largest_bucket_has_none(tiny_checkpoints):
    eng = LLMEngine(model=str(tiny_checkpoints["qwen3"]), device="cpu", dtype="float32", num_kv_blocks=16)
    pw = PiecewiseGraphs(eng.runner.model, eng.runner.kv_caches, "cpu", max_tokens=100, buckets=(16, 64, 128))
    assert pw.buckets == (16, 64, 100)
    assert [pw.bucket(n) for n in (1, 16, 17, 100, 101)] == [16, 16, 64, 100, None]


def test_weak_view_aliases_without_owning():
    with torch.inference_mode():
        base = torch.arange(24.0).view(4, 6)
        view = base[1:, 2:5]
        weak = weak_view(view)
        assert weak.shape == view.shape and weak.stride() == view.stride()
        assert weak.storage_offset() == view.storage_offset()
        assert weak.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
        base.mul_(2)
        assert torch.equal(weak, view)


def attach_pieces(eng: LLMEngine, buckets=(16, 32, 64)) -> PiecewiseGraphs:
    """The runner's piecewise path with uncaptured pieces (a CPU has no graphs): every step that prefills and fits
    a bucket goes through the static buffers, padding and eager attention in between."""
    runner = eng.runner
    runner.piecewise = PiecewiseGraphs(runner.model, runner.kv_caches, "cpu", max_tokens=96, buckets=buckets)
    runner.use_piecewise = True
    return runner.piecewise


def test_a_staggered_workload_decodes_the_same_through_the_pieces(tiny_checkpoints):
    """Greedy tokens of requests arriving while others decode (steps mixing decode rows, fresh prompts and chunks
    of a prompt longer than the step budget) are those of the eager runner."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 500, (n,), generator=gen).tolist() for n in (7, 40, 130, 18, 64, 3)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = {}
    for mode in ("eager", "pieces"):
        eng = tiny_engine(tiny_checkpoints["qwen3"], max_num_batched_tokens=96)
        pw = attach_pieces(eng) if mode == "pieces" else None
        tokens: dict[str, list[int]] = {}
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, params)
            for o in eng.step() + eng.step():  # two steps between arrivals
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        while eng.has_unfinished_requests():
            for o in eng.step():
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        outputs[mode] = tokens
        if pw is not None:
            assert pw.graphs == {}  # nothing captured here: the pieces ran eagerly
    assert outputs["pieces"] == outputs["eager"]
    assert all(len(t) == 12 for t in outputs["eager"].values()) and len(outputs["eager"]) == len(prompts)


def test_step_bench_and_numerics_check_run_on_the_cpu(tiny_checkpoints):
    """kernellab.bench.steps, as the GPU gate runs it, on small mixes: without pieces only the eager side is
    timed; with (uncaptured) pieces both sides, and the two forwards' logits agree."""
    from kernellab.bench.steps import piecewise_matches_eager, step_times

    eng = tiny_engine(tiny_checkpoints["qwen3"], max_num_seqs=16, max_num_batched_tokens=96)
    mixes = (("burst-2x20", 0, (20, 20)), ("decode4+1x30", 4, (30,)))
    plain = step_times(eng, mixes, reps=1)
    assert [r["mix"] for r in plain] == ["burst-2x20", "decode4+1x30"] and "piecewise_ms" not in plain[0]
    assert plain[0]["step_tokens"] == 40 and plain[1]["step_rows"] == 5 and plain[1]["step_tokens"] == 34
    assert piecewise_matches_eager(eng, mixes)["pass"] is None
    attach_pieces(eng)
    timed = step_times(eng, mixes, reps=2)
    assert all(r["piecewise_ms"] > 0 and r["eager_ms"] > 0 for r in timed)
    assert [r["bucket"] for r in timed] == [64, 64]
    check = piecewise_matches_eager(eng, mixes)
    assert check["pass"] and check["max_abs_diff"] < 1e-4 and check["argmax_agree_pct"] == 100.0
    assert not eng.has_unfinished_requests() and eng.runner.use_piecewise
