"""Our decoder against HF transformers on the same tiny random checkpoints (fp32): prefill and 16 decode
steps through the paged cache, for a batch of 4 prompts of different lengths."""

from __future__ import annotations

import pytest
import torch

from kernellab.runtime.engine import LLMEngine
from kernellab.runtime.request.sampling import SamplingParams

PROMPT_LENS = (5, 17, 33, 64)
DECODE_STEPS = 16


def _record_logits(engine: LLMEngine) -> dict[str, list[torch.Tensor]]:
    """Wrap the runner so each step's logits are kept per request, in sampling order."""
    seen: dict[str, list[torch.Tensor]] = {}
    runner = engine.runner
    original = runner.sampler.__call__

    def recording_sampler(logits, seqs):
        for row, seq in zip(logits, seqs, strict=True):
            seen.setdefault(seq.request_id, []).append(row.clone())
        return original(logits, seqs)

    runner.sampler = recording_sampler
    return seen


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("chunked", [True, False])
def test_logits_match_transformers(tiny_checkpoints, arch, chunked):
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoints[arch]
    engine = LLMEngine(
        model=str(path),
        device="cpu",
        dtype="float32",
        num_kv_blocks=64,
        block_size=16,
        max_num_batched_tokens=48 if chunked else 2048,
        enable_chunked_prefill=chunked,
    )
    seen = _record_logits(engine)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    params = SamplingParams(temperature=0.0, max_tokens=DECODE_STEPS + 1, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    engine.check_integrity()

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for i, prompt in enumerate(prompts):
        rid = f"r{i}"
        full = torch.tensor([prompt + tokens[rid]])
        with torch.no_grad():
            ref = hf(full).logits[0]
        ours = torch.stack(seen[rid])  # one row per sampled token: prefill then 16 decode steps
        want = ref[len(prompt) - 1 : len(prompt) + DECODE_STEPS]
        assert ours.shape == want.shape
        torch.testing.assert_close(ours, want, atol=1e-4, rtol=1e-4, msg=lambda m, rid=rid: f"{arch} {rid}: {m}")
