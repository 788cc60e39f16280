"""The FP8 (e4m3) KV cache: quantization on every write path and the paged decode attention reading it.

The Triton writes must store the bits ``ops.quantize_kv`` computes (kernellab.kernels.testing makes the
interpreter round to nearest even as the GPU does); the decode attention must match the reference attention
over ``fp8 · scale``.
"""

from __future__ import annotations

import pytest
import torch

from kernellab.kernels import compile_check, paged_attention
from kernellab.kernels.kv_cache import scales_head_major, store_kv, v_transposed
from kernellab.kernels.paged_attention import heads_per_program, paged_decode_attention
from kernellab.kernels.rope import qk_norm_rope_store_kv
from kernellab.runtime import ops
from tests.support.kernels import assert_close, poisoned
from tests.unit.kernels.test_attention import _paged_case

FP8 = torch.float8_e4m3fn
NAN8 = 0x7F  # an e4m3fn NaN: what an unwritten FP8 slot holds in these tests


INT8 = torch.int8
CACHES = [FP8, INT8]  # the 8-bit caches: the same scales and layout, e4m3 or int8 values


def _fp8_caches(num_blocks, block_size, Hk, D, dtype=FP8):
    caches = [torch.full((num_blocks, block_size, Hk, D), NAN8, dtype=torch.uint8).view(dtype) for _ in range(2)]
    scales = [poisoned((num_blocks, block_size, Hk), torch.float32, "cpu") for _ in range(2)]
    return caches, scales


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def test_quantize_kv_error_is_bounded_per_row(gen):
    x = torch.randn(64, 4, 128, generator=gen) * torch.logspace(-3, 3, 64)[:, None, None]
    x[3, 1] = 0.0  # an all-zero row stays zero with a finite scale
    x[5, 2, 7] = 1e4  # an outlier costs only its own row's precision
    q, s = ops.quantize_kv(x)
    assert q.dtype == FP8 and s.shape == (64, 4) and torch.isfinite(s).all()
    back = ops.dequantize_kv(q, s)
    assert torch.equal(back[3, 1], torch.zeros(128))
    # e4m3: 3 mantissa bits (half an ulp = 2^-4 relative) for normals; subnormals step by 2^-9 of the scale unit
    bound = torch.maximum(x.abs() * 2**-4, s[..., None] * 2**-10) * (1 + 1e-6)
    assert ((back - x).abs() <= bound).all()
    assert (back[5, 1] - x[5, 1]).abs().max() <= x[5, 1].abs().max() * 2**-4


def test_quantize_kv_int8_error_is_half_a_step_per_row(gen):
    x = torch.randn(64, 4, 128, generator=gen) * torch.logspace(-3, 3, 64)[:, None, None]
    x[3, 1] = 0.0
    x[7, 0, :4] = torch.tensor([0.5, 1.5, -2.5, 127.0]) * (x[7, 0].abs().max() / 127)  # ties, after the scale
    q, s = ops.quantize_kv(x, INT8)
    assert q.dtype == INT8 and s.shape == (64, 4) and q.abs().max() <= 127
    back = ops.dequantize_kv(q, s)
    assert torch.equal(back[3, 1], torch.zeros(128))
    assert ((back - x).abs() <= s[..., None] * (0.5 + 1e-5)).all()  # uniform steps of amax / 127


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size, Hk, D", [(16, 2, 32), (32, 1, 64), (3, 3, 24)])
def test_store_kv_fp8_stores_the_reference_bits(block_size, Hk, D, dtype, cache, gen):
    T, num_blocks = 7, 5
    k = (torch.randn(T, Hk, D, generator=gen) * 4).to(dtype)
    v = torch.randn(T, Hk, D, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:T]
    slots[3] = -1
    (kc, vc), (ks, vs) = _fp8_caches(num_blocks, block_size, Hk, D, cache)
    (kr, vr), (ksr, vsr) = _fp8_caches(num_blocks, block_size, Hk, D, cache)
    store_kv(k, v, kc, vc, slots.to(torch.int32), k_scales=ks, v_scales=vs)
    ops.store_kv(k, v, kr, vr, slots, k_scales=ksr, v_scales=vsr)
    assert torch.equal(_bits(kc), _bits(kr)) and torch.equal(_bits(vc), _bits(vr))
    assert torch.equal(ks.nan_to_num(7.0), ksr.nan_to_num(7.0)) and torch.equal(vs.nan_to_num(7.0), vsr.nan_to_num(7.0))
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    assert not torch.isnan(ks.view(-1, Hk)[written]).any()
    assert torch.isnan(ks.view(-1, Hk)[~written]).all()  # padding slots (-1) write nothing


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_rope_store_kv_fp8(dtype, cache, gen):
    """The fused Qwen3 prologue stores exactly ``quantize_kv`` of the k it rotated and of v; its rotated q/k
    are the bf16 path's (checked against the reference in test_rope)."""
    T, Hq, Hk, D, num_blocks, block_size = 9, 4, 2, 64, 4, 16
    qkv = (torch.randn(T, (Hq + 2 * Hk) * D, generator=gen) * 2).to(dtype)
    q, k, v = (t.view(T, -1, D) for t in qkv.split([Hq * D, Hk * D, Hk * D], -1))
    pos = torch.randint(0, 64, (T,), generator=gen)
    cos_sin = ops.rope_cos_sin_cache(D, 64, 1e6)
    qw = (1 + 0.2 * torch.randn(D, generator=gen)).to(dtype)
    kw = (1 + 0.2 * torch.randn(D, generator=gen)).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:T]
    slots[2] = -1
    (kc, vc), (ks, vs) = _fp8_caches(num_blocks, block_size, Hk, D, cache)
    qr, kr = qk_norm_rope_store_kv(pos, q, k, v, qw, kw, 1e-6, cos_sin, kc, vc, slots, k_scales=ks, v_scales=vs)
    valid = slots >= 0
    for values, scales, x in ((kc, ks, kr), (vc, vs, v)):
        want_q, want_s = ops.quantize_kv(x[valid], cache)
        assert torch.equal(_bits(values.view(-1, Hk, D)[slots[valid]]), _bits(want_q))
        assert torch.equal(scales.view(-1, Hk)[slots[valid]], want_s)
    q_ref, k_ref = ops.qk_norm_rope(pos, q, k, qw, kw, 1e-6, cos_sin)
    tol = 1e-5 if dtype == torch.float32 else 3.2e-2
    assert_close(kr, k_ref, tol, tol, "k")
    assert_close(qr, q_ref, tol, tol, "q")


# The kernel rounds the scaled probabilities to the dots' dtype for the P·V dot (bf16, or fp16 when the tiles
# widen to fp16: three more mantissa bits, and q rounded to fp16 too); the reference attends in fp32 over the
# dequantized cache.
FP8_ATTN = [
    (torch.float32, "bf16", 1e-5, 1e-5),
    (torch.bfloat16, "bf16", 2e-2, 2e-2),
    (torch.bfloat16, "f16", 8e-3, 8e-3),
]


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("dtype, widen, atol, rtol", FP8_ATTN)
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.parametrize("Hq, Hk, D", [(4, 2, 32), (9, 3, 64)])
def test_paged_decode_attention_fp8(Hq, Hk, D, block_size, splits, dtype, widen, atol, rtol, cache, gen):
    lens = [1, 17, 50]
    q, kc, vc, tables, ctx = _paged_case(lens, Hq, Hk, D, block_size, torch.float32, gen)
    k8, ks = ops.quantize_kv(kc * 3, cache)
    v8, vs = ops.quantize_kv(vc, cache)
    ks[torch.isnan(kc).all(-1)] = float("nan")  # unused slots stay poisoned: reading one poisons the output
    vs[torch.isnan(vc).all(-1)] = float("nan")
    q = q.to(dtype)
    out = poisoned(q.shape, dtype, "cpu")
    y = paged_decode_attention(
        q, k8, v8, tables, ctx, D**-0.5, out=out, splits=splits, block_n=16, k_scales=ks, v_scales=vs, fp8_widen=widen
    )
    ref = _reference(q, kc, vc, tables, ctx, cache)
    assert not torch.isnan(ref).any()
    assert_close(y, ref, atol, rtol, "fp8 paged decode")


def _reference(q, kc, vc, tables, ctx, cache):
    """The reference attention over the same 8-bit rows, with the poisoned slots zeroed: it reads whole blocks and
    masks afterwards, so a NaN past a context would make every row of that sequence NaN (and unchecked)."""
    k8, ks = ops.quantize_kv(kc.nan_to_num(0.0) * 3, cache)  # one scale per row: the same bits where written
    v8, vs = ops.quantize_kv(vc.nan_to_num(0.0), cache)
    return ops.paged_decode_attention(q, k8, v8, tables, ctx, q.shape[-1] ** -0.5, k_scales=ks, v_scales=vs)


def test_fp8_widening_to_fp16_keeps_small_probabilities(gen):
    """P·V's fp16 operand is p·vs·2^9: with vs = amax / 448 a long context's small probabilities would otherwise
    fall below fp16's normal range. Many nearly equal scores over a small-valued V: the f16 form must stay as
    close to the reference as the bf16 form."""
    Hq, Hk, D, bs = 2, 1, 32, 16
    lens = [1000]
    q, kc, vc, tables, ctx = _paged_case(lens, Hq, Hk, D, bs, torch.float32, gen)
    k8, ks = ops.quantize_kv(kc * 0.01)  # flat scores: p ≈ 1e-3 each
    v8, vs = ops.quantize_kv(vc * 1e-3)  # vs ≈ 1e-5: p·vs ≈ 1e-8, subnormal in fp16 without the 2^9
    ks[torch.isnan(kc).all(-1)] = float("nan")
    vs[torch.isnan(vc).all(-1)] = float("nan")
    q = q.to(torch.bfloat16)
    ref = ops.paged_decode_attention(q, k8, v8, tables, ctx, D**-0.5, k_scales=ks, v_scales=vs).float()
    errs = {}
    for widen in ("bf16", "f16"):
        y = paged_decode_attention(
            q, k8, v8, tables, ctx, D**-0.5, block_n=16, k_scales=ks, v_scales=vs, fp8_widen=widen
        )
        errs[widen] = float((y.float() - ref).norm() / ref.norm())
    assert errs["f16"] <= errs["bf16"], errs


def test_fp8_cache_scales_are_checked():
    q = torch.randn(1, 2, 16)
    k8 = torch.zeros(2, 4, 1, 16, dtype=FP8)
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="needs k_scales"):
        paged_decode_attention(q, k8, k8, tables, lens, 0.25)
    with pytest.raises(ValueError, match="only an FP8 or int8 cache takes scales"):
        kc = torch.zeros(2, 4, 1, 16)
        paged_decode_attention(q, kc, kc, tables, lens, 0.25, k_scales=torch.zeros(2, 4, 1), v_scales=None)
    with pytest.raises(ValueError, match="scales must be"):
        bad = torch.zeros(2, 4, 1, dtype=torch.float16)
        store_kv(
            torch.randn(1, 1, 16),
            torch.randn(1, 1, 16),
            k8,
            k8.clone(),
            torch.zeros(1, dtype=torch.int64),
            k_scales=bad,
            v_scales=bad,
        )


# ---------------------------------------------------------------- the int8 cache's V, transposed within its blocks
def _transposed(cache: torch.Tensor) -> torch.Tensor:
    """The same (N, bs, Hk, D) values laid out as the engine lays out the int8 cache's V (ops.v_cache_zeros)."""
    out = ops.v_cache_zeros(cache.shape, cache.dtype, cache.device).view(torch.uint8).copy_(cache.view(torch.uint8))
    out = out.view(cache.dtype)
    assert v_transposed(out) and torch.equal(_bits(out), _bits(cache))
    return out


def test_the_engine_allocates_the_int8_v_cache_transposed():
    assert v_transposed(ops.v_cache_zeros((3, 16, 2, 32), INT8, "cpu"))
    for dtype in (FP8, torch.bfloat16):
        assert not v_transposed(ops.v_cache_zeros((3, 16, 2, 32), dtype, "cpu"))


@pytest.mark.parametrize("block_size, Hk, D", [(16, 2, 32), (3, 3, 24)])
def test_store_kv_writes_a_transposed_v_like_the_reference(block_size, Hk, D, gen):
    T, num_blocks = 9, 5
    k = (torch.randn(T, Hk, D, generator=gen) * 4).to(torch.bfloat16)
    v = torch.randn(T, Hk, D, generator=gen).to(torch.bfloat16)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:T]
    slots[3] = -1
    (kc, vc), (ks, vs) = _fp8_caches(num_blocks, block_size, Hk, D, INT8)
    vc = _transposed(vc)
    (kr, vr), (ksr, vsr) = _fp8_caches(num_blocks, block_size, Hk, D, INT8)
    store_kv(k, v, kc, vc, slots.to(torch.int32), k_scales=ks, v_scales=vs)
    ops.store_kv(k, v, kr, vr, slots, k_scales=ksr, v_scales=vsr)  # the dense layout, as before
    assert v_transposed(vc) and torch.equal(_bits(kc), _bits(kr)) and torch.equal(_bits(vc), _bits(vr))
    assert torch.equal(vs.nan_to_num(7.0), vsr.nan_to_num(7.0))
    vt = _transposed(_fp8_caches(num_blocks, block_size, Hk, D, INT8)[0][1])
    vts = poisoned((num_blocks, block_size, Hk), torch.float32, "cpu")
    ops.store_kv(k, v, kr.clone(), vt, slots, k_scales=ksr.clone(), v_scales=vts)  # the reference, transposed
    assert torch.equal(_bits(vt), _bits(vr))


def _rope_writes(gen, block_size: int, layouts) -> dict:
    """``qk_norm_rope_store_kv`` of one draw (the 3rd token's slot -1) into int8 caches of each layout of
    ``layouts`` (``(V transposed, scales head-major)`` pairs): per layout the K and V bits and both scales."""
    T, Hq, Hk, D, num_blocks = 9, 4, 2, 64, 4
    qkv = (torch.randn(T, (Hq + 2 * Hk) * D, generator=gen) * 2).to(torch.bfloat16)
    pos = torch.randint(0, 64, (T,), generator=gen)
    cos_sin = ops.rope_cos_sin_cache(D, 64, 1e6)
    qw = (1 + 0.2 * torch.randn(D, generator=gen)).to(torch.bfloat16)
    kw = (1 + 0.2 * torch.randn(D, generator=gen)).to(torch.bfloat16)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:T]
    slots[2] = -1
    out = {}
    for v_t, head_major in layouts:
        q, k, v = (t.view(T, -1, D) for t in qkv.clone().split([Hq * D, Hk * D, Hk * D], -1))
        (kc, vc), (ks, vs) = _fp8_caches(num_blocks, block_size, Hk, D, INT8)
        vc = _transposed(vc) if v_t else vc
        if head_major:
            ks, vs = _head_major(ks), _head_major(vs)
        qk_norm_rope_store_kv(pos, q, k, v, qw, kw, 1e-6, cos_sin, kc, vc, slots, k_scales=ks, v_scales=vs)
        out[(v_t, head_major)] = (_bits(kc), _bits(vc), ks.nan_to_num(7.0), vs.nan_to_num(7.0))
    return out


@pytest.mark.parametrize(
    "block_size, layouts",
    [(16, [(False, False), (True, False)]), (32, [(True, False), (True, True)])],
    ids=["transposed-v", "head-major-scales"],
)
def test_qk_norm_rope_store_kv_writes_every_int8_layout_alike(block_size, layouts, gen):
    """The fused QK-norm + RoPE write takes V's and the scales' strides: V transposed within its blocks, and the
    scales head-major, get the bits and values the dense layouts get."""
    out = _rope_writes(gen, block_size, layouts)
    for a, b in zip(out[layouts[0]], out[layouts[1]], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "block_size, mma, pack, select",
    [(16, True, 0, 0), (16, True, 8, 0), (16, True, 8, 1), (16, True, 8, 2), (16, False, 0, 0), (8, True, 8, 0),
     (8, True, 8, 2), (5, True, 8, 0)],
)  # fmt: skip
@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.parametrize("Hq, Hk, D", [(4, 2, 32), (9, 3, 64), (16, 8, 128)])
def test_paged_decode_attention_int8_transposed_v(Hq, Hk, D, block_size, mma, pack, select, splits, gen, monkeypatch):
    """With V transposed the int8 tiles go into int8 tensor-core dots as stored (q and the probabilities in 16-bit
    fixed point): closer to the reference than the fp16 widening of the dense layout, one KV head a program or
    several (``i8_pack_heads``: 2, 3 and 8 heads of groups of 2, 3 and 2 here; with ``i8_pack_select`` each head's
    rows picked from dots of every row). A block size that does not divide the tile (5) or ``i8_mma=False`` reads
    the transposed V the slow way, with the same result."""
    lens = [1, 17, 50, 200]
    q, kc, vc, tables, ctx = _paged_case(lens, Hq, Hk, D, block_size, torch.float32, gen)
    k8, ks = ops.quantize_kv(kc * 3, INT8)
    v8, vs = ops.quantize_kv(vc, INT8)
    ks[torch.isnan(kc).all(-1)] = float("nan")  # unused slots stay poisoned: weighing one poisons the output
    vs[torch.isnan(vc).all(-1)] = float("nan")
    q = q.to(torch.bfloat16)
    ref = _reference(q, kc, vc, tables, ctx, INT8)
    assert not torch.isnan(ref).any()
    kw = {"k_scales": ks, "v_scales": vs, "splits": splits, "block_n": 16}
    monkeypatch.setitem(paged_attention.INT8_LAUNCH, "pack_min_rows", 0)  # these four rows packed too
    monkeypatch.setitem(paged_attention.INT8_LAUNCH, "pack_launch", {})  # at the test's tiles
    with compile_check.record_launches() as seen:
        y = paged_decode_attention(
            q, k8, _transposed(v8), tables, ctx, D**-0.5, i8_mma=mma, i8_pack_heads=pack, i8_pack_select=select, **kw
        )
    packed = pack > 1 and mma and block_size in (8, 16)
    assert {x["kernel"] for x in seen} == {"_paged_decode_i8_heads_kernel" if packed else "_paged_decode_kernel"}
    assert_close(y, ref, 8e-3, 8e-3, "int8 paged decode, V transposed")
    dense = paged_decode_attention(q, k8, v8, tables, ctx, D**-0.5, fp8_widen="f16", **kw)
    err = float((y.float() - ref.float()).norm() / ref.float().norm())
    dense_err = float((dense.float() - ref.float()).norm() / ref.float().norm())
    # one draw in the 72 here (head_dim 32) comes out 1.09x the widening's error: either form's error moves with the
    # draw by about that much at small head_dims
    assert err <= dense_err * 1.1, (err, dense_err)


def _int8_case(Hq, Hk, D, block_size, gen):
    """Contexts of 1, 17, 50 and 200 tokens in an int8 cache as the engine lays out its V (transposed), the scales
    dense, the unused slots' values and scales poisoned; q in bf16. Returns the fp32 caches too (the reference's)."""
    q, kc, vc, tables, ctx = _paged_case([1, 17, 50, 200], Hq, Hk, D, block_size, torch.float32, gen)
    k8, ks = ops.quantize_kv(kc * 3, INT8)
    v8, vs = ops.quantize_kv(vc, INT8)
    ks[torch.isnan(kc).all(-1)] = float("nan")
    vs[torch.isnan(vc).all(-1)] = float("nan")
    return q.to(torch.bfloat16), kc, vc, tables, ctx, k8, _transposed(v8), ks, vs


def test_heads_per_program():
    """The packed int8 form's heads a program: as many as fill 16 query rows, dividing the KV heads, capped."""
    assert heads_per_program(8, 2) == 8  # Qwen3-0.6B
    assert heads_per_program(8, 2, most=4) == 4
    assert heads_per_program(8, 4) == 4  # a Llama-3.2-1B shape
    assert heads_per_program(3, 3) == 3  # SmolLM2-135M: 9 of 16 rows
    assert heads_per_program(6, 2, most=4) == 3  # the cap, then the most that divide the heads
    assert heads_per_program(4, 16) == 1  # a group fills the rows alone
    assert heads_per_program(5, 2) == 5


def test_a_cache_of_larger_blocks_than_the_packed_tile_runs_the_one_head_form(gen, monkeypatch):
    """An engine may take larger KV blocks (``block_size`` 64): the packed form's 32-token tiles hold no whole block
    there, so its launches fall back to the one-head form (whose 64-token tiles do) instead of refusing the step."""
    Hq, Hk, D, bs = 4, 2, 32, 64
    monkeypatch.setitem(paged_attention.INT8_LAUNCH, "block_n", 64)
    monkeypatch.setitem(paged_attention.INT8_LAUNCH, "pack_heads", 8)
    monkeypatch.setitem(paged_attention.INT8_LAUNCH, "pack_min_rows", 0)
    monkeypatch.setitem(paged_attention.INT8_LAUNCH, "pack_launch", {"block_n": 32})
    monkeypatch.setitem(paged_attention.INT8_LAUNCH, "tma", False)  # the pointer forms (the default reads by TMA)
    q, kc, vc, tables, ctx = _paged_case([40, 150, 200], Hq, Hk, D, bs, torch.float32, gen)
    (k8, ks), (v8, vs) = ops.quantize_kv(kc.nan_to_num(0.0), INT8), ops.quantize_kv(vc.nan_to_num(0.0), INT8)
    q, vt = q.to(torch.bfloat16), _transposed(v8)
    with compile_check.record_launches() as seen:
        y = paged_decode_attention(q, k8, vt, tables, ctx, D**-0.5, k_scales=ks, v_scales=vs)
    assert {(x["kernel"], x["constexprs"]["BLOCK_N"]) for x in seen} == {("_paged_decode_kernel", 64)}
    monkeypatch.setitem(paged_attention.INT8_LAUNCH, "tma", True)
    with compile_check.record_launches() as seen:  # the default: one block a tile through descriptors, not packed
        y_tma = paged_decode_attention(q, k8, vt, tables, ctx, D**-0.5, k_scales=ks, v_scales=vs)
    ((launch,),) = [seen]
    assert launch["kernel"] == "_paged_decode_i8_tma_kernel" and launch["options"]["num_stages"] == 2
    assert torch.equal(y_tma, y)  # the same 64-token tiles through the same dots
    ref = ops.paged_decode_attention(q.float(), k8, v8, tables, ctx, D**-0.5, k_scales=ks, v_scales=vs)
    assert_close(y.float(), ref, 2e-2, 2e-2, "one head a program at 64-token blocks vs the reference")


def test_packed_int8_form_only_from_its_row_count(gen, monkeypatch):
    """``pack_min_rows`` keeps small launches on the one-head form; at the threshold the packed kernel runs with
    its own tile settings (``pack_launch``), and both agree with the one-head form."""
    Hq, Hk, D, bs = 4, 2, 32, 16
    monkeypatch.setitem(paged_attention.INT8_LAUNCH, "block_n", 64)
    monkeypatch.setitem(paged_attention.INT8_LAUNCH, "pack_heads", 8)
    monkeypatch.setitem(paged_attention.INT8_LAUNCH, "pack_min_rows", 3)
    monkeypatch.setitem(paged_attention.INT8_LAUNCH, "pack_launch", {"block_n": 32})
    for lens in ([40, 70], [40, 70, 100]):
        q, kc, vc, tables, ctx = _paged_case(lens, Hq, Hk, D, bs, torch.float32, gen)
        (k8, ks), (v8, vs) = ops.quantize_kv(kc.nan_to_num(0.0), INT8), ops.quantize_kv(vc.nan_to_num(0.0), INT8)
        q, vt = q.to(torch.bfloat16), _transposed(v8)
        with compile_check.record_launches() as seen:
            y = paged_decode_attention(q, k8, vt, tables, ctx, D**-0.5, k_scales=ks, v_scales=vs, splits=1)
        ((name, block_n),) = {(x["kernel"], x["constexprs"]["BLOCK_N"]) for x in seen}
        packed = len(lens) >= 3
        assert (name, block_n) == (("_paged_decode_i8_heads_kernel", 32) if packed else ("_paged_decode_kernel", 64))
        one = paged_decode_attention(q, k8, vt, tables, ctx, D**-0.5, k_scales=ks, v_scales=vs, i8_pack_heads=0)
        assert_close(y, one, 2e-3, 2e-3, "packed vs one head a program")
    # pack_splits: the packed launches' slices a sequence, fixed (as the caller's splits would fix them; here 3
    # slices of whole 32-token tiles of the 112-token bound make 2)
    sc = {"k_scales": ks, "v_scales": vs}
    with compile_check.record_launches() as auto:
        paged_decode_attention(q, k8, vt, tables, ctx, D**-0.5, **sc)
    monkeypatch.setitem(paged_attention.INT8_LAUNCH, "pack_splits", 3)
    with compile_check.record_launches() as fixed:
        y3 = paged_decode_attention(q, k8, vt, tables, ctx, D**-0.5, **sc)
    with compile_check.record_launches() as given:
        paged_decode_attention(q, k8, vt, tables, ctx, D**-0.5, splits=3, **sc)
    split = [{(x["constexprs"]["SPLIT"], x["constexprs"]["S_PAD"]) for x in s} for s in (auto, fixed, given)]
    assert split[1] == split[2] == {(True, 2)} != split[0], split
    assert_close(y3, one, 2e-3, 2e-3, "packed in slices vs one head a program")


@pytest.mark.parametrize("Hq, Hk, D", [(16, 8, 128), (9, 3, 64)])
def test_packed_select_equals_packed_masked(Hq, Hk, D, gen, monkeypatch):
    """Selecting each head's rows from dots of every row gives the int32 sums of masking the other rows' operands:
    the two packed forms' outputs are the same bits."""
    q, kc, vc, tables, ctx = _paged_case([1, 33, 90], Hq, Hk, D, 16, torch.float32, gen)
    (k8, ks), (v8, vs) = ops.quantize_kv(kc.nan_to_num(0.0), INT8), ops.quantize_kv(vc.nan_to_num(0.0), INT8)
    q, vt = q.to(torch.bfloat16), _transposed(v8)
    kw = {"k_scales": ks, "v_scales": vs, "block_n": 32, "i8_pack_heads": 8}
    monkeypatch.setitem(paged_attention.INT8_LAUNCH, "pack_min_rows", 0)
    masked = paged_decode_attention(q, k8, vt, tables, ctx, D**-0.5, i8_pack_select=0, **kw)
    for select in (1, 2):
        assert torch.equal(masked, paged_decode_attention(q, k8, vt, tables, ctx, D**-0.5, i8_pack_select=select, **kw))


def test_int8_dots_keep_long_flat_contexts_and_small_values(gen):
    """Many nearly equal scores over a small-valued V (p ≈ 1e-3, vs ≈ 1e-5): the probabilities' fixed point is
    per row of each tile, so none of them rounds away."""
    Hq, Hk, D, bs = 2, 1, 32, 16
    q, kc, vc, tables, ctx = _paged_case([1000], Hq, Hk, D, bs, torch.float32, gen)
    k8, ks = ops.quantize_kv(kc * 0.01, INT8)
    v8, vs = ops.quantize_kv(vc * 1e-3, INT8)
    ks[torch.isnan(kc).all(-1)] = float("nan")
    vs[torch.isnan(vc).all(-1)] = float("nan")
    q = q.to(torch.bfloat16)
    # in fp32 (q's bf16 values): the kernels' outputs are rounded to bf16 after
    ref = ops.paged_decode_attention(q.float(), k8, v8, tables, ctx, D**-0.5, k_scales=ks, v_scales=vs)
    assert not torch.isnan(ref).any()  # 1,000 tokens fill their blocks: no poisoned slot is read
    errs = {}
    for name, v_cache in (("int8 dots", _transposed(v8)), ("fp16 widening", v8)):
        y = paged_decode_attention(q, k8, v_cache, tables, ctx, D**-0.5, block_n=64, k_scales=ks, v_scales=vs)
        errs[name] = float((y.float() - ref).norm() / ref.norm())
    rounding = float((ref.bfloat16().float() - ref).norm() / ref.norm())  # the output's own bf16 rounding
    assert errs["int8 dots"] <= max(errs["fp16 widening"], rounding) * 1.05, (errs, rounding)


@pytest.mark.parametrize("block_size", [32, 64])
@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.parametrize("Hq, Hk, D", [(4, 2, 32), (9, 3, 64), (16, 8, 128)])
def test_int8_tiles_through_tensor_descriptors_equal_the_pointer_form(Hq, Hk, D, block_size, splits, gen):
    """``i8_tma``: a tile is one KV block, K and V copied by tensor descriptors (TMA on the GPU) instead of gathered
    through per-element pointers. The same tiles in the same order through the same int8 dots: the pointer form at
    one-block tiles gives the same bits, and both stay close to the reference. Unused slots of the last block hold
    poisoned scales and values (their scores masked, their scales read as 0)."""
    q, kc, vc, tables, ctx, k8, vt, ks, vs = _int8_case(Hq, Hk, D, block_size, gen)
    assert paged_attention.tma_ready(k8, vt, ks)
    kw = {"k_scales": ks, "v_scales": vs, "splits": splits, "i8_pack_heads": 0}
    with compile_check.record_launches() as seen:
        y = paged_decode_attention(q, k8, vt, tables, ctx, D**-0.5, i8_tma=True, **kw)
    assert {x["kernel"] for x in seen} == {"_paged_decode_i8_tma_kernel"}
    pointer = paged_decode_attention(q, k8, vt, tables, ctx, D**-0.5, i8_tma=False, block_n=block_size, **kw)
    assert torch.equal(y, pointer)
    assert_close(y, _reference(q, kc, vc, tables, ctx, INT8), 8e-3, 8e-3, "int8 paged decode through descriptors")


def test_the_descriptor_form_takes_only_what_tma_can_read(gen):
    """Blocks under 32 tokens (P·V's int8 dot reduces over a block), a dense V or an 8-bit cache of another kind
    keep the pointer forms; the flag then changes nothing."""
    q, kc, vc, tables, ctx = _paged_case([20, 40], 4, 2, 32, 16, torch.float32, gen)
    (k8, ks), (v8, vs) = ops.quantize_kv(kc.nan_to_num(0.0), INT8), ops.quantize_kv(vc.nan_to_num(0.0), INT8)
    assert not paged_attention.tma_ready(k8, _transposed(v8), ks)  # 16-token blocks
    assert not paged_attention.tma_ready(k8, v8, ks)  # V dense
    f8, f8s = ops.quantize_kv(kc.nan_to_num(0.0), FP8)
    assert not paged_attention.tma_ready(f8, f8, f8s)
    q = q.to(torch.bfloat16)
    with compile_check.record_launches() as seen:
        paged_decode_attention(q, k8, _transposed(v8), tables, ctx, 0.2, k_scales=ks, v_scales=vs, i8_tma=True)
    assert "_paged_decode_i8_tma_kernel" not in {x["kernel"] for x in seen}


# ---------------------------------------------------------------- the int8 cache's scales, head-major within a block
def _head_major(scales: torch.Tensor) -> torch.Tensor:
    """The same (N, bs, Hk) scales laid out as the engine lays out the int8 cache's (ops.scale_zeros)."""
    out = ops.scale_zeros(tuple(scales.shape), INT8, scales.device).copy_(scales)
    assert scales_head_major(out) and torch.equal(out.nan_to_num(7.0), scales.nan_to_num(7.0))
    return out


def test_the_engine_allocates_int8_scales_head_major():
    assert scales_head_major(ops.scale_zeros((3, 64, 8), INT8, "cpu"))
    assert scales_head_major(ops.scale_zeros((3, 64, 1), INT8, "cpu"))  # one KV head (MQA) too
    assert not scales_head_major(ops.scale_zeros((3, 64, 8), FP8, "cpu"))
    assert not scales_head_major(torch.zeros(3, 64, 8))


def test_scales_of_other_layouts_are_refused():
    k8 = torch.zeros(2, 4, 2, 16, dtype=INT8)
    args = (torch.randn(1, 2, 16), torch.randn(1, 2, 16), k8, k8.clone(), torch.zeros(1, dtype=torch.int64))
    dense, head_major = torch.zeros(2, 4, 2), ops.scale_zeros((2, 4, 2), INT8, "cpu")
    with pytest.raises(ValueError, match="share a layout"):
        store_kv(*args, k_scales=dense, v_scales=head_major)
    strided = torch.zeros(2, 4, 4)[:, :, ::2]  # neither dense nor head-major
    with pytest.raises(ValueError, match="dense or head-major"):
        store_kv(*args, k_scales=strided, v_scales=strided)


@pytest.mark.parametrize("block_size, Hk, D", [(16, 2, 32), (64, 8, 128), (3, 3, 24)])
def test_store_kv_writes_head_major_scales_like_dense_ones(block_size, Hk, D, gen):
    """The write kernels take the scales' three strides: head-major scales get the values the dense ones get, and
    the caches the same bits."""
    T, num_blocks = 9, 5
    k = (torch.randn(T, Hk, D, generator=gen) * 4).to(torch.bfloat16)
    v = torch.randn(T, Hk, D, generator=gen).to(torch.bfloat16)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:T]
    slots[3] = -1
    out = {}
    for layout in ("dense", "head-major"):
        (kc, vc), (ks, vs) = _fp8_caches(num_blocks, block_size, Hk, D, INT8)
        if layout == "head-major":
            ks, vs = _head_major(ks), _head_major(vs)
        store_kv(k, v, kc, _transposed(vc), slots.to(torch.int32), k_scales=ks, v_scales=vs)
        out[layout] = (_bits(kc), ks.nan_to_num(7.0), vs.nan_to_num(7.0))
    for a, b in zip(out["dense"], out["head-major"], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "block_size, form",
    [(16, {"i8_pack_heads": 0}), (16, {"i8_pack_heads": 8}), (64, {"i8_pack_heads": 0, "i8_tma": True}),
     (64, {"i8_pack_heads": 0, "i8_tma": False, "block_n": 64}), (16, {"i8_mma": False, "i8_pack_heads": 0})],
)  # fmt: skip
@pytest.mark.parametrize("Hq, Hk, D", [(4, 2, 32), (16, 8, 128)])
def test_every_int8_decode_form_reads_head_major_scales_alike(Hq, Hk, D, block_size, form, gen, monkeypatch):
    """The pointer form (int8 dots, or widened), the packed one and the descriptor one: the same output bits from
    head-major scales as from dense ones, poisoned unused slots included."""
    q, _, _, tables, ctx, k8, vt, ks, vs = _int8_case(Hq, Hk, D, block_size, gen)
    monkeypatch.setitem(paged_attention.INT8_LAUNCH, "pack_min_rows", 0)
    monkeypatch.setitem(paged_attention.INT8_LAUNCH, "pack_launch", {})
    kw = {"splits": 3, **form}
    y = paged_decode_attention(q, k8, vt, tables, ctx, D**-0.5, k_scales=ks, v_scales=vs, **kw)
    with compile_check.record_launches() as seen:
        hm = paged_decode_attention(
            q, k8, vt, tables, ctx, D**-0.5, k_scales=_head_major(ks), v_scales=_head_major(vs), **kw
        )
    assert len(seen) == 1
    assert torch.equal(y, hm), seen[0]["kernel"]


@pytest.mark.parametrize("block_size", [32, 64])
@pytest.mark.parametrize("splits", [None, 3])
@pytest.mark.parametrize("Hq, Hk, D", [(4, 2, 32), (9, 3, 64), (16, 8, 128), (32, 4, 64), (32, 2, 32)])
def test_stacked_halves_give_the_descriptor_forms_bits(Hq, Hk, D, block_size, splits, gen):
    """``i8_tma=2``: q's and P's 16-bit halves stacked as the rows of one int8 dot a product (groups of 2, 3 and 8
    here, 4 and 8 rows a half), the same integer sums as two dots, so the same output bits as ``i8_tma=1``; a group of
    16 keeps the two dots."""
    q, _, _, tables, ctx, k8, vt, ks, vs = _int8_case(Hq, Hk, D, block_size, gen)
    kw = {"k_scales": _head_major(ks), "v_scales": _head_major(vs), "splits": splits, "i8_pack_heads": 0}
    with compile_check.record_launches() as seen:
        stacked = paged_decode_attention(q, k8, vt, tables, ctx, D**-0.5, i8_tma=2, **kw)
    (launch,) = seen
    assert launch["kernel"] == "_paged_decode_i8_tma_kernel"
    assert launch["constexprs"]["STACK"] == (Hq // Hk <= 8)
    assert torch.equal(stacked, paged_decode_attention(q, k8, vt, tables, ctx, D**-0.5, i8_tma=1, **kw))


def _full_batch_case(form, gen):
    """The length-balance tests' batch: 8 sequences of mixed lengths × 4 KV heads (it fills the CPU's nominal 8
    SMs) in ``form``'s cache (bf16, int8 dots, int8 through descriptors): ``(q, caches, tables, ctx, kw, ref)``."""
    bs = 32 if form == "int8_tma" else 16
    lens = [1, 20, 64, 65, 130, 200, 300, 47]
    q, kc, vc, tables, ctx = _paged_case(lens, 8, 4, 64, bs, torch.float32, gen)
    q = q.to(torch.bfloat16)
    if form == "bf16":
        caches = (kc.to(torch.bfloat16), vc.to(torch.bfloat16))
        kw: dict = {}
        ref = ops.paged_decode_attention(q.float(), kc.nan_to_num(0.0), vc.nan_to_num(0.0), tables, ctx, 64**-0.5)
    else:
        k8, ks = ops.quantize_kv(kc * 3, INT8)
        v8, vs = ops.quantize_kv(vc, INT8)
        caches = (k8, _transposed(v8))
        kw = {"k_scales": _head_major(ks), "v_scales": _head_major(vs), "i8_pack_heads": 0}
        kw["i8_tma"] = form == "int8_tma"
        ref = _reference(q, kc, vc, tables, ctx, INT8)
    return q, caches, tables, ctx, kw, ref


@pytest.mark.parametrize("form", ["bf16", "int8", "int8_tma"])
def test_length_balance_cuts_only_long_contexts_of_a_full_batch(form, gen, monkeypatch):
    """A batch whose programs fill the card (here 8 sequences × 4 KV heads against the CPU's nominal 8 SMs) gets
    one slice a sequence; with ``BALANCE_SLICE_TOKENS`` its contexts longer than that are cut into up to
    ``BALANCE_MAX_SPLITS`` slices of at least that many tokens and merged, short ones stay whole: the same output
    bits as asking for those slices explicitly, close to the reference, for every form (bf16, int8 dots, int8
    through descriptors)."""
    q, caches, tables, ctx, kw, ref = _full_batch_case(form, gen)
    knob = "BALANCE_SLICE_TOKENS" if form == "bf16" else "BALANCE_SLICE_TOKENS_INT8"  # each cache's own knob
    monkeypatch.setattr(paged_attention, knob, 0)
    with compile_check.record_launches() as seen:
        whole = paged_decode_attention(q, *caches, tables, ctx, 64**-0.5, **kw)
    assert not seen[0]["constexprs"]["SPLIT"]  # the batch fills the card: one slice a sequence
    monkeypatch.setattr(paged_attention, knob, 64)
    monkeypatch.setattr(paged_attention, "BALANCE_MAX_SPLITS", 3)
    with compile_check.record_launches() as seen:
        balanced = paged_decode_attention(q, *caches, tables, ctx, 64**-0.5, **kw)
    assert seen[0]["constexprs"]["SPLIT"]
    explicit = paged_decode_attention(q, *caches, tables, ctx, 64**-0.5, splits=3, min_slice=64, **kw)
    assert torch.equal(balanced, explicit)
    for y in (whole, balanced):
        tol = 8e-3 if form != "bf16" else 2e-2
        assert_close(y.float(), ref.float(), tol, tol, form)


@pytest.mark.parametrize("form", ["bf16", "int8", "int8_tma"])
def test_by_default_only_the_int8_cache_balances_lengths(form, gen):
    """The defaults the offline A/Bs chose: a full batch whose longest context passes 512 tokens is cut into slices
    with the int8 cache (``BALANCE_SLICE_TOKENS_INT8``), kept one slice a sequence with the bf16 cache
    (``BALANCE_SLICE_TOKENS``); either way the output stays close to the reference."""
    q, caches, tables, ctx, kw, ref = _full_batch_case(form, gen)
    with compile_check.record_launches() as seen:  # a step bound (a graph's) past 512 tokens
        y = paged_decode_attention(q, *caches, tables, ctx, 64**-0.5, max_context_len=600, **kw)
    assert seen[0]["constexprs"]["SPLIT"] == (form != "bf16")
    tol = 8e-3 if form != "bf16" else 2e-2
    assert_close(y.float(), ref.float(), tol, tol, form)
