"""Paged KV-cache write: scatter each token's K and V rows to its slot.

Formula
    ``k_cache.view(-1, Hk, D)[slot_mapping[t]] = k[t]`` (same for v) for every token t with
    ``slot_mapping[t] ≥ 0``; slot ``s`` is block ``s // block_size``, offset ``s % block_size``. Shapes:
    ``k, v: (T, Hk, D)`` (strided views into the fused QKV output are fine), caches
    ``(num_blocks, block_size, Hk, D)``. Reference ``kernellab.runtime.ops.store_kv``.

Program mapping
    One program per token copies its ``[Hk, D]`` K tile and V tile; a negative slot exits before any store.
    Qwen3 attention fuses this write into ``rope.qk_norm_rope_store_kv``; this standalone kernel serves models
    without QK-norm and is the chapter's simplest scatter.

Coalescing
    Source rows are contiguous along D; the destination ``(Hk, D)`` token row is contiguous in the cache, so
    both sides are whole-line accesses. Bytes: read ``2·T·Hk·D``, write the same.

Precision
    A bf16/fp32 cache: a copy, bit exact (the cache dtype must equal the activation dtype). An FP8 cache
    (``float8_e4m3fn``, with ``k_scales, v_scales: (num_blocks, block_size, Hk)`` fp32): each (token, head)
    row is stored as ``fp8(x · (448 / amax))`` and its scale ``amax / 448``, both quotients correctly rounded
    (``div_rn``) and the conversion round-to-nearest-even, so the bits equal ``ops.quantize_kv``'s. Each value
    keeps 3 mantissa bits (relative error ≤ 2⁻⁴) against a per-row scale, so one outlier costs only its own
    row's precision; the scale adds 4 bytes per row (3 % of a 128-value row), half the cache bytes remain. An
    int8 cache (``torch.int8``) likewise with 127 for 448, the products rounded to nearest even: uniform steps
    of amax / 127 instead of 3 significant bits, the same bytes.

V stored transposed within its blocks (the int8 cache's layout)
    ``v_cache`` may be the ``(num_blocks, block_size, Hk, D)`` view of a ``(num_blocks, Hk, D, block_size)``
    tensor: a block's tokens lie next to each other for every (head, dimension), so the decode attention loads V
    as the ``P·V`` dot's operand with the tokens (the dot's reduction) contiguous, which an 8-bit tensor-core
    dot needs (``paged_attention.py``). The writes here take V's strides as they are: a token's V row then
    lands as D bytes ``block_size`` apart (a scatter, still one launch; the cache write is a small part of a
    step). ``v_transposed`` tells the layouts apart.

Scales head-major within a block (the int8 cache's layout)
    ``k_scales, v_scales`` may likewise be the ``(num_blocks, block_size, Hk)`` view of a ``(num_blocks, Hk,
    block_size)`` tensor (``ops.scale_zeros``, ``scales_head_major``): a decode tile of one head then reads its
    block's scales as one run of ``block_size`` floats instead of one 4-byte value every ``Hk`` floats (one
    32-byte sector each). Every kernel takes the scales' three strides, so both layouts run everywhere with the
    same bits; on an H100 the int8 engine gained 2.2 % offline from it (docs/gpu-engine.md).

Trade-offs tried
    Copying through ``index_copy_``/advanced indexing in PyTorch launches a nonzero/gather for the mask and
    two scatters; one kernel does all of it without host syncs (``slots[valid]`` in the reference syncs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ._common import next_pow2, require, use_pdl

__all__ = [
    "FP8_DTYPE",
    "INT8_DTYPE",
    "QUANTIZED",
    "check_cache",
    "quantize_rows",
    "row_scales_8bit",
    "store_kv",
    "to_8bit",
    "to_fp8",
    "v_transposed",
]

FP8_DTYPE = torch.float8_e4m3fn
INT8_DTYPE = torch.int8
QUANTIZED = (FP8_DTYPE, INT8_DTYPE)  # the 8-bit caches: one fp32 scale per (token, KV head) row
# 1.5 · 2^23: (y + _RNE) - _RNE rounds |y| < 2^22 to the nearest integer, ties to even (a constexpr: a kernel may
# read no other global)
_RNE = tl.constexpr(12582912.0)


@triton.jit
def row_scales(amax, TOP: tl.constexpr):
    """Per-row ``(inv, scale)`` from the rows' absolute max: values are stored as ``q(x · inv)``, read as
    ``q · scale``; ``inv = TOP / amax`` and ``scale = amax / TOP``, both correctly rounded (amax ≥ 1e-12)."""
    amax = tl.maximum(amax, 1e-12)
    top = tl.full(amax.shape, TOP, tl.float32)
    return tl.math.div_rn(top, amax), tl.math.div_rn(amax, top)


@triton.jit
def row_scales_8bit(amax, INT8: tl.constexpr):
    """``row_scales`` for the 8-bit cache: int8 (127) or e4m3 (448)."""
    if INT8:
        return row_scales(amax, 127.0)
    else:
        return row_scales(amax, 448.0)


@triton.jit
def to_fp8(x, inv):
    """``fp8(x · inv)`` per row of ``x: [R, C]`` fp32, clamped to the finite e4m3 range, nearest-even."""
    return tl.minimum(tl.maximum(x * inv[:, None], -448.0), 448.0).to(tl.float8e4nv)


@triton.jit
def to_8bit(x, inv, INT8: tl.constexpr):
    """``x · inv`` per row of ``x: [R, C]`` fp32 as e4m3, or as int8 (rounded to nearest even, clamped to ±127:
    the add and subtract of 1.5 · 2^23 round exactly, so the kernel must be compiled without FMA contraction, which
    would fuse the multiply into the add)."""
    if INT8:
        y = x * inv[:, None]
        y = (y + _RNE) - _RNE
        return tl.minimum(tl.maximum(y, -127.0), 127.0).to(tl.int8)
    else:
        return to_fp8(x, inv)


@triton.jit
def quantize_rows(x, mask, INT8: tl.constexpr = False):
    """``x: [R, C]`` fp32 → ``(8-bit values [R, C], scales [R])`` over the lanes in ``mask`` (reference
    ``ops.quantize_kv``)."""
    inv, scale = row_scales_8bit(tl.max(tl.where(mask, tl.abs(x), 0.0), axis=1), INT8)
    return to_8bit(x, inv, INT8), scale


@triton.jit
def _v_rows(slot, block_size, stride_cb, stride_co, stride_ch, stride_vcb, stride_vch, h, d, V_T: tl.constexpr):
    """Offsets ``[H, D]`` of one token's V rows for heads ``h`` at ``slot``: K's layout, or V transposed within
    its block (``V_T``: strides ``stride_vcb, stride_vch``, then ``block_size`` per dimension, 1 per token)."""
    if V_T:
        return (slot // block_size) * stride_vcb + h[:, None] * stride_vch + d[None, :] * block_size + slot % block_size
    else:
        return (slot // block_size) * stride_cb + (slot % block_size) * stride_co + h[:, None] * stride_ch + d[None, :]


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_size,
    n_kv_heads,
    head_dim,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_co,
    stride_ch,
    stride_vcb,
    stride_vch,
    stride_sb,
    stride_so,
    stride_sh,
    H_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    FP8: tl.constexpr,
    INT8: tl.constexpr = False,
    PDL: tl.constexpr = False,
    V_T: tl.constexpr = False,
):
    if PDL:  # see _common.use_pdl
        gdc_launch_dependents()
        gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        h = tl.arange(0, H_PAD)
        d = tl.arange(0, D_PAD)
        h_mask = h < n_kv_heads
        mask = h_mask[:, None] & (d < head_dim)[None, :]
        row = (slot // block_size) * stride_cb + (slot % block_size) * stride_co
        dst = row + h[:, None] * stride_ch + d[None, :]
        v_dst = _v_rows(slot, block_size, stride_cb, stride_co, stride_ch, stride_vcb, stride_vch, h, d, V_T)
        k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask, other=0.0)
        v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask, other=0.0)
        if FP8:
            k8, ks = quantize_rows(k.to(tl.float32), mask, INT8)
            v8, vs = quantize_rows(v.to(tl.float32), mask, INT8)
            srow = (slot // block_size) * stride_sb + (slot % block_size) * stride_so + h * stride_sh
            tl.store(k_cache_ptr + dst, k8, mask=mask)
            tl.store(v_cache_ptr + v_dst, v8, mask=mask)
            tl.store(k_scale_ptr + srow, ks, mask=h_mask)
            tl.store(v_scale_ptr + srow, vs, mask=h_mask)
        else:
            tl.store(k_cache_ptr + dst, k, mask=mask)
            tl.store(v_cache_ptr + v_dst, v, mask=mask)


def v_transposed(v_cache: torch.Tensor) -> bool:
    """Whether ``v_cache`` (``(num_blocks, block_size, Hk, D)``) is the view of a dense ``(num_blocks, Hk, D,
    block_size)`` tensor: V transposed within its blocks (see the module docstring)."""
    _, bs, hk, d = v_cache.shape
    return bs > 1 and v_cache.stride() == (bs * hk * d, 1, d * bs, bs)


def check_layout(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Both caches ``(num_blocks, block_size, Hk, D)`` with a unit stride along D for K, and V laid out like K or
    transposed within its blocks; returns whether V is transposed."""
    require(k_cache.dim() == 4 and v_cache.shape == k_cache.shape, "caches must be (N, bs, Hk, D)")
    require(k_cache.stride(3) == 1, "caches need a unit stride along head_dim")
    transposed = v_transposed(v_cache)
    require(transposed or v_cache.stride() == k_cache.stride(), "caches must share a dense layout (or V transposed)")
    return transposed


def check_cache(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    dtype: torch.dtype,
    k_scales: torch.Tensor | None,
    v_scales: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Validate the caches' dtype (the activations' ``dtype``, or 8-bit: FP8 or int8) and an 8-bit cache's
    scale tensors (``(num_blocks, block_size, Hk)`` fp32, dense or head-major within each block: see
    ``scales_head_major``); returns the scales, or None for a cache in the activation dtype, which takes none."""
    require(k_cache.dtype == v_cache.dtype, "k and v caches must share a dtype")
    require(k_cache.dtype in (dtype, *QUANTIZED), "cache dtype must match the activations (or be FP8 or int8)")
    if k_cache.dtype not in QUANTIZED:
        require(k_scales is None and v_scales is None, "only an FP8 or int8 cache takes scales")
        return None
    require(k_scales is not None and v_scales is not None, "an FP8 or int8 cache needs k_scales and v_scales")
    assert k_scales is not None and v_scales is not None
    shape = tuple(k_cache.shape[:3])
    for s in (k_scales, v_scales):
        require(tuple(s.shape) == shape and s.dtype == torch.float32, "scales must be (N, bs, Hk) float32")
        require(s.stride() == k_scales.stride(), "k and v scales must share a layout")
        require(s.stride(2) == 1 or scales_head_major(s), "scales must be dense or head-major within each block")
    return k_scales, v_scales


def scales_head_major(scales: torch.Tensor) -> bool:
    """Whether ``scales`` (``(num_blocks, block_size, Hk)``) is the view of a dense ``(num_blocks, Hk,
    block_size)`` tensor: one KV head's scales of a block in one run of ``block_size`` floats, so a decode tile of
    one head reads them as whole lines rather than one 4-byte value per 32-byte sector (the int8 cache's layout,
    ``ops.scale_zeros``)."""
    _, bs, hk = scales.shape
    return bs > 1 and scales.stride() == (bs * hk, 1, bs)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> None:
    """Write ``k, v: (T, Hk, D)`` into the paged caches at ``slot_mapping: (T,)``; slots < 0 are skipped.

    An 8-bit cache (FP8 or int8) quantizes each (token, head) row and writes its scale to ``k_scales`` /
    ``v_scales``."""
    T, Hk, D = k.shape
    require(v.shape == k.shape, "k and v must have the same shape")
    require(k.stride(2) == 1 and v.stride(2) == 1, "k and v need a unit stride along head_dim")
    require(k_cache.shape == v_cache.shape and k_cache.shape[2:] == (Hk, D), "caches must be (N, bs, Hk, D)")
    v_t = check_layout(k_cache, v_cache)
    require(k.dtype == v.dtype, "k and v must share a dtype")
    require(slot_mapping.shape == (T,), "slot_mapping must be (T,)")
    scales = check_cache(k_cache, v_cache, k.dtype, k_scales, v_scales)
    if T == 0:
        return
    ks, vs = scales if scales is not None else (k_cache, v_cache)  # unused when FP8=False
    pdl = use_pdl(k)
    _store_kv_kernel[(T,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        ks,
        vs,
        k_cache.shape[1],
        Hk,
        D,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        *k_cache.stride()[:3],
        v_cache.stride(0),
        v_cache.stride(2),
        *(ks.stride() if scales is not None else (0, 0, 0)),
        H_PAD=next_pow2(Hk),
        D_PAD=next_pow2(D),
        FP8=scales is not None,
        INT8=k_cache.dtype == INT8_DTYPE,
        PDL=pdl,
        V_T=v_t,
        num_warps=4,
        launch_pdl=pdl,
        enable_fp_fusion=k_cache.dtype != INT8_DTYPE,  # int8's rounding (to_8bit)
    )
