"""RoPE, QK-norm + RoPE and the fused QK-norm + RoPE + paged KV write, and the standalone KV write."""

from __future__ import annotations

import pytest
import torch

from kernellab.kernels.kv_cache import store_kv
from kernellab.kernels.rope import qk_norm_rope, qk_norm_rope_store_kv, rotary_embedding
from kernellab.runtime import ops
from tests.support.kernels import DTYPE_PARAMS, assert_close, poison, poisoned

MAX_POS = 64
# The eager reference rounds to bf16 after every product and sum; the interpreter truncates fp32 → bf16
# instead of rounding to nearest, so bf16 drifts up to ~4 ulp here. The GPU tests check bf16 bit for bit.
ROPE_DTYPES = [(dt, a, r) if dt != torch.bfloat16 else (dt, 3.2e-2, 3.2e-2) for dt, a, r in DTYPE_PARAMS]


def _qkv(T, Hq, Hk, D, dtype, gen):
    """q, k, v as strided views into one fused projection output, as the model produces them."""
    qkv = torch.randn(T, (Hq + 2 * Hk) * D, generator=gen).mul(2).to(dtype)
    q = qkv[:, : Hq * D].view(T, Hq, D)
    k = qkv[:, Hq * D : (Hq + Hk) * D].view(T, Hk, D)
    v = qkv[:, (Hq + Hk) * D :].view(T, Hk, D)
    return q, k, v


@pytest.mark.parametrize("dtype, atol, rtol", ROPE_DTYPES)
@pytest.mark.parametrize("T, Hq, Hk, D", [(1, 2, 1, 32), (7, 4, 2, 64), (5, 3, 3, 48)])
def test_rotary_embedding(T, Hq, Hk, D, dtype, atol, rtol, gen):
    q, k, _ = _qkv(T, Hq, Hk, D, dtype, gen)
    pos = torch.randint(0, MAX_POS, (T,), generator=gen)
    cache = ops.rope_cos_sin_cache(D, MAX_POS, 10000.0)
    q_out, k_out = poisoned(q.shape, dtype, "cpu"), poisoned(k.shape, dtype, "cpu")
    qr, kr = rotary_embedding(pos, q, k, cache, q_out=q_out, k_out=k_out)
    q_ref, k_ref = ops.rotary_embedding(pos, q, k, cache)
    assert_close(qr, q_ref, atol, rtol, "q")
    assert_close(kr, k_ref, atol, rtol, "k")


@pytest.mark.parametrize("dtype, atol, rtol", ROPE_DTYPES)
@pytest.mark.parametrize("T, Hq, Hk, D", [(1, 2, 1, 32), (6, 4, 2, 64), (3, 6, 2, 48)])
def test_qk_norm_rope(T, Hq, Hk, D, dtype, atol, rtol, gen):
    q, k, _ = _qkv(T, Hq, Hk, D, dtype, gen)
    pos = torch.randint(0, MAX_POS, (T,), generator=gen, dtype=torch.int32)
    cache = ops.rope_cos_sin_cache(D, MAX_POS, 1e6)
    qw = (1 + 0.2 * torch.randn(D, generator=gen)).to(dtype)
    kw = (1 + 0.2 * torch.randn(D, generator=gen)).to(dtype)
    q_out, k_out = poisoned(q.shape, dtype, "cpu"), poisoned(k.shape, dtype, "cpu")
    qr, kr = qk_norm_rope(pos, q, k, qw, kw, 1e-6, cache, q_out=q_out, k_out=k_out)
    q_ref, k_ref = ops.qk_norm_rope(pos, q, k, qw, kw, 1e-6, cache)
    assert_close(qr, q_ref, atol, rtol, "q")
    assert_close(kr, k_ref, atol, rtol, "k")


@pytest.mark.parametrize("dtype, atol, rtol", ROPE_DTYPES)
@pytest.mark.parametrize("block_size", [16, 5])
def test_qk_norm_rope_store_kv(block_size, dtype, atol, rtol, gen):
    T, Hq, Hk, D, num_blocks = 9, 4, 2, 32, 6
    q, k, v = _qkv(T, Hq, Hk, D, dtype, gen)
    pos = torch.randint(0, MAX_POS, (T,), generator=gen)
    cache = ops.rope_cos_sin_cache(D, MAX_POS, 1e6)
    qw = (1 + 0.2 * torch.randn(D, generator=gen)).to(dtype)
    kw = (1 + 0.2 * torch.randn(D, generator=gen)).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:T]
    slots[[2, 5]] = -1  # padding tokens are skipped
    k_cache = poisoned((num_blocks, block_size, Hk, D), dtype, "cpu")
    v_cache = poisoned((num_blocks, block_size, Hk, D), dtype, "cpu")
    k_cache_ref, v_cache_ref = k_cache.clone(), v_cache.clone()
    q_out, k_out = poisoned(q.shape, dtype, "cpu"), poisoned(k.shape, dtype, "cpu")
    qr, kr = qk_norm_rope_store_kv(pos, q, k, v, qw, kw, 1e-6, cache, k_cache, v_cache, slots, q_out=q_out, k_out=k_out)
    q_ref, k_ref = ops.qk_norm_rope_store_kv(pos, q, k, v, qw, kw, 1e-6, cache, k_cache_ref, v_cache_ref, slots)
    assert_close(qr, q_ref, atol, rtol, "q")
    assert_close(kr, k_ref, atol, rtol, "k")
    # unwritten slots must still hold the poison, written ones the reference
    assert torch.equal(torch.isnan(k_cache), torch.isnan(k_cache_ref))
    assert_close(k_cache.nan_to_num(7.0), k_cache_ref.nan_to_num(7.0), atol, rtol, "k_cache")
    assert torch.equal(v_cache.nan_to_num(7.0), v_cache_ref.nan_to_num(7.0))


def test_qk_norm_rope_store_kv_dense_v(gen):
    """``v_out``: every row of v (padding rows too) copied dense from a strided view of a fused QKV row, as the
    prefill attention takes it; the rest as without it."""
    T, Hq, Hk, D, bs = 7, 4, 2, 32, 16
    qkv = torch.randn(T, (Hq + 2 * Hk) * D, generator=gen).to(torch.bfloat16)
    q, k, v = (x.view(T, -1, D) for x in qkv.split([Hq * D, Hk * D, Hk * D], dim=-1))
    pos = torch.randint(0, MAX_POS, (T,), generator=gen)
    cache = ops.rope_cos_sin_cache(D, MAX_POS, 1e6)
    w = torch.ones(D, dtype=torch.bfloat16)
    slots = torch.arange(T)
    slots[3] = -1
    caches = [poisoned((2, bs, Hk, D), torch.bfloat16, "cpu") for _ in range(4)]
    v_out, v_ref = poisoned(v.shape, torch.bfloat16, "cpu"), poisoned(v.shape, torch.bfloat16, "cpu")
    qr, kr = qk_norm_rope_store_kv(pos, q, k, v, w, w, 1e-6, cache, caches[0], caches[1], slots, v_out=v_out)
    q_ref, k_ref = ops.qk_norm_rope_store_kv(pos, q, k, v, w, w, 1e-6, cache, caches[2], caches[3], slots, v_out=v_ref)
    assert torch.equal(v_out, v) and torch.equal(v_ref, v)
    assert_close(qr, q_ref, 2e-2, 2e-2, "q")
    assert_close(kr, k_ref, 2e-2, 2e-2, "k")
    assert torch.equal(caches[1].nan_to_num(7.0), caches[3].nan_to_num(7.0))


def test_rotary_in_place(gen):
    q, k, _ = _qkv(4, 2, 2, 32, torch.float32, gen)
    pos = torch.arange(4)
    cache = ops.rope_cos_sin_cache(32, MAX_POS, 1e4)
    q_ref, k_ref = ops.rotary_embedding(pos, q, k, cache)
    rotary_embedding(pos, q, k, cache, q_out=q, k_out=k)
    assert_close(q, q_ref, 1e-5, 1e-5, "q")
    assert_close(k, k_ref, 1e-5, 1e-5, "k")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size, Hk, D", [(16, 2, 32), (32, 1, 64), (3, 3, 24)])
def test_store_kv(block_size, Hk, D, dtype, gen):
    T, num_blocks = 7, 5
    _, k, v = _qkv(T, 1, Hk, D, dtype, gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:T].to(torch.int32)
    slots[3] = -1
    k_cache = poisoned((num_blocks, block_size, Hk, D), dtype, "cpu")
    v_cache = poison(torch.empty_like(k_cache))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv(k, v, k_cache, v_cache, slots)
    ops.store_kv(k, v, k_ref, v_ref, slots.long())
    assert torch.equal(k_cache.nan_to_num(7.0), k_ref.nan_to_num(7.0))
    assert torch.equal(v_cache.nan_to_num(7.0), v_ref.nan_to_num(7.0))
