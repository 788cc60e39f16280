"""A prompt's greedy output alone equals its output inside a batch of 16 prompts of different lengths —
with chunked prefill on and off, and with preemption forced by a tiny block pool."""

from __future__ import annotations

import pytest

from kernellab.runtime.engine import LLM
from kernellab.runtime.request.sampling import SamplingParams
from tests.conftest import SMOL_PROMPTS

pytestmark = pytest.mark.slow
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def prompts(llm):
    # Different lengths: the chat template plus prompts repeated 1-4 times.
    return [llm.encode([{"role": "user", "content": " ".join([p] * (1 + i % 4))}]) for i, p in enumerate(SMOL_PROMPTS)]


@pytest.fixture(scope="module")
def alone(smol_engine_fp32):
    llm = smol_engine_fp32
    return [llm.generate([p], PARAMS)[0].token_ids for p in prompts(llm)]


@pytest.mark.parametrize(
    "config",
    [
        {"enable_chunked_prefill": True, "max_num_batched_tokens": 96},
        {"enable_chunked_prefill": False, "max_num_batched_tokens": 4096},
        {"enable_chunked_prefill": True, "max_num_batched_tokens": 256, "num_kv_blocks": 48, "block_size": 16},
    ],
    ids=["chunked", "unchunked", "tiny-pool-preemption"],
)
def test_batch_equals_alone(alone, config):
    llm = LLM("smollm2-135m", device="cpu", dtype="float32", **config)
    batch = llm.generate(prompts(llm), PARAMS)
    for i, out in enumerate(batch):
        assert out.token_ids == alone[i], f"prompt {i} differs inside the batch"
    if "num_kv_blocks" in config:
        assert llm.engine.scheduler.num_preemptions > 0, "the tiny pool must force preemption"
    llm.engine.check_integrity()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
