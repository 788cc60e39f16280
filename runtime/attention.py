"""Attention over the paged KV cache, driven by an explicit per-step metadata object (no global context)."""

from __future__ import annotations

import functools
import inspect
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from kernellab.runtime import ops as reference
from kernellab.runtime.request.block_manager import slot_of


class LayerKV(NamedTuple):
    """One layer's paged KV cache: ``k, v: (num_blocks, block_size, Hk, D)`` in the model's dtype, or in
    ``float8_e4m3fn`` or ``int8`` with ``k_scales, v_scales: (num_blocks, block_size, Hk)`` fp32 (one scale per
    token and KV head; ``runtime/ops.py`` ``quantize_kv``)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scales: torch.Tensor | None = None
    v_scales: torch.Tensor | None = None


@dataclass
class ContextGather:
    """Where the chunks that continue a cached context read it from: ``slots`` lists every context token's cache
    slot, chunk after chunk (positions ``0 .. context_len - 1`` of each); ``cu_q`` / ``cu_k`` (device int32, and
    host lists) delimit each chunk's queries and keys in the packed layout."""

    slots: torch.Tensor  # (Σ context_len,) int64
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    cu_q_host: list[int]
    cu_k_host: list[int]

    @classmethod
    def build(
        cls, tables: list[list[int]], context_lens: list[int], query_lens: list[int], block_size: int, device
    ) -> ContextGather:
        slots = np.concatenate(
            [slot_of(np.asarray(t), np.arange(n), block_size) for t, n in zip(tables, context_lens, strict=True)]
        )
        cu_q, cu_k = [0, *itertools.accumulate(query_lens)], [0, *itertools.accumulate(context_lens)]

        def dev(x):
            return torch.tensor(x, dtype=torch.int32, device=device)

        return cls(torch.from_numpy(slots).to(device), dev(cu_q), dev(cu_k), cu_q, cu_k)


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
    # the continuing chunks' contexts as one gather (then one packed attention call) instead of a gather and an
    # attention call per chunk with host syncs (``ops.paged_prefill_attention``, the reference)
    prefill_gather: ContextGather | None = None


@functools.cache
def flash_varlen() -> Callable[..., Any] | None:
    """FlashAttention's packed variable-length entry (``torch.nn.attention.varlen.varlen_attn``, CUDA builds of
    PyTorch ≥ 2.10), causal with each chunk's queries at the end of its keys and fewer KV than query heads
    allowed; None where this PyTorch lacks it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    kw: dict = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "enable_gqa" in params:  # builds without the flag take fewer KV heads as they are
        kw["enable_gqa"] = True
    return functools.partial(varlen_attn, **kw)


# Where the Triton prefill attention (op ``varlen_causal_attention``) runs when the op is enabled: inside the
# whole-step CUDA graphs only (a lone prompt's prefill graph, the several-fresh-prompt graphs), where its launch is
# captured once. A step whose attention runs eagerly between the piecewise graphs keeps cuDNN / FlashAttention:
# there the kernel's Python launch (three tensor descriptors and a Triton launch a layer) cost more than it saved
# (the gate's mixed steps at ce2e67b: 64 decode rows + 2 x 512 prompts 16.3 ms against 10.3). True: everywhere.
PREFILL_TRITON_EAGER = False


def triton_prefill(ops, graphed: bool) -> bool:
    """Whether a step's fresh prompts attend through the Triton prefill attention: its op enabled, and the
    attention captured in the step's graph (``graphed``: ``CausalLM.graphed_attention``) or allowed eagerly."""
    return "varlen_causal_attention" in ops.enabled and (graphed or PREFILL_TRITON_EAGER)


def flash_for(q: torch.Tensor) -> Callable[..., Any] | None:
    """``flash_varlen()`` where it can take ``q``: a GPU tensor in fp16 or bf16 (FlashAttention's dtypes)."""
    return flash_varlen() if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) else None


def packed_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    cu_q_host: list[int],
    cu_k_host: list[int],
    scale: float,
) -> torch.Tensor:
    """Causal attention of packed chunks, each chunk's queries at the end of its keys: one FlashAttention varlen
    call on a GPU (on the H200, 8 prompts × 512 tokens: 66 µs against 138 µs padded into one SDPA batch;
    results/gpu/prefill_attention_h200.json), a loop over the chunks elsewhere."""
    flash = flash_for(q)
    if flash is not None:
        max_q = max(b - a for a, b in itertools.pairwise(cu_q_host))
        max_k = max(b - a for a, b in itertools.pairwise(cu_k_host))
        return flash(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale)
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    if not q.is_cuda:  # the bounds themselves (no sync here): a graph's host lists are only its buckets'
        cu_q_host, cu_k_host = cu_q.tolist(), cu_k.tolist()
    for (qs, qe), (ks, ke) in zip(itertools.pairwise(cu_q_host), itertools.pairwise(cu_k_host), strict=True):
        if qe > qs:  # zero-length chunks pad a graph's offsets
            out[qs:qe] = reference.causal_attention(q[qs:qe], k[ks:ke], v[ks:ke], scale, group)
    return out


def gather_context(
    cache: torch.Tensor, slots: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """The cache rows at ``slots`` → ``(len(slots), Hk, D)`` in ``dtype`` (an 8-bit cache dequantized)."""
    return reference.read_slots(cache, slots, scales).to(dtype)


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
    graphed: bool = False,
) -> torch.Tensor:
    """``q: (T, Hq, D)`` → ``(T, Hq, D)``; the step's K/V (``k, v``) must already be stored in the caches.

    Fresh prompts attend their own (unquantized) ``k, v``; decode rows and continuing chunks read the cache,
    FP8 included (``k_scales``, ``v_scales``). ``graphed``: this call is part of a whole-step CUDA graph (its
    capture and the warm-ups before it), where the Triton prefill attention runs (``triton_prefill``)."""
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
    if f:  # fresh prompts: attention over the step's own K/V
        fresh = (q[nd : nd + r], k[nd : nd + r], v[nd : nd + r])
        tri = triton_prefill(ops, graphed)
        if f > 1 and tri and meta.prefill_cu_seqlens_q is not None:
            # the Triton op reads the device offsets (a graph's host list is only its bucket's): one launch
            parts.append(
                ops.varlen_causal_attention(*fresh, cu[: f + 1], scale, cu_device=meta.prefill_cu_seqlens_q[: f + 1])
            )
        elif f > 1 and flash_for(q) is not None and meta.prefill_cu_seqlens_q is not None:
            cu_t = meta.prefill_cu_seqlens_q[: f + 1]
            parts.append(packed_causal_attention(*fresh, cu_t, cu_t, cu[: f + 1], cu[: f + 1], scale))
        else:  # one prompt (the Triton kernel, or SDPA: cuDNN or FlashAttention), or the CPU's padded batch
            attend = ops.varlen_causal_attention if tri else reference.varlen_causal_attention
            parts.append(attend(*fresh, cu[: f + 1], scale))
    if f < len(cu) - 1:  # chunks that continue a cached context (chunked prefill, prefix hits): from the cache
        g = meta.prefill_gather
        if g is not None:
            kc, vc = (gather_context(c, g.slots, sc, q.dtype) for c, sc in ((k_cache, k_scales), (v_cache, v_scales)))
            parts.append(packed_causal_attention(q[nd + r :], kc, vc, g.cu_q, g.cu_k, g.cu_q_host, g.cu_k_host, scale))
        else:
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


@torch.inference_mode()
def warm_decode_launches(
    ops, kv: LayerKV, width: int, max_rows: int, num_heads: int, scale: float, dtype: torch.dtype
) -> int:
    """Run the decode attention once for each row count a step can hand it outside a graph, so that its kernel's
    launch specializations compile at startup instead of on a serving step.

    A step that mixes decode rows with prompts attends the decode rows eagerly (``paged_attention``), its block
    tables as wide as the graphs' (``width`` blocks), so a launch differs between steps only by the row count:
    that sets the KV split and the merge's width, which Triton compiles as constants. The graphs of 1-16 rows
    capture the fused QK-norm + RoPE form instead, so the plain form with those splits is compiled by nothing at
    startup, and a fresh worker's first mixed step of such a row count stalled ~1 s on the H200 (docs/deploy.md).
    One-token contexts on the cache's block 0 (read, never written); the outputs are discarded. Returns the calls
    made (0 where the decode attention is the torch reference, which compiles nothing)."""
    if "paged_decode_attention" not in ops.enabled:
        return 0
    device = kv.k.device
    head_dim = kv.k.shape[-1]
    tables = torch.zeros((max_rows, width), dtype=torch.int32, device=device)
    lens = torch.ones(max_rows, dtype=torch.int32, device=device)
    q = torch.zeros((max_rows, num_heads, head_dim), dtype=dtype, device=device)
    for rows in range(1, max_rows + 1):
        ops.paged_decode_attention(
            q[:rows], kv.k, kv.v, tables[:rows], lens[:rows], scale, k_scales=kv.k_scales, v_scales=kv.v_scales
        )
    return max_rows


def fresh_prompt_counts(max_prompts: int) -> list[int]:
    """Prompt counts that cover every compile of the packed prefill attention for steps of 2 to ``max_prompts``
    fresh prompts: the kernel is compiled per power-of-two bound of the offsets it loads (``S_PAD``, 16 at least)
    and per whether the count divides by 16 (Triton specializes integer arguments on it), so for each bound the
    smallest count it serves and its largest multiple of 16."""
    counts: list[int] = []
    bound = 16
    while True:
        low = 2 if bound == 16 else bound // 2 + 1
        if low > max_prompts:
            return counts
        counts.append(low)
        top = min(bound, max_prompts) // 16 * 16
        if top >= low and top != low:
            counts.append(top)
        bound *= 2


@torch.inference_mode()
def warm_prefill_launches(
    ops, num_heads: int, num_kv_heads: int, head_dim: int, max_prompts: int, scale: float, dtype, device
) -> int:
    """Run the Triton prefill attention (``varlen_causal_attention``, when enabled outside graphs:
    ``PREFILL_TRITON_EAGER``) once for each launch form a step's fresh prompts can give it outside a graph, so its
    compiles happen at startup, not on a serving step.

    A step's fresh prompts reach it eagerly between the piecewise graphs: one prompt as the single-prompt kernel
    (compiled per whether its length divides by 16), several as one launch of the packed kernel (per offsets bound
    and count class, ``fresh_prompt_counts``). The fresh-prompt graphs compile only their buckets' forms, the
    eight-prompt warm-up of a benchmark only its own; at 407f0fb an H100's first offline step met 2.8 s of these
    compiles. The tensors are laid out as the model's step hands them: q and k dense from the QK-norm + RoPE
    kernel, v the strided view of the QKV projection's row. Returns the calls made (0 when the op is off)."""
    if not triton_prefill(ops, graphed=False):  # only a graph's captures run it (they warm up their own forms)
        return 0
    width = (num_heads + 2 * num_kv_heads) * head_dim

    def launch(lens: list[int]) -> None:
        t = sum(lens)
        qkv = torch.zeros((t, width), dtype=dtype, device=device)
        v = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(t, num_kv_heads, head_dim)
        q = torch.zeros((t, num_heads, head_dim), dtype=dtype, device=device)
        k = torch.zeros((t, num_kv_heads, head_dim), dtype=dtype, device=device)
        cu = [0, *itertools.accumulate(lens)]
        cu_device = torch.tensor(cu, dtype=torch.int32, device=device) if len(lens) > 1 else None
        ops.varlen_causal_attention(q, k, v, cu, scale, cu_device=cu_device)

    # one prompt, its length a multiple of 16 or not; then several prompts of 2 tokens, each count class
    forms = [[16], [17], *([2] * count for count in fresh_prompt_counts(max_prompts))]
    for lens in forms:
        launch(lens)
    return len(forms)
