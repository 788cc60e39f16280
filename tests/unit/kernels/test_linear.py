"""Decode GEMV (dense, W8A16, W4A16, split-K), the bucketed GEMM and the linear dispatcher."""

from __future__ import annotations

import pytest
import torch

from kernellab.kernels import gemm, gemv, linear, quant_gemv
from kernellab.kernels.gemv import GemvConfig
from kernellab.runtime import ops
from tests.support.kernels import assert_close, poisoned

# bf16 outputs of a K-long fp32 dot: one final rounding (2⁻⁸ relative) plus fp32 summation-order noise.
LINEAR_DTYPES = [(torch.float32, 1e-4, 1e-4), (torch.float16, 2e-3, 2e-3), (torch.bfloat16, 2e-2, 1.6e-2)]


def _xw(M, N, K, dtype, gen):
    return (torch.randn(M, K, generator=gen).to(dtype), (torch.randn(N, K, generator=gen) / K**0.5).to(dtype))


@pytest.mark.parametrize("dtype, atol, rtol", LINEAR_DTYPES)
@pytest.mark.parametrize("M, N, K", [(1, 1, 64), (1, 37, 100), (3, 50, 257), (16, 33, 96)])
def test_gemv(M, N, K, dtype, atol, rtol, gen):
    x, w = _xw(M, N, K, dtype, gen)
    out = poisoned((M, N), dtype, "cpu")
    assert_close(gemv.linear(x, w, out=out), ops.linear(x.float(), w.float()).to(dtype), atol, rtol, "gemv")


@pytest.mark.parametrize("M", [1, 5])
@pytest.mark.parametrize("config", [GemvConfig(8, 32, 3), GemvConfig(16, 64, 2, num_warps=2)])
def test_gemv_split_k_repeated_calls(M, config, gen):
    """Split-K: the semaphore must finish every column block and reset itself for the next call."""
    x, w = _xw(M, 45, 200, torch.float32, gen)
    for _ in range(3):
        out = poisoned((M, 45), torch.float32, "cpu")
        x = torch.randn(M, 200, generator=gen)
        assert_close(gemv.linear(x, w, out=out, config=config), ops.linear(x, w), 1e-4, 1e-4, "split-K")


def test_gemv_rejects_many_rows():
    with pytest.raises(ValueError):
        gemv.linear(torch.zeros(17, 8), torch.zeros(4, 8))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("M, N, K, config", [(1, 37, 100, None), (4, 20, 64, None), (1, 45, 200, GemvConfig(8, 64, 2))])
@pytest.mark.parametrize("dtype, atol, rtol", [(torch.float32, 1e-4, 1e-4), (torch.bfloat16, 2e-2, 1.6e-2)])
def test_quantized_gemv(bits, M, N, K, config, dtype, atol, rtol, gen):
    x, w = _xw(M, N, K, torch.float32, gen)
    x = x.to(dtype)
    qw = quant_gemv.quantize_weight(w, bits)
    fn = quant_gemv.linear_w8a16 if bits == 8 else quant_gemv.linear_w4a16
    out = poisoned((M, N), dtype, "cpu")
    y = fn(x, qw.qweight, qw.scales, out=out, config=config)
    ref = ops.linear(x.float(), quant_gemv.dequantize_weight(qw)).to(dtype)
    assert_close(y, ref, atol, rtol, f"w{bits}a16")


@pytest.mark.parametrize("bits, max_rel_err", [(8, 0.01), (4, 0.2)])
def test_quantize_saves_memory_and_approximates(bits, max_rel_err, gen):
    w = torch.randn(64, 128, generator=gen).to(torch.bfloat16)
    qw = quant_gemv.quantize_weight(w, bits)
    assert qw.qweight.nbytes == w.numel() * bits // 8
    assert qw.nbytes < w.nbytes * (0.55 if bits == 8 else 0.3)
    deq = quant_gemv.dequantize_weight(qw)
    rel = (deq - w.float()).norm() / w.float().norm()
    assert rel < max_rel_err


@pytest.mark.parametrize("dtype, atol, rtol", LINEAR_DTYPES)
@pytest.mark.parametrize("M, N, K", [(33, 50, 70), (70, 17, 129)])
def test_gemm(M, N, K, dtype, atol, rtol, gen):
    x, w = _xw(M, N, K, dtype, gen)
    cfg = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2, "num_warps": 4, "num_stages": 2}
    out = poisoned((M, N), dtype, "cpu")
    y = gemm.linear(x, w, out=out, config=cfg)
    assert_close(y, ops.linear(x.float(), w.float()).to(dtype), atol, rtol, "gemm")


def test_gemm_bucket_configs_cover_all_m():
    assert [gemm.bucket_config(m)["BLOCK_M"] for m in (1, 64, 65, 512, 513)] == [64, 64, 128, 128, 128]


@pytest.mark.parametrize("M", [1, 16, 17])
def test_linear_dispatch(M, gen):
    x, w = _xw(M, 24, 40, torch.float32, gen)
    out = poisoned((M, 24), torch.float32, "cpu")
    assert_close(linear.linear(x, w, out=out), ops.linear(x, w), 1e-4, 1e-4, "linear")


@pytest.mark.parametrize("dtype, atol, rtol", LINEAR_DTYPES)
@pytest.mark.parametrize("N, inter, config", [(40, 96, None), (33, 200, GemvConfig(8, 64, 3))])
def test_swiglu_gemv_reads_what_the_swiglu_kernel_writes(N, inter, config, dtype, atol, rtol, gen):
    """Batch-1 SwiGLU + down projection in one GEMV: the same bits as the SwiGLU kernel followed by the GEMV
    (same config), and the reference within the GEMV's tolerance; split-K included."""
    from kernellab.kernels.swiglu import silu_and_mul

    gate_up = (torch.randn(1, 2 * inter, generator=gen) * 2).to(dtype)
    w = (torch.randn(N, inter, generator=gen) / inter**0.5).to(dtype)
    fused = gemv.gemv(gate_up, w, None, 16, poisoned((1, N), dtype, "cpu"), config, glu=True)
    two_kernels = gemv.linear(silu_and_mul(gate_up), w, config=config)
    torch.testing.assert_close(fused, two_kernels, atol=0, rtol=0)
    ref = ops.silu_and_mul_linear(gate_up.float(), w.float()).to(dtype)
    assert_close(gemv.silu_and_mul_linear(gate_up, w), ref, atol, rtol, "silu_and_mul_linear")


@pytest.mark.parametrize("dtype, atol, rtol", LINEAR_DTYPES)
@pytest.mark.parametrize(
    "N, K, config", [(40, 96, None), (33, 200, GemvConfig(8, 64, 3)), (24, 160, GemvConfig(4, 32, 1))]
)
def test_norm_gemv_reads_what_the_norm_kernel_writes(N, K, config, dtype, atol, rtol, gen):
    """Batch-1 residual add + RMSNorm + projection in one GEMV: on the interpreter the same bits as the
    add_rms_norm kernel followed by the GEMV (same config; on the GPU the row's sum of squares may be reduced in
    another order, an ulp of rstd), the residual sum stored once, and the reference within the GEMV's tolerance;
    split-K and a K loop of several tiles (rstd from the whole row, not the program's slice) included."""
    from kernellab.kernels.rms_norm import add_rms_norm

    x, res = (torch.randn(1, K, generator=gen) * 3).to(dtype), torch.randn(1, K, generator=gen).to(dtype)
    nw = (1 + 0.1 * torch.randn(K, generator=gen)).to(dtype)
    w = (torch.randn(N, K, generator=gen) / K**0.5).to(dtype)
    r_out = poisoned((1, K), dtype, "cpu")
    fused = gemv.gemv(x, w, None, 16, poisoned((1, N), dtype, "cpu"), config, norm=(res, nw, r_out, 1e-6))
    normed, r = add_rms_norm(x, res, nw, 1e-6)
    torch.testing.assert_close(fused, gemv.linear(normed, w, config=config), atol=0, rtol=0)
    torch.testing.assert_close(r_out, r, atol=0, rtol=0)
    y_ref, r_ref = ops.add_rms_norm_linear(x.float(), res.float(), nw.float(), 1e-6, w.float())
    y, r2 = gemv.add_rms_norm_linear(x, res, nw, 1e-6, w)
    assert_close(y, y_ref.to(dtype), atol, rtol, "add_rms_norm_linear")
    assert_close(r2, r_ref.to(dtype), atol, rtol, "residual")
    assert r2.data_ptr() not in (x.data_ptr(), res.data_ptr())


def test_norm_linear_other_shapes_take_the_two_kernels(gen):
    x, res, nw, w = (torch.randn(*s, generator=gen) for s in ((3, 64), (3, 64), (64,), (5, 64)))
    y, r = gemv.add_rms_norm_linear(x, res, nw, 1e-6, w)
    y_ref, r_ref = ops.add_rms_norm_linear(x, res, nw, 1e-6, w)
    assert_close(y, y_ref, 1e-4, 1e-4, "M=3")
    assert_close(r, r_ref, 1e-5, 1e-5, "M=3 residual")
    with pytest.raises(ValueError, match="M = 1"):
        gemv.gemv(x, w, None, 16, None, None, norm=(res, nw, torch.empty_like(res), 1e-6))
    x1 = x[:1].contiguous()
    with pytest.raises(ValueError, match="new buffer"):  # every program reads x: the sum must go elsewhere
        gemv.gemv(x1, w, None, 16, None, None, norm=(res[:1].contiguous(), nw, x1, 1e-6))


def test_swiglu_linear_other_shapes_take_the_two_kernels(gen):
    gate_up = torch.randn(3, 64, generator=gen)
    w = torch.randn(5, 32, generator=gen)
    assert_close(gemv.silu_and_mul_linear(gate_up, w), ops.silu_and_mul_linear(gate_up, w), 1e-4, 1e-4, "M=3")
    with pytest.raises(ValueError):
        gemv.gemv(gate_up, w, None, 16, None, None, glu=True)  # the fused GEMV is one row only


@pytest.mark.parametrize("dtype, atol, rtol", LINEAR_DTYPES)
@pytest.mark.parametrize("N, K, config", [(40, 96, None), (33, 200, GemvConfig(8, 64, 3))])
def test_norm_gemv_without_a_residual_reads_what_the_norm_kernel_writes(N, K, config, dtype, atol, rtol, gen):
    """A model's first layer at one row: ``add_rms_norm_linear(x, None, …)`` is ``linear(rms_norm(x))`` (the same
    bits as the rms_norm kernel followed by the GEMV, on the interpreter) and hands back x itself as the residual
    stream, storing nothing."""
    from kernellab.kernels.rms_norm import rms_norm

    x = (torch.randn(1, K, generator=gen) * 3).to(dtype)
    nw = (1 + 0.1 * torch.randn(K, generator=gen)).to(dtype)
    w = (torch.randn(N, K, generator=gen) / K**0.5).to(dtype)
    fused = gemv.gemv(x, w, None, 16, poisoned((1, N), dtype, "cpu"), config, norm=(None, nw, None, 1e-6))
    torch.testing.assert_close(fused, gemv.linear(rms_norm(x, nw, 1e-6), w, config=config), atol=0, rtol=0)
    y, r = gemv.add_rms_norm_linear(x, None, nw, 1e-6, w)
    assert r is x
    y_ref, r_ref = ops.add_rms_norm_linear(x.float(), None, nw.float(), 1e-6, w.float())
    assert_close(y, y_ref.to(dtype), atol, rtol, "add_rms_norm_linear without a residual")
    torch.testing.assert_close(r_ref, x.float(), atol=0, rtol=0)  # the reference's residual is x too
    x3 = x.expand(3, K).contiguous()
    y3, r3 = gemv.add_rms_norm_linear(x3, None, nw, 1e-6, w)  # other shapes: the norm kernel, then the projection
    assert r3 is x3
    assert_close(y3, y_ref.to(dtype).expand(3, N), atol, rtol, "M=3 without a residual")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("config", [None, GemvConfig(8, 64, 3)])
def test_gemv_fp32_out_holds_the_rounded_projection(dtype, config, gen):
    """The LM head writes its logits as fp32 itself: exactly ``linear(x, W).float()`` (rounded to x's dtype
    first, as the cast kernel it replaces saw them), with and without split-K; the reference and the dispatcher
    (cuBLAS rows copy into the fp32 buffer) agree with it; the fused norm writes fp32 the same way."""
    K, N = 200, 48
    x = torch.randn(1, K, generator=gen).to(dtype)
    w = (torch.randn(N, K, generator=gen) / K**0.5).to(dtype)
    want = gemv.linear(x, w, config=config).float()
    got = gemv.gemv(x, w, None, 16, poisoned((1, N), torch.float32, "cpu"), config)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    out = poisoned((1, N), torch.float32, "cpu")
    assert ops.linear(x, w, out=out) is out
    torch.testing.assert_close(out, torch.nn.functional.linear(x, w).float(), atol=0, rtol=0)
    x3 = torch.randn(3, K, generator=gen).to(dtype)
    out3 = poisoned((3, N), torch.float32, "cpu")
    torch.testing.assert_close(linear.linear(x3, w, out=out3), ops.linear(x3, w).float(), atol=0, rtol=0)
    res, nw = torch.randn(1, K, generator=gen).to(dtype), (1 + 0.1 * torch.randn(K, generator=gen)).to(dtype)
    y16, _ = gemv.add_rms_norm_linear(x, res, nw, 1e-6, w)
    y32, _ = gemv.add_rms_norm_linear(x, res, nw, 1e-6, w, out=poisoned((1, N), torch.float32, "cpu"))
    torch.testing.assert_close(y32, y16.float(), atol=0, rtol=0)


DESC_TEST_TILES = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 2, "num_warps": 4, "num_stages": 2}


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize(
    "M,N,K,dtype,atol,rtol",
    [
        (70, 96, 48, torch.float32, 1e-4, 1e-4),  # partial row and column tiles, K a multiple of BLOCK_K
        (33, 40, 72, torch.float32, 1e-4, 1e-4),  # a K tail (the descriptor's bounds read zeros)
        (70, 96, 48, torch.bfloat16, 5e-2, 2e-2),
    ],
)
def test_gemm_desc(M, N, K, dtype, atol, rtol, persistent, gen):
    x, w = torch.randn(M, K, generator=gen).to(dtype), torch.randn(N, K, generator=gen).to(dtype)
    y = gemm.linear_desc(x, w, config=DESC_TEST_TILES, persistent=persistent)
    assert_close(y, ops.linear(x.float(), w.float()).to(dtype), atol, rtol, "gemm desc")


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("dtype,atol,rtol", [(torch.float32, 1e-3, 1e-4), (torch.bfloat16, 1e-1, 2e-2)])
def test_gemm_desc_swiglu_epilogue(dtype, atol, rtol, persistent, gen):
    """The gate/up projection with SwiGLU in the epilogue equals ``silu_and_mul(linear(x, W))`` up to the rounding
    of the projection (the reference rounds gate and up to x's dtype first; the epilogue works on fp32); 48
    output columns cut by 32-wide tiles, so one tile's gate rows run into the up rows (never stored)."""
    M, inter, K = 70, 48, 64
    x, w = torch.randn(M, K, generator=gen).to(dtype), torch.randn(2 * inter, K, generator=gen).to(dtype)
    y = gemm.linear_desc(x, w, glu=True, config=DESC_TEST_TILES, persistent=persistent)
    assert y.shape == (M, inter)
    ref = ops.silu_and_mul(ops.linear(x.float(), w.float()))
    assert_close(y, ref.to(dtype), atol, rtol, "gemm desc swiglu")


def test_gemm_desc_refuses_unaligned_rows(gen):
    x, w = torch.randn(4, 12, generator=gen).to(torch.bfloat16), torch.randn(8, 12, generator=gen).to(torch.bfloat16)
    with pytest.raises(ValueError, match="16-byte"):
        gemm.linear_desc(x, w)


QKV_TEST_TILES = {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 16, "GROUP_M": 2, "num_warps": 4, "num_stages": 2}


@pytest.mark.parametrize("flatten", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_qkv_projection_with_the_rope_epilogue_equals_the_two_kernels(dtype, flatten, gen):
    """The QKV GEMM with Qwen3's QK-norm, RoPE and KV write in its epilogue (branchy, or branch-free for a
    flattened tile loop): for the same projection (the
    descriptor GEMM's, same tiles) every value and cache row equals what the engine's two-kernel path stores
    (``rope.qk_norm_rope_store_kv`` on that projection), a padding row (slot -1) is not cached, and against the
    torch reference (cuBLAS's place) it agrees to the dtype's rounding."""
    from kernellab.kernels import rope

    Hq, Hk, D, K, M, bs, blocks = 4, 2, 32, 64, 70, 16, 16
    N = (Hq + 2 * Hk) * D
    x = torch.randn(M, K, generator=gen).to(dtype)
    w = (torch.randn(N, K, generator=gen) * 0.2).to(dtype)
    pos = torch.randint(0, 100, (M,), generator=gen)
    cs = ops.rope_cos_sin_cache(D, 128, 1e6)
    qw, kw = (torch.rand(D, generator=gen) + 0.5).to(dtype), (torch.rand(D, generator=gen) + 0.5).to(dtype)
    slots = torch.randperm(blocks * bs, generator=gen)[:M]
    slots[3] = -1
    cache = lambda: torch.zeros(blocks, bs, Hk, D, dtype=dtype)  # noqa: E731
    kc, vc, kc2, vc2, kc3, vc3 = (cache() for _ in range(6))
    y = gemm.qkv_proj_norm_rope_store_kv(
        x, w, pos, qw, kw, 1e-6, cs, kc, vc, slots, Hq, Hk, config=QKV_TEST_TILES, flatten=flatten
    )
    assert y.shape == (M, N)
    lin = gemm.linear_desc(x, w, config=QKV_TEST_TILES)
    q, k, v = (t.view(M, -1, D) for t in lin.split([Hq * D, Hk * D, Hk * D], dim=-1))
    q2, k2 = rope.qk_norm_rope_store_kv(pos, q, k, v, qw, kw, 1e-6, cs, kc2, vc2, slots)
    two_kernels = torch.cat([q2.reshape(M, -1), k2.reshape(M, -1), lin[:, (Hq + Hk) * D :]], dim=1)
    if dtype == torch.bfloat16:
        assert torch.equal(y, two_kernels) and torch.equal(kc, kc2) and torch.equal(vc, vc2)
    else:  # fp32: the norm's sum of squares in another order
        assert_close(y, two_kernels, 1e-5, 1e-5, "qkv epilogue")
        assert_close(kc, kc2, 1e-5, 1e-5, "k cache")
    assert kc.view(-1, Hk, D)[slots[slots >= 0]].abs().sum() > 0
    assert kc.view(-1, Hk, D).abs().sum(dim=(1, 2)).count_nonzero() == M - 1  # the padding row left no trace
    ref = ops.qkv_proj_norm_rope_store_kv(x, w, pos, qw, kw, 1e-6, cs, kc3, vc3, slots, Hq, Hk)
    tol = (0.2, 0.05) if dtype == torch.bfloat16 else (1e-4, 1e-4)
    assert_close(y, ref, *tol, "qkv epilogue vs reference")
    assert_close(kc, kc3, *tol, "k cache vs reference")


def test_qkv_projection_takes_the_reference_where_a_tile_cannot_hold_whole_heads(gen):
    """At the default 256-column tiles a model with 128 q columns cannot keep each tile to one kind of head: the op
    takes the projection and the two-step reference, and says nothing else (same values, same cache)."""
    Hq, Hk, D, K, M = 4, 2, 32, 64, 8
    x = torch.randn(M, K, generator=gen).to(torch.bfloat16)
    w = (torch.randn((Hq + 2 * Hk) * D, K, generator=gen) * 0.2).to(torch.bfloat16)
    pos, cs = torch.arange(M), ops.rope_cos_sin_cache(D, 64, 1e6)
    qw = kw = torch.ones(D, dtype=torch.bfloat16)
    slots = torch.arange(M)
    kc, vc, kc2, vc2 = (torch.zeros(4, 16, Hk, D, dtype=torch.bfloat16) for _ in range(4))
    y = gemm.qkv_proj_norm_rope_store_kv(x, w, pos, qw, kw, 1e-6, cs, kc, vc, slots, Hq, Hk)
    ref = ops.qkv_proj_norm_rope_store_kv(x, w, pos, qw, kw, 1e-6, cs, kc2, vc2, slots, Hq, Hk)
    assert torch.equal(y, ref) and torch.equal(kc, kc2) and torch.equal(vc, vc2)


@pytest.mark.parametrize(
    "grid, expect",
    [  # (block_n, block_k, programs) of qkv, o_proj, gate/up, down at Qwen3-0.6B's shapes on 132 SMs
        ((16, 1.8, 16384), [(16, 1024, 256), (4, 2048, 256), (16, 1024, 384), (4, 4096, 256)]),
        ((32, 1.8, 16384), [(16, 1024, 256), (4, 2048, 256), (16, 1024, 384), (4, 4096, 256)]),  # the same grids
        ((32, 0.9, 16384), [(32, 512, 128), (8, 2048, 128), (32, 512, 192), (8, 2048, 128)]),  # bigger tiles
        ((16, 3.6, 16384), [(8, 1024, 512), (2, 2048, 512), (8, 1024, 768), (2, 4096, 512)]),
        ((16, 1.8, 8192), [(16, 512, 256), (4, 2048, 256), (16, 512, 384), (4, 2048, 256)]),  # two K steps
    ],
)
def test_gemv_m1_grid_knob(grid, expect, monkeypatch):
    """The batch-1 GEMV's grid knob (``M1_GRID``: rows at most, programs an SM, weights a tile at most) gives the
    tiles the knob A/B compares, and a raised row cap alone changes nothing."""
    monkeypatch.setattr(gemv, "num_sms", lambda device: 132)
    monkeypatch.setattr(gemv, "M1_GRID", grid)
    got = []
    for N, K in ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)):
        cfg = gemv.default_config(1, N, K, 16, torch.device("cpu"))
        assert cfg.split_k == 1 and cfg.block_n * cfg.block_k <= grid[2]
        got.append((cfg.block_n, cfg.block_k, -(-N // cfg.block_n)))
    assert got == expect


@pytest.mark.parametrize("steps", [1, 2])
@pytest.mark.parametrize("K", [64, 128, 160])  # one, two and three K steps of 64
def test_gemv_pdl_program_order_gives_the_loops_bits(steps, K, monkeypatch, gen):
    """The PDL program order (the first one or two K steps' weights loaded before x is read, ``PDL_PREFETCH_STEPS``)
    sums the same products in the same order as the plain loop: the same bits, plain, with the RMSNorm and with the
    SwiGLU in front. The CPU runs that order without PDL itself (``GemvConfig(pdl=True)``; the GPU adds the wait)."""
    monkeypatch.setattr(gemv, "PDL_PREFETCH_STEPS", steps)
    early, plain = GemvConfig(8, 64, 1, pdl=True), GemvConfig(8, 64, 1)
    x = torch.randn(1, K, generator=gen).to(torch.bfloat16)
    w = (torch.randn(24, K, generator=gen) / K**0.5).to(torch.bfloat16)
    res, nw = torch.randn(K, generator=gen).to(torch.bfloat16), (1 + 0.1 * torch.randn(K, generator=gen)).to(x.dtype)
    for kind in ("plain", "norm", "glu"):
        outs = []
        for cfg in (early, plain):
            out = poisoned((1, 24), torch.bfloat16, "cpu")
            if kind == "norm":
                r_out = poisoned((1, K), torch.bfloat16, "cpu")
                gemv.gemv(x, w, None, 16, out, cfg, norm=(res, nw, r_out, 1e-6))
            elif kind == "glu":
                gemv.gemv(torch.cat([x, 2 * x], dim=1), w, None, 16, out, cfg, glu=True)
            else:
                gemv.gemv(x, w, None, 16, out, cfg)
            outs.append(out)
        torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0, msg=kind)
