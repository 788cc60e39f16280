"""RoPE on Q and K together; for Qwen3 fused with the per-head QK-norm and the paged KV-cache write.

Formula (NeoX / HF ``rotate_half`` convention: pairs are ``(i, i + D/2)``)
    ``out[:D/2] = x1·cos − x2·sin`` and ``out[D/2:] = x2·cos + x1·sin`` with ``cos, sin`` read from the
    ``(max_position, D)`` fp32 table at each token's position (``[:, :D/2]`` cos, ``[:, D/2:]`` sin).
    Shapes: ``positions: (T,)``, ``q: (T, Hq, D)``, ``k, v: (T, Hk, D)``. Three public entry points share one
    kernel through compile-time switches:
    - ``rotary_embedding`` (reference ``ops.rotary_embedding``);
    - ``qk_norm_rope`` — Qwen3's RMSNorm over D of every q and k head, then RoPE (reference
      ``ops.qk_norm_rope``);
    - ``qk_norm_rope_store_kv`` — the same plus writing the rotated k and the untouched v into the paged
      caches at ``slot_mapping`` (reference: ``ops.qk_norm_rope`` followed by ``ops.store_kv``).

Program mapping
    One program per token. It loads the token's cos/sin row once and applies it to all ``Hq + Hk`` heads,
    held as ``[H_PAD, D/2]`` tiles of the two halves (that is where "Q and K together" pays: the position
    lookup, the table row and the launch are shared). The norm is a per-head reduction along axis 1 of both
    halves. q/k/v may be strided views into the fused QKV projection output (any token and head stride, unit
    stride along D), so no ``.contiguous()`` copy is needed in the model.

Coalescing
    A head's two halves are two contiguous runs of ``D/2`` elements; consecutive heads are adjacent in the
    fused layout, so a program's loads cover its token's whole q (then k) row. The cache write lands each
    ``(Hk, D)`` token row contiguously at its slot (layout ``(num_blocks, block_size, Hk, D)``).

Precision (HF's order, reproduced)
    Norm: fp32 sum of squares over D, ``rsqrt`` in fp32, normalised value rounded to the activation dtype,
    multiplied by the weight and rounded again (as ``ops.rms_norm``). RoPE: cos/sin are rounded to the
    activation dtype first (HF casts the table), then every product and the sum are rounded to the activation
    dtype as the eager reference does op by op, so bf16 results match bit for bit. That needs
    ``enable_fp_fusion=False``. With fusion on (Triton's default), 21 % of the rotated bf16 values differed
    from the reference on the H200 (max error 0.06), with it off they are bit-identical (max error 0): the
    backend may contract a product with the following add/sub into one FMA, skipping the product's rounding
    even though the source rounds it (bf16 products of bf16 values are exact in fp32, so the round trip is
    provably a native bf16 multiply, which can then fuse). The CPU interpreter never fuses, so only the GPU
    test could show it.

Trade-offs tried
    Fusing the norm saves a full read+write of q and k; fusing the cache write saves re-reading k and v. The
    fused kernel still returns the rotated k (``k_out``) because prefill attention may read it directly; a
    caller that only needs the cache can pass ``k_out`` as a scratch buffer. A per-(token, head) grid was the
    first version: 24 tiny programs per token each re-reading the table row and position; per-token programs
    move the same bytes with a 24× smaller grid.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ._common import next_pow2, require, use_pdl
from .kv_cache import INT8_DTYPE, _v_rows, check_cache, check_layout, row_scales_8bit, to_8bit

__all__ = ["qk_norm_rope", "qk_norm_rope_store_kv", "rotary_embedding"]


@triton.jit
def _norm_rope_heads(
    x_ptr,
    stride_h,
    n_heads,
    w_ptr,
    cos,
    sin,
    eps,
    H_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    NORM: tl.constexpr,
):
    """Load ``n_heads`` heads of one token, optionally RMS-normalise each over D, rotate; return both halves."""
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, HALF_PAD)
    mask = (h < n_heads)[:, None] & (d < HALF)[None, :]
    ptrs = x_ptr + h[:, None] * stride_h + d[None, :]
    x1 = tl.load(ptrs, mask=mask, other=0.0)
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0)
    act_ty = x_ptr.dtype.element_ty
    if NORM:
        x1f = x1.to(tl.float32)
        x2f = x2.to(tl.float32)
        var = (tl.sum(x1f * x1f, axis=1) + tl.sum(x2f * x2f, axis=1)) / (2 * HALF)
        rstd = tl.math.rsqrt(var + eps)[:, None]
        w1 = tl.load(w_ptr + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
        x1 = ((x1f * rstd).to(act_ty).to(tl.float32) * w1).to(act_ty)
        x2 = ((x2f * rstd).to(act_ty).to(tl.float32) * w2).to(act_ty)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    # each product and the sum rounded to the activation dtype, as the eager reference computes them
    o1 = ((x1f * cos).to(act_ty).to(tl.float32) - (x2f * sin).to(act_ty).to(tl.float32)).to(act_ty)
    o2 = ((x2f * cos).to(act_ty).to(tl.float32) + (x1f * sin).to(act_ty).to(tl.float32)).to(act_ty)
    return o1, o2, mask


@triton.jit
def _store_8bit_halves(x1, x2, cache, half, scales, mask, h_mask, INT8: tl.constexpr):
    """Quantize one token's heads held as two halves with one scale per head (the larger half's amax), as e4m3
    or int8; ``cache`` points at the first halves' values, ``half`` elements before the second halves'."""
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    a1 = tl.max(tl.where(mask, tl.abs(x1f), 0.0), axis=1)
    a2 = tl.max(tl.where(mask, tl.abs(x2f), 0.0), axis=1)
    inv, scale = row_scales_8bit(tl.maximum(a1, a2), INT8)
    tl.store(cache, to_8bit(x1f, inv, INT8), mask=mask)
    tl.store(cache + half, to_8bit(x2f, inv, INT8), mask=mask)
    tl.store(scales, scale, mask=h_mask)


@triton.jit
def _qk_rope_kernel(
    pos_ptr,
    cs_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    qw_ptr,
    kw_ptr,
    q_out_ptr,
    k_out_ptr,
    v_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    eps,
    block_size,
    n_q_heads,
    n_kv_heads,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_vot,
    stride_voh,
    stride_cb,
    stride_co,
    stride_ch,
    stride_vcb,
    stride_vch,
    stride_sb,
    stride_so,
    stride_sh,
    stride_cs,
    HQ_PAD: tl.constexpr,
    HK_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    NORM: tl.constexpr,
    STORE: tl.constexpr,
    FP8: tl.constexpr,
    V_OUT: tl.constexpr = False,
    PDL: tl.constexpr = False,
    INT8: tl.constexpr = False,
    V_T: tl.constexpr = False,
):
    if PDL:  # see _common.use_pdl
        gdc_launch_dependents()
        gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, HALF_PAD)
    act_ty = q_ptr.dtype.element_ty
    cos = tl.load(cs_ptr + pos * stride_cs + d, mask=d < HALF, other=0.0).to(act_ty).to(tl.float32)[None, :]
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + d, mask=d < HALF, other=0.0).to(act_ty).to(tl.float32)[None, :]

    q1, q2, qmask = _norm_rope_heads(
        q_ptr + t * stride_qt, stride_qh, n_q_heads, qw_ptr, cos, sin, eps, HQ_PAD, HALF, HALF_PAD, NORM
    )
    hq = tl.arange(0, HQ_PAD)
    qo = q_out_ptr + t * stride_qot + hq[:, None] * stride_qoh + d[None, :]
    tl.store(qo, q1, mask=qmask)
    tl.store(qo + HALF, q2, mask=qmask)

    k1, k2, kmask = _norm_rope_heads(
        k_ptr + t * stride_kt, stride_kh, n_kv_heads, kw_ptr, cos, sin, eps, HK_PAD, HALF, HALF_PAD, NORM
    )
    hk = tl.arange(0, HK_PAD)
    ko = k_out_ptr + t * stride_kot + hk[:, None] * stride_koh + d[None, :]
    tl.store(ko, k1, mask=kmask)
    tl.store(ko + HALF, k2, mask=kmask)

    if V_OUT or STORE:  # v's two halves, loaded once for both uses
        vp = v_ptr + t * stride_vt + hk[:, None] * stride_vh + d[None, :]
        v1 = tl.load(vp, mask=kmask, other=0.0)
        v2 = tl.load(vp + HALF, mask=kmask, other=0.0)
    if V_OUT:  # a dense copy of v for the prefill attention (every row, padding included)
        vo = v_out_ptr + t * stride_vot + hk[:, None] * stride_voh + d[None, :]
        tl.store(vo, v1, mask=kmask)
        tl.store(vo + HALF, v2, mask=kmask)
    if STORE:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            row = (slot // block_size) * stride_cb + (slot % block_size) * stride_co
            kc = k_cache_ptr + row + hk[:, None] * stride_ch + d[None, :]
            vc = v_cache_ptr + _v_rows(slot, block_size, stride_cb, stride_co, stride_ch, stride_vcb, stride_vch, hk, d,
                                       V_T)  # fmt: skip
            v_half = HALF
            if V_T:  # V transposed within its block: the dimensions lie block_size apart
                v_half = HALF * block_size
            if FP8:
                # one scale per (token, head) over both halves: the row's amax is the larger half's
                srow = (slot // block_size) * stride_sb + (slot % block_size) * stride_so + hk * stride_sh
                h_mask = hk < n_kv_heads
                _store_8bit_halves(k1, k2, kc, HALF, k_scale_ptr + srow, kmask, h_mask, INT8)
                _store_8bit_halves(v1, v2, vc, v_half, v_scale_ptr + srow, kmask, h_mask, INT8)
            else:
                tl.store(kc, k1, mask=kmask)
                tl.store(kc + HALF, k2, mask=kmask)
                tl.store(vc, v1, mask=kmask)
                tl.store(vc + v_half, v2, mask=kmask)


def _check_heads(name: str, t: torch.Tensor, T: int, D: int) -> None:
    require(t.dim() == 3 and t.shape[0] == T and t.shape[2] == D, f"{name} must be (T, H, {D})")
    require(t.stride(2) == 1, f"{name} needs a unit stride along head_dim")


def _launch(
    positions,
    q,
    k,
    v,
    q_w,
    k_w,
    eps,
    cos_sin_cache,
    k_cache,
    v_cache,
    slot_mapping,
    q_out,
    k_out,
    k_scales,
    v_scales,
    v_out=None,
):
    T, Hq, D = q.shape
    Hk = k.shape[1]
    require(D % 2 == 0, "head_dim must be even")
    _check_heads("q", q, T, D)
    _check_heads("k", k, T, D)
    require(k.dtype == q.dtype, "q and k must share a dtype")
    require(positions.shape == (T,), "positions must be (T,)")
    require(cos_sin_cache.shape[-1] == D and cos_sin_cache.stride(-1) == 1, "cos_sin_cache must be (P, head_dim)")
    norm = q_w is not None
    if norm:
        require(q_w.shape == (D,) and k_w.shape == (D,), "norm weights must be (head_dim,)")
        require(q_w.dtype == q.dtype and k_w.dtype == q.dtype, "norm weights must share q's dtype")
    if q_out is None:
        q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if k_out is None:
        k_out = torch.empty_like(k, memory_format=torch.contiguous_format)
    _check_heads("q_out", q_out, T, D)
    _check_heads("k_out", k_out, T, D)
    store = k_cache is not None
    if store or v_out is not None:
        _check_heads("v", v, T, D)
    if v_out is not None:
        _check_heads("v_out", v_out, T, D)
        require(v_out.shape == v.shape and v_out.dtype == v.dtype, "v_out must be like v")
    if store:
        require(k_cache.shape == v_cache.shape and k_cache.shape[2:] == (Hk, D), "caches must be (N, bs, Hk, D)")
        v_t = check_layout(k_cache, v_cache)
        require(slot_mapping.shape == (T,), "slot_mapping must be (T,)")
        scales = check_cache(k_cache, v_cache, q.dtype, k_scales, v_scales)
        cache_strides = (*k_cache.stride()[:3], v_cache.stride(0), v_cache.stride(2))
        block_size = k_cache.shape[1]
    else:
        v, k_cache, v_cache, slot_mapping = k, k, k, positions  # unused (STORE=False)
        cache_strides, block_size, scales, v_t = (0, 0, 0, 0, 0), 1, None, False
    k_scales, v_scales = scales if scales is not None else (k, k)  # unused when FP8=False
    scale_strides = k_scales.stride() if scales is not None else (0, 0, 0)
    if T == 0:
        return q_out, k_out
    half = D // 2
    pdl = use_pdl(q)
    _qk_rope_kernel[(T,)](
        positions,
        cos_sin_cache,
        q,
        k,
        v,
        q_w if norm else q,
        k_w if norm else k,
        q_out,
        k_out,
        v_out if v_out is not None else k_out,
        k_cache,
        v_cache,
        slot_mapping,
        k_scales,
        v_scales,
        eps,
        block_size,
        Hq,
        Hk,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        *(v_out.stride()[:2] if v_out is not None else (0, 0)),
        *cache_strides,
        *scale_strides,
        cos_sin_cache.stride(0),
        HQ_PAD=next_pow2(Hq),
        HK_PAD=next_pow2(Hk),
        HALF=half,
        HALF_PAD=next_pow2(half),
        NORM=norm,
        STORE=store,
        FP8=scales is not None,
        INT8=scales is not None and k_cache.dtype == INT8_DTYPE,
        V_OUT=v_out is not None,
        PDL=pdl,
        V_T=v_t,
        num_warps=4,
        enable_fp_fusion=False,  # keep every bf16 rounding of the reference (see Precision)
        launch_pdl=pdl,
    )
    return q_out, k_out


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    q_out: torch.Tensor | None = None,
    k_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on ``q: (T, Hq, D)`` and ``k: (T, Hk, D)`` at ``positions: (T,)``; returns ``(q_rot, k_rot)``.

    ``q_out=q, k_out=k`` rotates in place (each element is read before it is written by the same program).
    """
    return _launch(positions, q, k, None, None, None, 0.0, cos_sin_cache, None, None, None, q_out, k_out, None, None)


def qk_norm_rope(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    cos_sin_cache: torch.Tensor,
    *,
    q_out: torch.Tensor | None = None,
    k_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3: per-head RMSNorm of q and k over D, then RoPE, in one pass."""
    return _launch(
        positions,
        q,
        k,
        None,
        q_norm_weight,
        k_norm_weight,
        eps,
        cos_sin_cache,
        None,
        None,
        None,
        q_out,
        k_out,
        None,
        None,
    )


def qk_norm_rope_store_kv(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    q_out: torch.Tensor | None = None,
    k_out: torch.Tensor | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    v_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``qk_norm_rope`` and then ``store_kv(k_rot, v, k_cache, v_cache, slot_mapping)``, in one pass.

    Slots < 0 are skipped (padding tokens). An FP8 cache gets each (token, head) row quantized as
    ``kv_cache.store_kv`` does, its scale in ``k_scales`` / ``v_scales``. ``v_out`` (optional, ``(T, Hk, D)``):
    also a dense copy of v, every row (the prefill attention's input: v itself is a strided view into the fused
    QKV projection, which cuDNN's attention does not take). Returns ``(q_rot, k_rot)``.
    """
    return _launch(
        positions,
        q,
        k,
        v,
        q_norm_weight,
        k_norm_weight,
        eps,
        cos_sin_cache,
        k_cache,
        v_cache,
        slot_mapping,
        q_out,
        k_out,
        k_scales,
        v_scales,
        v_out,
    )
