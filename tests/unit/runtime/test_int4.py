"""Weight-only int4 from the GGUF's own Q4_1 blocks (runtime/quant.py): the repack is exact, the int4 matmul
equals the dense one on the same weights, and an engine with ``weight_quant="int4"`` decodes SmolLM2 like the
dense engine does (fp32: the same weights, only the summation order differs)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernellab.runtime import quant
from kernellab.runtime.request.errors import ConfigError
from kernellab.runtime.request.registry import resolve_model, wheel_file_path
from kernellab.runtime.request.sampling import SamplingParams
from tests.conftest import SMOL_PROMPTS

pytestmark = pytest.mark.skipif(not quant.available(), reason="this torch has no CPU int4pack matmul")


def _q4_1_bytes(codes: np.ndarray, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Encode blocks the way ggml lays out Q4_1 (an independent writer for the reader under test)."""
    n, k = codes.shape
    g = codes.reshape(n, k // 32, 32).astype(np.uint8)
    qs = g[..., :16] | (g[..., 16:] << 4)
    head = np.concatenate(
        [d.astype(np.float16)[..., None].view(np.uint8), m.astype(np.float16)[..., None].view(np.uint8)],
        axis=-1,
    )
    return np.concatenate([head.reshape(n, k // 32, 4), qs], axis=-1).reshape(n, -1)


def test_q4_1_unpack_round_trips_and_matches_gguf():
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, size=(6, 64))
    d = rng.uniform(0.001, 0.02, size=(6, 2)).astype(np.float16).astype(np.float32)
    m = rng.uniform(-0.1, 0.0, size=(6, 2)).astype(np.float16).astype(np.float32)
    raw = _q4_1_bytes(codes, d, m)
    got_codes, got_d, got_m = quant.q4_1_unpack(raw, (6, 64))
    assert (got_codes == codes).all() and (got_d == d).all() and (got_m == m).all()
    ref = dequantize(raw, GGMLQuantizationType.Q4_1).reshape(6, 64)
    np.testing.assert_array_equal(quant.q4_1_dequantize(got_codes, got_d, got_m), ref)


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_int4_matmul_equals_dense_on_the_same_weights(rows):
    rng = np.random.default_rng(rows)
    n, k = 96, 128
    codes = rng.integers(0, 16, size=(n, k))
    d = rng.uniform(0.001, 0.02, size=(n, k // 32)).astype(np.float16).astype(np.float32)
    m = rng.uniform(-0.1, 0.0, size=(n, k // 32)).astype(np.float16).astype(np.float32)
    dense = torch.from_numpy(quant.q4_1_dequantize(codes, d, m))
    w = quant.Int4Weight.from_q4_1(codes, d, m)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    torch.testing.assert_close(w.mm(x), x @ dense.T, atol=1e-5, rtol=1e-5)
    w.to(torch.bfloat16)
    torch.testing.assert_close(w.mm(x.bfloat16()).float(), x @ dense.T, atol=0.05, rtol=0.02)


def test_every_smollm2_linear_gets_int4_codes_equal_to_its_dense_weight(smol_engine_int4):
    from kernellab.runtime.loader import gguf_weights, load_config

    model = smol_engine_int4.engine.runner.model
    linears = [(n, mod) for n, mod in model.named_modules() if hasattr(mod, "int4")]
    with_int4 = [(n, mod) for n, mod in linears if mod.int4 is not None]
    assert len(with_int4) == 4 * model.cfg.num_layers + 1 and model.int4_max_rows == 4
    assert isinstance(model.lm_head.int4, quant.Int4Pair)  # token_embd is Q8_0: two int4 halves, tied LM head
    path = wheel_file_path(resolve_model("smollm2-135m"))
    dense = dict(gguf_weights(path, load_config(path)))
    q = dense["model.layers.0.self_attn.q_proj.weight"]
    eye = torch.eye(q.shape[1])
    qkv = model.get_submodule("model.layers.0.self_attn.qkv_proj").int4
    torch.testing.assert_close(qkv.mm(eye).T[: q.shape[0]], q, atol=1e-6, rtol=0)  # un-permuted rows, exact
    emb = dense["model.embed_tokens.weight"]
    rows = torch.arange(0, emb.shape[0], 997)  # the LM head's int4 pair against the dequantized embedding
    x = torch.randn(2, emb.shape[1], generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model.lm_head.int4.mm(x)[:, rows], x @ emb[rows].T, atol=2e-5, rtol=1e-5)


def test_q8_0_as_two_int4_halves_is_exact():
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rng = np.random.default_rng(1)
    n, k = 48, 96  # rows: a multiple of 16 (the int4pack layout)
    codes = rng.integers(-127, 128, size=(n, k)).astype(np.int8)
    d = rng.uniform(0.001, 0.01, size=(n, k // 32)).astype(np.float16)
    raw = np.concatenate([d[..., None].view(np.uint8), codes.reshape(n, k // 32, 32).view(np.uint8)], axis=-1)
    got_codes, got_d = quant.q8_0_unpack(raw.reshape(n, -1), (n, k))
    assert (got_codes == codes).all() and (got_d == d.astype(np.float32)).all()
    dense = torch.from_numpy(dequantize(raw.reshape(n, -1), GGMLQuantizationType.Q8_0).reshape(n, k))
    pair = quant.Int4Pair.from_q8_0(got_codes, got_d)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(pair.mm(x), x @ dense.T, atol=1e-5, rtol=1e-5)


def test_int4_engine_decodes_like_the_dense_engine(smol_engine_fp32, smol_engine_int4):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [smol_engine_fp32.encode([{"role": "user", "content": p}]) for p in SMOL_PROMPTS[:6]]
    dense = [o.token_ids for o in smol_engine_fp32.generate(prompts, params)]
    one_by_one = [smol_engine_int4.generate([p], params)[0].token_ids for p in prompts]  # batch 1: int4 path
    assert one_by_one == dense


def test_int4_needs_a_q4_1_checkpoint_on_the_cpu():
    from kernellab.runtime.engine import LLMEngine

    with pytest.raises(ConfigError, match="GGUF"):
        LLMEngine(model="qwen3-0.6b", random_weights=True, device="cpu", weight_quant="int4", num_kv_blocks=4)
    with pytest.raises(ConfigError, match="weight_quant"):
        LLMEngine(model="smollm2-135m", weight_quant="int8")
