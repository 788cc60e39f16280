"""Shared fixtures: tiny random checkpoints written by transformers, and the embedded real model."""

from __future__ import annotations

import pytest

from kernellab.bench.workloads import CHAT_QUESTIONS


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """{"qwen3": dir, "llama": dir}: tiny random models saved with transformers' save_pretrained."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("ckpt")
    qwen = Qwen3Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    llama = LlamaConfig(
        vocab_size=512,
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    out = {}
    for name, cfg, cls in (("qwen3", qwen, Qwen3ForCausalLM), ("llama", llama, LlamaForCausalLM)):
        model = cls(cfg).eval()
        with torch.no_grad():  # HF's init leaves norms at 1: perturb them so the norm weights are tested
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.add_(torch.randn_like(p) * 0.1)
        model.save_pretrained(root / name)
        out[name] = root / name
    return out


# The benchmarks' chat questions: short prompts of different lengths for the embedded model.
SMOL_PROMPTS = CHAT_QUESTIONS[:16]


@pytest.fixture(scope="session")
def smol_engine_fp32():
    """The embedded real model (SmolLM2-135M GGUF) in fp32, loaded once per test session."""
    from kernellab.runtime.engine import LLM

    return LLM("smollm2-135m", device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def smol_engine_int4():
    """The embedded model in fp32 with its Q4_1 linears also as int4 codes (batch-1 decode reads those)."""
    from kernellab.runtime.engine import LLM

    return LLM("smollm2-135m", device="cpu", dtype="float32", weight_quant="int4")
