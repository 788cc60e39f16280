"""The fast-path report: what of CUDA graphs, decode windows and Triton ops a model runs on, and why any part
is off. It is how the Llama family's missing CUDA graphs showed: its KV write (``store_kv``) was judged on
Qwen3's path, where it never runs."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from kernellab.runtime.dispatch import build_ops, describe_fast_path, fast_path, ops_on_path
from kernellab.runtime.engine import LLMEngine

STATUS = {
    op: {"status": "accepted"}
    for op in (
        "add_rms_norm",
        "qk_norm_rope_store_kv",
        "silu_and_mul",
        "linear",
        "silu_and_mul_linear",
        "add_rms_norm_linear",
        "paged_decode_attention",
        "paged_decode_attention_qk_norm_rope",
        "decode_attention_o_proj",
        "argmax",
        "l2_prefetch",
    )
} | {"store_kv": {"status": "experimental", "reason": "not measured on this path"}}


def test_each_family_calls_its_own_rope_and_kv_write():
    assert "qk_norm_rope_store_kv" in ops_on_path(True) and "store_kv" not in ops_on_path(True)
    assert {"rotary_embedding", "store_kv"} <= set(ops_on_path(False))
    assert "qk_norm_rope_store_kv" not in ops_on_path(False)


def test_on_a_cpu_everything_is_off_for_one_reason(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the interpreter would run the kernels on a CPU
    fp = fast_path(build_ops("accepted", torch.device("cpu")), False, torch.device("cpu"), True, 8)
    assert fp["cuda_graphs"] is False and fp["cuda_graphs_off"] == "device cpu"
    assert fp["decode_window"] == 1 and fp["triton_ops"] == []
    assert set(fp["torch_ops"]) == set(ops_on_path(False))
    assert set(fp["torch_ops"].values()) == {"no Triton on cpu"}


@pytest.mark.skipif(
    not torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET"),
    reason="the kernels import only with a GPU or Triton's interpreter",
)
def test_a_kernel_off_the_graph_path_names_itself_as_the_reason():
    """The dispatcher's decision (from an explicit status table, device "cuda" without capturing anything):
    Qwen3 has its fused KV write and gets graphs; a Llama-family model whose ``store_kv`` is not accepted
    runs eagerly, one token per step, and the report says why."""
    cuda = torch.device("cuda")
    ops = build_ops("accepted", cuda, status=STATUS)
    qwen = fast_path(ops, True, cuda, True, 8)
    assert qwen["cuda_graphs"] and qwen["decode_window"] == 8
    assert qwen["torch_ops"] == dict.fromkeys(
        ("rms_norm", "varlen_causal_attention", "gate_up_swiglu", "qkv_proj_norm_rope_store_kv"),
        "no status at kernels='accepted'",
    )
    llama = fast_path(ops, False, cuda, True, 8)
    assert not llama["cuda_graphs"] and llama["decode_window"] == 1
    assert "store_kv" in llama["cuda_graphs_off"] and "not measured on this path" in llama["cuda_graphs_off"]
    assert llama["torch_ops"]["store_kv"] == "experimental at kernels='accepted' (not measured on this path)"
    assert "paged_decode_attention" in llama["triton_ops"]
    off = fast_path(
        build_ops("accepted", cuda, status=STATUS, disabled=("paged_decode_attention",)), True, cuda, True, 8
    )
    assert not off["cuda_graphs"] and off["torch_ops"]["paged_decode_attention"] == "disabled by configuration"
    assert fast_path(ops, True, cuda, False, 8)["cuda_graphs_off"] == "cuda_graphs=False"


def test_the_engine_logs_its_fast_path_at_startup(tiny_checkpoints, caplog):
    with caplog.at_level(logging.INFO, logger="kernellab.runtime.model_runner"):
        eng = LLMEngine(
            model=str(tiny_checkpoints["llama"]), device="cpu", dtype="float32", num_kv_blocks=32, max_model_len=128
        )
    assert eng.fast_path["cuda_graphs_off"] == "device cpu"
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("fast path:"))
    assert line == "fast path: " + describe_fast_path(eng.fast_path)
    assert "CUDA graphs off (device cpu)" in line and "store_kv" in line


def triton_qwen3(tiny_checkpoints, disabled: tuple[str, ...]) -> LLMEngine:
    """The tiny 2-layer Qwen3 on the CPU with every Triton kernel (interpreter) but ``disabled``."""
    return LLMEngine(
        model=str(tiny_checkpoints["qwen3"]),
        device="cpu",
        dtype="bfloat16",
        backend="triton",
        kernels="experimental",
        disabled_kernels=disabled,
        num_kv_blocks=32,
        max_model_len=128,
    )


# fused op → (the GEMV constexpr it sets, its launches per batch-1 decode step of the tiny 2-layer Qwen3): the
# SwiGLU in each layer's down projection; the (residual add and) norm in each layer's two projections after one
# (the first layer's input norm, with no residual to add, too); the attention's two-slice merge in each layer's
# output projection (a 70-token prompt: its decode contexts take two 64-token slices, which the attention leaves
# unmerged)
FUSED_GEMV = {
    "silu_and_mul_linear": ("GLU", 2),
    "add_rms_norm_linear": ("NORM", 4),
    "decode_attention_o_proj": ("MERGE", 2),
}


@pytest.mark.skipif(not os.environ.get("TRITON_INTERPRET"), reason="runs the Triton kernels under the interpreter")
@pytest.mark.parametrize("op", sorted(FUSED_GEMV))
def test_batch1_decode_takes_the_fused_gemv_and_keeps_its_tokens(op, tiny_checkpoints, monkeypatch):
    """One sequence decoding: with the op enabled, its SwiGLU, RMSNorm or attention merge runs inside the next GEMV;
    the greedy tokens equal those of the engine with the op off (two kernels)."""
    from kernellab.kernels.compile_check import record_launches
    from kernellab.kernels.testing import patch_interpreter
    from kernellab.runtime import dispatch
    from kernellab.runtime.request.sampling import SamplingParams

    patch_interpreter()
    table = dispatch.load_status()
    # a rejected op (decode_attention_o_proj) runs only when allowed, as benchmarks/gpu/knob_ab.py's "on" allows it
    monkeypatch.setattr(dispatch, "load_status", lambda: {**table, op: {"status": "accepted"}})
    flag, per_step = FUSED_GEMV[op]
    tokens, fused = {}, {}
    for disabled in ((), (op,)):
        eng = triton_qwen3(tiny_checkpoints, disabled)
        assert (op in eng.runner.model.ops.enabled) == (not disabled)
        eng.add_request("r", list(range(5, 75)), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        out = []
        with record_launches() as launches:
            while eng.has_unfinished_requests():
                out += [t for o in eng.step() for t in o.new_token_ids]
        tokens[disabled] = out
        fused[disabled] = sum(1 for x in launches if x["kernel"] == "_gemv_kernel" and x["constexprs"].get(flag))
        deferred = sum(1 for x in launches if x["kernel"] == "_paged_decode_kernel" and x["constexprs"].get("DEFER"))
        # the attention leaves its two slices to the projection wherever that op runs (2 layers × 5 decode steps)
        assert deferred == (10 if "decode_attention_o_proj" in eng.runner.model.ops.enabled else 0)
    # the five decode steps (the 70-row prefill takes the two kernels)
    assert fused == {(): per_step * 5, (op,): 0}
    assert tokens[()] == tokens[(op,)] and len(tokens[()]) == 6


@pytest.mark.skipif(not os.environ.get("TRITON_INTERPRET"), reason="runs the Triton kernels under the interpreter")
def test_decode_attention_takes_the_qk_norm_rope_and_keeps_its_tokens(tiny_checkpoints, monkeypatch):
    """Decode steps of the tiny 2-layer Qwen3 (batch 2): with the fused op, each layer's QK-norm, RoPE and KV write
    run inside the decode attention (no separate rope launch at decode); the greedy tokens equal those of the
    engine with the op off (the two kernels), which still prefill the prompts the same way."""
    from kernellab.kernels.compile_check import record_launches
    from kernellab.kernels.testing import patch_interpreter
    from kernellab.runtime.request.sampling import SamplingParams

    patch_interpreter()
    op = "paged_decode_attention_qk_norm_rope"
    tokens, launches_by, engines = {}, {}, {}
    for disabled in ((), (op,)):
        eng = triton_qwen3(tiny_checkpoints, disabled)
        assert (op in eng.runner.model.ops.enabled) == (not disabled)
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        eng.add_request("a", list(range(5, 25)), params)
        eng.add_request("b", list(range(40, 47)), params)
        out: dict[str, list[int]] = {}
        with record_launches() as launches:
            while eng.has_unfinished_requests():
                for o in eng.step():
                    out.setdefault(o.request_id, []).extend(o.new_token_ids)
        tokens[disabled], engines[disabled] = out, eng
        launches_by[disabled] = (
            sum(1 for x in launches if x["kernel"] == "_paged_decode_kernel" and x["constexprs"].get("ROPE")),
            sum(1 for x in launches if x["kernel"] == "_qk_rope_kernel"),
        )
    # 5 decode steps × 2 layers: fused attention launches; the rope kernel runs only for the prefill step
    assert launches_by[()] == (10, 2)
    assert launches_by[(op,)] == (0, 12)
    assert tokens[()] == tokens[(op,)] and all(len(t) == 6 for t in tokens[()].values())
    # decode batches above the fused form's row limit keep the two kernels
    from kernellab.runtime import model as model_mod

    monkeypatch.setattr(model_mod, "FUSED_DECODE_MAX_ROWS", 1)
    eng = engines[()]
    eng.add_request("c", list(range(5, 25)), params)
    eng.add_request("d", list(range(40, 47)), params)
    with record_launches() as launches:
        while eng.has_unfinished_requests():
            eng.step()
    decode = [x for x in launches if x["kernel"] == "_paged_decode_kernel"]
    assert decode and not any(x["constexprs"].get("ROPE") for x in decode)


@pytest.mark.skipif(not os.environ.get("TRITON_INTERPRET"), reason="runs the Triton kernels under the interpreter")
def test_batch1_decode_prefetches_the_layers_next_weights(tiny_checkpoints, monkeypatch):
    """One sequence decoding, the op allowed: after each layer's QKV projection the step asks L2 for the weights
    the layer reads next (output projection, gate/up, down) and the next layer's QKV; the prefill step (20 rows)
    and steps of two rows ask nothing. The hint changes no token."""
    import dataclasses

    from kernellab.kernels.testing import patch_interpreter
    from kernellab.runtime import dispatch
    from kernellab.runtime.request.sampling import SamplingParams

    patch_interpreter()
    # the H200 rejected the op (runtime/kernel_status.json); its wiring is tested with it allowed
    standing = dispatch.load_status()
    monkeypatch.setattr(dispatch, "load_status", lambda: {**standing, "l2_prefetch": {"status": "experimental"}})
    tokens = {}
    for disabled in ((), ("l2_prefetch",)):
        eng = triton_qwen3(tiny_checkpoints, disabled)
        model = eng.runner.model
        assert ("l2_prefetch" in model.ops.enabled) == (not disabled)
        calls: list[tuple[int, ...]] = []
        inner = model.ops.l2_prefetch
        model.ops = dataclasses.replace(
            model.ops,
            l2_prefetch=lambda *ts, inner=inner, calls=calls, **kw: (
                calls.append(tuple(t.data_ptr() for t in ts)),
                inner(*ts, **kw),
            ),
        )
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        eng.add_request("r", list(range(5, 25)), params)
        out = []
        while eng.has_unfinished_requests():
            out += [t for o in eng.step() for t in o.new_token_ids]
        tokens[disabled] = out
        if disabled:
            assert calls == []
            continue
        layers = model.decoder_layers
        expected = []
        for i, layer in enumerate(layers):
            ws = [layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
            ws += [layers[i + 1].self_attn.qkv_proj] if i + 1 < len(layers) else []
            expected.append(tuple(w.weight.data_ptr() for w in ws))
        assert calls == expected * 5  # the five decode steps, each layer once
        calls.clear()
        eng.add_request("a", list(range(5, 25)), params)
        eng.add_request("b", list(range(30, 41)), params)
        while eng.has_unfinished_requests():
            eng.step()
        assert calls == []  # two rows: the GEMVs stream their weights themselves
    assert tokens[()] == tokens[("l2_prefetch",)] and len(tokens[()]) == 6


@pytest.mark.skipif(not os.environ.get("TRITON_INTERPRET"), reason="runs the Triton kernels under the interpreter")
def test_logits_of_the_rows_that_sample_are_the_full_forwards(tiny_checkpoints, monkeypatch):
    """``CausalLM.logits``: the final norm on the logits rows only, the LM head writing fp32 itself. Its logits are
    bit for bit those of the final norm over every row, the projection and the fp32 cast (a prompt's last row; one
    decode row); greedy tokens unchanged, and each batch-1 step launches its norm GEMVs and one norm kernel. The
    last layer computes every row (``PRUNE_LAST_LAYER`` off, as by default): pruned, a prompt's logits are the same
    within rounding, not bit for bit (tests/unit/runtime/test_prune_last_layer.py)."""
    from kernellab.kernels.compile_check import record_launches
    from kernellab.kernels.testing import patch_interpreter
    from kernellab.runtime import model as model_mod
    from kernellab.runtime.request.sampling import SamplingParams

    patch_interpreter()
    monkeypatch.setattr(model_mod, "PRUNE_LAST_LAYER", False)
    eng = triton_qwen3(tiny_checkpoints, ())
    model = eng.runner.model
    inner, checked = model.logits, []

    def logits(ids, meta, kv, rows):  # each step's logits against the full forward's (its KV writes are the same)
        full = model(ids, meta, kv)
        want = model.ops.linear(full if rows is None else full[rows], model.lm_head.weight).float()
        got = inner(ids, meta, kv, rows)
        assert got.dtype == torch.float32 and got.shape == want.shape
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        checked.append(ids.shape[0])
        return got

    model.logits = logits
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def generate(rid: str) -> tuple[list[int], list[dict]]:
        """One request's tokens, and the launches of its decode steps (the prompt's step left out)."""
        eng.add_request(rid, list(range(5, 25)), params)
        out = [t for o in eng.step() for t in o.new_token_ids]  # the prompt
        with record_launches() as launches:
            while eng.has_unfinished_requests():
                out += [t for o in eng.step() for t in o.new_token_ids]
        return out, launches

    checked_tokens, _ = generate("s")
    assert checked == [20, 1, 1, 1, 1, 1]
    del model.logits
    tokens, launches = generate("t")
    norm_gemvs = sum(1 for x in launches if x["kernel"] == "_gemv_kernel" and x["constexprs"].get("NORM"))
    norms = sum(1 for x in launches if x["kernel"] == "_rms_norm_kernel")
    # 5 decode steps: 4 norm GEMVs each (two layers' input and post-attention norms), and the final norm's kernel
    assert (norm_gemvs, norms) == (20, 5)
    assert checked_tokens == tokens and len(tokens) == 6


def greedy_on_and_off(tiny_checkpoints, op: str, max_tokens: int, count) -> tuple[dict, dict]:
    """The tiny Qwen3's greedy tokens for one 70-token prompt with ``op`` enabled (key ``()``) and disabled (key
    ``(op,)``), and ``count(launches)`` over each run's recorded kernel launches."""
    from kernellab.kernels.compile_check import record_launches
    from kernellab.runtime.request.sampling import SamplingParams

    tokens, counts = {}, {}
    for disabled in ((), (op,)):
        eng = triton_qwen3(tiny_checkpoints, disabled)
        assert (op in eng.runner.model.ops.enabled) == (not disabled)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        eng.add_request("r", list(range(5, 75)), params)
        out = []
        with record_launches() as launches:
            while eng.has_unfinished_requests():
                out += [t for o in eng.step() for t in o.new_token_ids]
        tokens[disabled], counts[disabled] = out, count(launches)
    return tokens, counts


@pytest.mark.skipif(not os.environ.get("TRITON_INTERPRET"), reason="runs the Triton kernels under the interpreter")
def test_prefill_mlp_takes_the_swiglu_epilogue_and_keeps_its_tokens(tiny_checkpoints, monkeypatch):
    """A prefill step of the tiny 2-layer Qwen3 with ``gate_up_swiglu`` (its row threshold lowered to the prompt):
    each layer's gate/up projection is the descriptor GEMM with the SwiGLU epilogue, and the greedy tokens equal
    those of the engine with the op off (the projection, then the SwiGLU kernel). The decode steps below the
    threshold keep their own path."""
    from kernellab.kernels.testing import patch_interpreter
    from kernellab.runtime import dispatch
    from kernellab.runtime import model as model_mod

    patch_interpreter()
    op = "gate_up_swiglu"
    table = dispatch.load_status()
    monkeypatch.setattr(dispatch, "load_status", lambda: {**table, op: {"status": "accepted"}})
    monkeypatch.setattr(model_mod, "GATE_UP_SWIGLU_MIN_ROWS", 32)
    tokens, glu = greedy_on_and_off(
        tiny_checkpoints, op, 4,
        lambda launches: sum(1 for x in launches if x["kernel"] == "_gemm_desc_kernel" and x["constexprs"]["GLU"]),
    )  # fmt: skip
    assert glu == {(): 2, (op,): 0}  # the 70-row prefill, one launch a layer
    assert tokens[()] == tokens[(op,)] and len(tokens[()]) == 4


@pytest.mark.skipif(not os.environ.get("TRITON_INTERPRET"), reason="runs the Triton kernels under the interpreter")
def test_prefill_qkv_takes_the_rope_epilogue_and_keeps_its_tokens(tiny_checkpoints, monkeypatch):
    """A prefill step of the tiny 2-layer Qwen3 with ``qkv_proj_norm_rope_store_kv`` (row threshold lowered to the
    prompt, tiles of two of its 32-wide heads): each layer's QKV projection carries the QK-norm, RoPE and KV write,
    the prompt runs no ``qk_norm_rope_store_kv`` kernel, and the greedy tokens, decoded from the cache it wrote,
    equal those of the engine with the op off."""
    from kernellab.kernels import gemm
    from kernellab.kernels.testing import patch_interpreter
    from kernellab.runtime import attention, dispatch
    from kernellab.runtime import model as model_mod

    patch_interpreter()
    op = "qkv_proj_norm_rope_store_kv"
    table = dispatch.load_status()
    monkeypatch.setattr(dispatch, "load_status", lambda: {**table, op: {"status": "accepted"}})
    monkeypatch.setattr(model_mod, "QKV_ROPE_MIN_ROWS", 32)
    # the epilogue goes with the Triton prefill attention, which otherwise runs in whole-step graphs only: this
    # engine's prefill runs eagerly
    monkeypatch.setattr(attention, "PREFILL_TRITON_EAGER", True)
    tiles = {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 16, "GROUP_M": 2, "num_warps": 4, "num_stages": 2}
    monkeypatch.setattr(gemm, "DESC_QKV_TILES", tiles)
    tokens, kernels = greedy_on_and_off(
        tiny_checkpoints, op, 4,
        lambda launches: (
            sum(1 for x in launches if x["kernel"] == "_gemm_qkv_rope_kernel"),
            sum(1 for x in launches if x["kernel"] == "_qk_rope_kernel"),
        ),
    )  # fmt: skip
    (fused, rope), (fused_off, rope_off) = kernels[()], kernels[(op,)]
    assert (fused, fused_off) == (2, 0)  # the 70-row prefill, one launch a layer
    assert rope == rope_off - 2  # the prompt's two rope launches are gone; decode steps keep theirs
    assert tokens[()] == tokens[(op,)] and len(tokens[()]) == 4
