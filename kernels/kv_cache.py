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
    A copy: bit exact (the cache dtype must equal the activation dtype; no conversion happens here).

Trade-offs tried
    Copying through ``index_copy_``/advanced indexing in PyTorch launches a nonzero/gather for the mask and
    two scatters; one kernel does all of it without host syncs (``slots[valid]`` in the reference syncs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import next_pow2, require

__all__ = ["store_kv"]


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
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
    H_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        h = tl.arange(0, H_PAD)
        d = tl.arange(0, D_PAD)
        mask = (h < n_kv_heads)[:, None] & (d < head_dim)[None, :]
        row = (slot // block_size) * stride_cb + (slot % block_size) * stride_co
        dst = row + h[:, None] * stride_ch + d[None, :]
        k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
        v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
        tl.store(k_cache_ptr + dst, k, mask=mask)
        tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write ``k, v: (T, Hk, D)`` into the paged caches at ``slot_mapping: (T,)``; slots < 0 are skipped."""
    T, Hk, D = k.shape
    require(v.shape == k.shape, "k and v must have the same shape")
    require(k.stride(2) == 1 and v.stride(2) == 1, "k and v need a unit stride along head_dim")
    require(k_cache.shape == v_cache.shape and k_cache.shape[2:] == (Hk, D), "caches must be (N, bs, Hk, D)")
    require(k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1, "caches must share a dense layout")
    require(k_cache.dtype == k.dtype == v.dtype, "cache and k/v dtypes must match")
    require(slot_mapping.shape == (T,), "slot_mapping must be (T,)")
    if T == 0:
        return
    _store_kv_kernel[(T,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k_cache.shape[1],
        Hk,
        D,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        *k_cache.stride()[:3],
        H_PAD=next_pow2(Hk),
        D_PAD=next_pow2(D),
        num_warps=4,
    )
