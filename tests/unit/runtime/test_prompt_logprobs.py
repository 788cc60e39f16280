"""Prompt logprobs (``SamplingParams.prompt_logprobs``, completions' echo with logprobs) against HF transformers on
the tiny random checkpoints (fp32): every prompt token after the first, scored from the logits at the position
before it, through chunked prefill and beside requests that do not ask for them; never from the prefix cache."""

from __future__ import annotations

import pytest
import torch

from kernellab.runtime.engine import LLMEngine
from kernellab.runtime.request.errors import InvalidRequestError
from kernellab.runtime.request.sampling import SamplingParams


def _hf_prompt_logprobs(path, prompt: list[int], k: int):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    chosen = logp[:-1].gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)
    return chosen, logp[:-1].topk(k, dim=-1)


def _run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, dict]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    got: dict[str, dict] = {rid: {"tokens": [], "prompt_logprobs": None, "outputs": 0} for rid in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            r = got[out.request_id]
            r["tokens"] += out.new_token_ids
            if out.prompt_logprobs is not None:
                assert r["prompt_logprobs"] is None, "prompt logprobs come once"
                assert out.new_token_ids, "with the first output token"
                r["prompt_logprobs"] = out.prompt_logprobs
                r["cached"] = out.num_cached_tokens
    engine.check_integrity()
    return got


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_prompt_logprobs_match_transformers_through_chunked_prefill(tiny_checkpoints, arch):
    path = tiny_checkpoints[arch]
    engine = LLMEngine(
        model=str(path), device="cpu", dtype="float32", num_kv_blocks=64, block_size=16, max_num_batched_tokens=48
    )
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 512, (70,), generator=gen).tolist()  # two chunks of 48 and 22 tokens
    other = torch.randint(0, 512, (20,), generator=gen).tolist()
    greedy = dict(temperature=0.0, max_tokens=3, ignore_eos=True)
    got = _run(
        engine,
        {
            "scored": (prompt, SamplingParams(prompt_logprobs=3, **greedy)),
            "plain": (other, SamplingParams(**greedy)),
            "plain-same-prompt": (prompt, SamplingParams(**greedy)),
        },
    )
    entries = got["scored"]["prompt_logprobs"]
    assert got["plain"]["prompt_logprobs"] is None and len(entries) == len(prompt) - 1
    chosen, top = _hf_prompt_logprobs(path, prompt, 3)
    assert [e.token_id for e in entries] == prompt[1:]
    torch.testing.assert_close(torch.tensor([e.logprob for e in entries]), chosen, atol=1e-4, rtol=0)
    assert [[t for t, _ in e.top] for e in entries] == top.indices.tolist()
    torch.testing.assert_close(torch.tensor([[v for _, v in e.top] for e in entries]), top.values, atol=1e-4, rtol=0)
    # scoring the prompt changes nothing about what is generated from it
    assert got["scored"]["tokens"] == got["plain-same-prompt"]["tokens"]

    # the same prompt again, now in the prefix cache: still scored whole, none of it taken from the cache
    again = _run(engine, {"again": (prompt, SamplingParams(prompt_logprobs=0, **greedy))})["again"]
    assert again["cached"] == 0 and [e.logprob for e in again["prompt_logprobs"]] == [e.logprob for e in entries]
    assert all(e.top == [] for e in again["prompt_logprobs"])


def test_a_resumed_request_that_has_emitted_does_not_score_its_prompt_again(tiny_checkpoints):
    engine = LLMEngine(model=str(tiny_checkpoints["qwen3"]), device="cpu", dtype="float32", num_kv_blocks=64)
    params = SamplingParams(prompt_logprobs=1, temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("resumed", [5, 6, 7, 8], params, output_token_ids=[9, 10])
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert sum(len(o.new_token_ids) for o in outs) == 2 and all(o.prompt_logprobs is None for o in outs)


@pytest.mark.parametrize("value", [-1, 21, 1.5, True])
def test_bad_prompt_logprobs_are_refused(value):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(prompt_logprobs=value)
    assert info.value.param == "prompt_logprobs"
