"""The inputs a chunk-after-context CUDA graph is captured and replayed with (``runtime/graphs.py``): padded to
its (chunk, context) bucket, they give the same logits as the eager step. Run here eagerly on the CPU through
the same metadata and fill functions (the capture itself needs a GPU; the H200 gate compares graph and eager)."""

from __future__ import annotations

import torch

from kernellab.runtime.engine import LLMEngine
from kernellab.runtime.graphs import chunk_metadata, fill_chunk_inputs
from kernellab.runtime.model_runner import _slots
from kernellab.runtime.request.sampling import SamplingParams


def test_padded_chunk_inputs_give_the_eager_logits(tiny_checkpoints):
    eng = LLMEngine(
        model=str(tiny_checkpoints["qwen3"]), device="cpu", dtype="float32", num_kv_blocks=64, max_model_len=256
    )
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, 500, (48,), generator=gen).tolist()  # three full blocks of 16
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    eng.add_request("warm", [*prefix, 7, 8, 9], params)
    while eng.has_unfinished_requests():
        eng.step()
    eng.add_request("chat", prefix + torch.randint(0, 500, (21,), generator=gen).tolist(), params)
    out = eng.scheduler.schedule()
    (seq, n), runner = out.scheduled[0], eng.runner
    start = seq.num_computed_tokens
    assert start == len(prefix) and n == 21  # the prefix came from the cache: a chunk after a context

    model, kv = runner.model, runner.kv_caches
    ids, meta, _, _ = runner.prepare(out)
    eager = model.compute_logits(model(ids, meta, kv)[meta.logits_indices])

    b, c = 32, 128  # a bucket wider than the chunk and its context
    inputs = torch.zeros((4, b), dtype=torch.int64)
    ctx = torch.full((c + 4,), 99, dtype=torch.int64)
    ctx_cu = torch.zeros(4, dtype=torch.int32)
    table, bs = seq.block_table, runner.block_size
    fill_chunk_inputs(
        inputs.numpy(), ctx.numpy(), seq.token_ids[start : start + n], start, _slots(table, 0, start + n, bs), b, c
    )
    assert inputs[2, n:].eq(-1).all() and inputs[1, n:].eq(0).all() and ctx[start + n : c].eq(0).all()
    ctx_cu.copy_(ctx[c : c + 4])
    assert ctx_cu.tolist() == [0, n, 0, start + n]
    graph_meta = chunk_metadata(inputs, ctx, ctx_cu, b, c)
    padded = model.compute_logits(model(inputs[0, :b], graph_meta, kv)[graph_meta.logits_indices])
    torch.testing.assert_close(padded, eager, atol=1e-5, rtol=1e-5)
    eng.abort("chat")


def test_a_chunks_kv_slots_are_its_positions_through_the_block_table():
    from kernellab.runtime.request.block_manager import slot_of

    table, bs = [9, 3, 40, 7, 12, 5, 30, 2], 16
    for start, n in [(0, 128), (0, 64), (5, 70), (16, 100), (33, 64), (0, 20), (7, 3)]:
        want = [slot_of(table, p, bs) for p in range(start, start + n)]
        assert _slots(table, start, n, bs).tolist() == want, (start, n)


def test_a_lone_prompt_through_the_prefill_graphs_inputs_gives_the_plain_steps_tokens(tiny_checkpoints):
    """A fresh prompt's step through the prefill graph's path (``GraphRunner.prefill``: its bucket's own contiguous
    (4, bucket) input block, one host → device copy, padding rows with slot -1), here as an eager replay on the
    CPU: the same greedy tokens as the plain engine, for prompts that pad their bucket and one that fills it."""
    kw = dict(model=str(tiny_checkpoints["qwen3"]), device="cpu", dtype="float32", num_kv_blocks=256)
    plain, graphed = LLMEngine(**kw), LLMEngine(**kw)
    graphed.runner.eager_windows(8, prefill=True)
    graphs = graphed.runner.graphs
    assert graphs.prefill_buckets == (128, 256)  # below the tiny checkpoint's 512-token context
    replays = []
    prefill = graphs.prefill
    graphs.prefill = lambda ids, slots: replays.append(len(ids)) or prefill(ids, slots)
    gen = torch.Generator().manual_seed(3)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for i, n in enumerate((100, 200, 128, 37)):
        prompt = torch.randint(0, 500, (n,), generator=gen).tolist()
        got = {}
        for name, eng in (("plain", plain), ("graphed", graphed)):
            eng.add_request(f"p{i}", prompt, params)
            out = []
            while eng.has_unfinished_requests():
                out += [t for o in eng.step() for t in o.new_token_ids]
            got[name] = out
        assert got["plain"] == got["graphed"] and len(got["plain"]) == 6, n
    assert replays == [100, 200, 128, 37]
    rows = graphs._prefill_rows(128)
    assert rows.is_contiguous() and rows[2, 37:].eq(-1).all() and rows[3, 0] == 36  # the last prompt's block
    # each bucket's block is its own: a graph replayed on its last inputs reads token ids there, never another
    # bucket's slots (-1)
    assert graphs._prefill_rows(256)[0].min() >= 0 and graphs._prefill_rows(256)[3, 0] == 199
