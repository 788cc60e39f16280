"""Attention over the paged KV cache, driven by an explicit per-step metadata object (no global context)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


class LayerKV(NamedTuple):
    """One layer's paged KV cache: ``k, v: (num_blocks, block_size, Hk, D)`` in the model's dtype, or in
    ``float8_e4m3fn`` with ``k_scales, v_scales: (num_blocks, block_size, Hk)`` fp32 (one scale per token and
    KV head; ``runtime/ops.py`` ``quantize_kv``)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scales: torch.Tensor | None = None
    v_scales: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """Where each token of a step sits. Decode rows (one query token) come first, then prefill chunks.

    ``slot_mapping[t]`` is the cache slot token t's K/V is written to; ``decode_*`` describe the first
    ``num_decode_tokens`` rows; ``prefill_cu_seqlens_q`` indexes the prefill rows relative to their start, and
    ``prefill_context_lens`` counts cached + new tokens for each prefill sequence.
    """

    positions: torch.Tensor  # (T,) int64
    slot_mapping: torch.Tensor  # (T,) int64
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None  # (Bd, max_blocks) int32
    decode_context_lens: torch.Tensor | None  # (Bd,) int32
    prefill_block_tables: torch.Tensor | None  # (Bp, max_blocks) int32
    prefill_cu_seqlens_q: torch.Tensor | None  # (Bp + 1,) int32
    prefill_context_lens: torch.Tensor | None  # (Bp,) int32
    logits_indices: torch.Tensor  # rows whose next-token logits are needed
    max_decode_context: int = 0
    # Host copies so the prefill path can slice without a device sync. ``prefill_num_fresh``: the first this
    # many prefill chunks have no cached context before them (fresh prompts, ordered before the chunks that
    # continue one), so their attention uses the step's own K/V instead of gathering from the cache.
    prefill_cu_seqlens_host: list[int] | None = None
    prefill_num_fresh: int = 0


def paged_attention(
    ops,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q: (T, Hq, D)`` → ``(T, Hq, D)``; the step's K/V (``k, v``) must already be stored in the caches.

    Fresh prompts attend their own (unquantized) ``k, v``; decode rows and continuing chunks read the cache,
    FP8 included (``k_scales``, ``v_scales``)."""
    nd = meta.num_decode_tokens
    scales = {"k_scales": k_scales, "v_scales": v_scales}
    if nd == q.shape[0]:
        return ops.paged_decode_attention(
            q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale, **scales
        )
    cu = meta.prefill_cu_seqlens_host
    assert cu is not None  # a step with prefill rows has them
    f, r = meta.prefill_num_fresh, cu[meta.prefill_num_fresh]  # fresh chunks and their rows
    parts = []
    if f:  # fresh prompts: one padded SDPA over the step's own K/V
        parts.append(ops.varlen_causal_attention(q[nd : nd + r], k[nd : nd + r], v[nd : nd + r], cu[: f + 1], scale))
    if f < len(cu) - 1:  # chunks that continue a cached context (chunked prefill, prefix hits): from the cache
        assert meta.prefill_block_tables is not None and meta.prefill_cu_seqlens_q is not None
        assert meta.prefill_context_lens is not None
        parts.append(
            ops.paged_prefill_attention(
                q[nd + r :],
                k_cache,
                v_cache,
                meta.prefill_block_tables[f:],
                meta.prefill_cu_seqlens_q[f:] - r,
                meta.prefill_context_lens[f:],
                scale,
                **scales,
            )
        )
    prefill = parts[0] if len(parts) == 1 else torch.cat(parts)
    if nd == 0:
        return prefill
    decode = ops.paged_decode_attention(
        q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale, **scales
    )
    return torch.cat([decode, prefill])
