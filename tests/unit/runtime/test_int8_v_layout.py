"""The int8 KV cache's V, transposed within its blocks, through the whole engine: the engine allocates it so, the
Triton path (interpreter) writes it with the fused QK-norm + RoPE store and reads it with the int8-dot decode
attention (one 64-token block a tile, copied through tensor descriptors), and greedy decoding emits the same tokens as the same engine with V laid out like K (the fp16-widening
kernel)."""

from __future__ import annotations

import pytest
import torch

from kernellab.kernels.compile_check import record_launches
from kernellab.kernels.kv_cache import v_transposed
from kernellab.runtime import ops
from kernellab.runtime.engine import LLM
from kernellab.runtime.request.sampling import SamplingParams


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    from kernellab.bench.synthetic import write_checkpoint

    path = tmp_path_factory.mktemp("tiny") / "tiny-qwen3"
    write_checkpoint(path, "tiny-qwen3", device="cpu")
    return str(path)


def _generate(model: str, transposed: bool, monkeypatch) -> tuple[list[list[int]], list[tuple], torch.Tensor]:
    from kernellab.kernels.testing import patch_interpreter

    patch_interpreter()
    monkeypatch.setattr(ops, "INT8_V_TRANSPOSED", transposed)
    llm = LLM(
        model,
        device="cpu",
        dtype="bfloat16",
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        num_kv_blocks=64,
        kernels="experimental",
        kv_cache_dtype="int8",
        backend="triton",
    )
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (5, 40)]
    with record_launches() as launches:
        out = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    forms = [(x["kernel"], x["constexprs"].get("V_T"), x["constexprs"].get("I8_MMA")) for x in launches]
    return [o.token_ids for o in out], forms, llm.engine.runner.kv_caches[0].v


def test_the_transposed_int8_v_decodes_the_tokens_of_the_dense_layout(tiny_checkpoint, monkeypatch):
    tokens_t, forms_t, v_t = _generate(tiny_checkpoint, True, monkeypatch)
    tokens_d, forms_d, v_d = _generate(tiny_checkpoint, False, monkeypatch)
    assert v_transposed(v_t) and not v_transposed(v_d)
    # int8 dots over the transposed V: the engine's int8 cache takes 64-token blocks (EngineConfig.block_size 0),
    # each one tile copied by tensor descriptors
    assert ("_paged_decode_i8_tma_kernel", None, None) in forms_t and v_t.shape[1] == 64
    assert ("_qk_rope_kernel", True, None) in forms_t  # the fused store writes it
    assert ("_paged_decode_kernel", False, False) in forms_d
    assert all(len(t) == 6 for t in tokens_t)
    assert tokens_t == tokens_d


def test_the_block_size_defaults_by_cache():
    """``block_size`` 0 (the default) resolves once: 64 tokens for the int8 cache (its descriptor tiles are whole
    blocks), 16 for the others; a given size stays, and a size that is no power of two is refused."""
    from kernellab.runtime.config import ConfigError, EngineConfig

    assert EngineConfig(kv_cache_dtype="int8").block_size == 64
    assert EngineConfig().block_size == EngineConfig(kv_cache_dtype="fp8").block_size == 16
    assert EngineConfig(kv_cache_dtype="int8", block_size=16).block_size == 16
    with pytest.raises(ConfigError, match="power of two"):
        EngineConfig(block_size=24)
