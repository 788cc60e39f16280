"""The last layer of a step of fresh prompts runs attention, output projection and MLP for the rows whose logits
are taken only (``model.PRUNE_LAST_LAYER``): the same logits as every row's forward, for one prompt and for several
in one step, on Qwen3 and Llama checkpoints (CPU, fp32)."""

from __future__ import annotations

import os

import pytest
import torch

from kernellab.runtime import model as model_mod
from kernellab.runtime.engine import LLMEngine
from kernellab.runtime.request.sampling import SamplingParams


def step_logits(eng: LLMEngine, prune: bool) -> torch.Tensor:
    out = eng.scheduler.schedule()
    runner = eng.runner
    ids, meta, _, _ = runner.prepare(out)
    saved = model_mod.PRUNE_LAST_LAYER
    model_mod.PRUNE_LAST_LAYER = prune
    try:
        return runner.model.logits(ids, meta, runner.kv_caches, meta.logits_indices)
    finally:
        model_mod.PRUNE_LAST_LAYER = saved
        for seq, _ in out.scheduled:  # back to waiting, blocks freed: the next call schedules the same step
            eng.scheduler._preempt(seq)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("lengths", [(37,), (5, 40, 17)])
def test_pruned_last_layer_gives_every_rows_logits(tiny_checkpoints, family, lengths):
    eng = LLMEngine(
        model=str(tiny_checkpoints[family]), device="cpu", dtype="float32", num_kv_blocks=64, max_model_len=256
    )
    eng.block_manager.enable_prefix_caching = False
    gen = torch.Generator().manual_seed(len(lengths))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i, n in enumerate(lengths):
        eng.add_request(f"r{i}", torch.randint(0, 500, (n,), generator=gen).tolist(), params)
    calls = []
    attend_rows = eng.runner.model._attend_rows
    eng.runner.model._attend_rows = lambda *a: calls.append(a[3].tolist()) or attend_rows(*a)
    full = step_logits(eng, prune=False)
    assert not calls
    pruned = step_logits(eng, prune=True)
    ends = torch.tensor(lengths).cumsum(0) - 1
    assert sorted(calls) == [sorted(ends.tolist())]  # the last layer attended the prompts' last rows only
    assert full.shape == pruned.shape == (len(lengths), eng.model_config.vocab_size)
    torch.testing.assert_close(pruned, full, rtol=1e-4, atol=1e-4)
    assert torch.equal(pruned.argmax(-1), full.argmax(-1))


@pytest.mark.skipif(not os.environ.get("TRITON_INTERPRET"), reason="runs the Triton kernels under the interpreter")
def test_pruned_last_layer_through_the_triton_kernels_keeps_the_tokens(tiny_checkpoints, monkeypatch):
    """The engine's Triton ops (interpreter, bf16): a lone prompt's last row attends as a decode row over the
    cache its last layer just wrote (``paged_decode_attention``), then the one-row GEMVs; the greedy tokens equal
    the unpruned engine's, and the logits agree within bf16 rounding."""
    from kernellab.kernels.testing import patch_interpreter

    patch_interpreter()
    tokens, logits = {}, {}
    for prune in (False, True):
        monkeypatch.setattr(model_mod, "PRUNE_LAST_LAYER", prune)
        eng = LLMEngine(
            model=str(tiny_checkpoints["qwen3"]), device="cpu", dtype="bfloat16", backend="triton",
            kernels="experimental", num_kv_blocks=32, max_model_len=128,
        )  # fmt: skip
        model, seen = eng.runner.model, []
        inner = model.logits
        model.logits = lambda *a, inner=inner, seen=seen: seen.append(inner(*a)) or seen[-1]
        eng.add_request("r", list(range(5, 75)), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        out = []
        while eng.has_unfinished_requests():
            out += [t for o in eng.step() for t in o.new_token_ids]
        tokens[prune], logits[prune] = out, seen[0]
    assert tokens[True] == tokens[False] and len(tokens[True]) == 4
    torch.testing.assert_close(logits[True], logits[False], rtol=0.05, atol=0.05)


@pytest.mark.skipif(not os.environ.get("TRITON_INTERPRET"), reason="runs the Triton kernels under the interpreter")
def test_pruned_last_layer_in_the_prefill_graphs_path_keeps_the_tokens(tiny_checkpoints, monkeypatch):
    """The pruned last layer inside the prefill graph's path (eager replays of the (4, bucket) input blocks on the
    CPU, Triton kernels under the interpreter): the first run, as a capture's warm-up, has every slot -1; then
    a prompt that pads its bucket gives the tokens of the plain engine without graphs or pruning."""
    from kernellab.kernels.testing import patch_interpreter

    patch_interpreter()
    kw = dict(
        model=str(tiny_checkpoints["qwen3"]), device="cpu", dtype="bfloat16", backend="triton",
        kernels="experimental", num_kv_blocks=64, max_model_len=256,
    )  # fmt: skip
    plain = LLMEngine(**kw)
    monkeypatch.setattr(model_mod, "PRUNE_LAST_LAYER", True)
    graphed = LLMEngine(**kw)
    graphed.runner.eager_windows(8, prefill=True)
    assert graphed.runner.graphs.prefill_buckets == (128,)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    for i, n in enumerate((70,)):
        prompt = list(range(5 + i, 5 + i + n))
        got = []
        for eng in (plain, graphed):
            monkeypatch.setattr(model_mod, "PRUNE_LAST_LAYER", eng is graphed)
            eng.add_request(f"p{i}", prompt, params)
            out = []
            while eng.has_unfinished_requests():
                out += [t for o in eng.step() for t in o.new_token_ids]
            got.append(out)
        assert got[0] == got[1] and len(got[0]) == 3, n


@pytest.mark.skipif(not os.environ.get("TRITON_INTERPRET"), reason="runs the Triton kernels under the interpreter")
def test_the_triton_prefill_attention_runs_in_the_prefill_graph_not_eagerly(tiny_checkpoints, monkeypatch):
    """With ``varlen_causal_attention`` enabled, a lone prompt's step attends through the Triton kernel where the
    step is a whole-step graph's (here the CPU's eager stand-in of the prefill graph), and through the torch path
    (SDPA) where it runs eagerly (``attention.PREFILL_TRITON_EAGER`` off): same greedy tokens either way."""
    from kernellab.kernels.compile_check import record_launches
    from kernellab.kernels.testing import patch_interpreter

    patch_interpreter()
    kw = dict(
        model=str(tiny_checkpoints["qwen3"]), device="cpu", dtype="bfloat16", backend="triton",
        kernels="experimental", num_kv_blocks=64, max_model_len=256,
    )  # fmt: skip
    eager, graphed = LLMEngine(**kw), LLMEngine(**kw)
    graphed.runner.eager_windows(8, prefill=True)
    assert "varlen_causal_attention" in graphed.runner.model.ops.enabled
    assert graphed.runner.graphs.prefill_buckets == (128,)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    prompt = list(range(9, 79))
    got, attention_kernels = [], []
    for eng, graphs_on in ((eager, True), (graphed, True), (graphed, False)):
        # graphs turned off on a runner that has them (the graph == eager checks): the step the prefill graph
        # would take runs eagerly with that graph's attention, the same forward
        eng.runner.graphs_on(graphs_on)
        assert eng.block_manager.reset_prefix_cache()  # the same prompt again: fresh, not a cached prefix
        eng.add_request(f"p{len(got)}", prompt, params)
        with record_launches() as first_step:
            out = [t for o in eng.step() for t in o.new_token_ids]
        while eng.has_unfinished_requests():
            out += [t for o in eng.step() for t in o.new_token_ids]
        got.append(out)
        attention_kernels.append(sum(1 for x in first_step if "causal_attention" in x["kernel"]))
    assert got[0] == got[1] == got[2] and len(got[0]) == 3
    assert attention_kernels == [0, 2, 2]  # the graph's prefill: one launch a layer of the 2-layer model


def test_logits_of_several_rows_stay_in_the_models_dtype(tiny_checkpoints, monkeypatch):
    """``compute_logits``: one row is the GEMV's fp32 store (free), several rows the LM head's output as computed
    (bf16 here), never a widening pass over them; the values are the LM head's either way."""
    from kernellab.runtime import model as model_module

    eng = LLMEngine(
        model=str(tiny_checkpoints["qwen3"]), device="cpu", dtype="bfloat16", num_kv_blocks=64, max_model_len=256
    )
    model = eng.runner.model
    weight = model.lm_head.weight
    hidden = torch.randn(5, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    many, one = model.compute_logits(hidden), model.compute_logits(hidden[:1])
    assert many.dtype == torch.bfloat16 and one.dtype == torch.float32
    assert torch.equal(many, torch.nn.functional.linear(hidden, weight))
    assert torch.equal(one, torch.nn.functional.linear(hidden[:1], weight).float())
    # the knob: True widens every row, an int the logits of up to that many rows
    for knob, rows_widened in ((True, (2, 4, 5)), (4, (2, 4)), (0, ())):
        monkeypatch.setattr(model_module, "WIDEN_LOGITS", knob)
        for n in (2, 4, 5):
            got = model.compute_logits(hidden[:n])
            assert got.dtype == (torch.float32 if n in rows_widened else torch.bfloat16), (knob, n)
            assert torch.equal(got, torch.nn.functional.linear(hidden[:n], weight).to(got.dtype))
