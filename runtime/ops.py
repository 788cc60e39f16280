"""Torch reference ops: the numerics every backend must reproduce.

Each function here is the reference for one Triton kernel in ``kernellab.kernels`` with the same name and
signature. Shapes use T = packed tokens of a step, B = sequences, Hq/Hk = query/KV heads, D = head_dim,
H = hidden size, I = intermediate size.

KV cache layout (per layer): ``k_cache, v_cache: (num_blocks, block_size, Hk, D)``; a token's slot is
``block_id * block_size + offset`` and ``block_tables[b, i]`` is the i-th block of sequence b (-1 past the end).
An FP8 cache (``torch.float8_e4m3fn``) adds ``k_scales, v_scales: (num_blocks, block_size, Hk)`` fp32: each
(token, KV head) row of D values is stored as ``fp8(x · 448 / amax)`` with scale ``amax / 448``
(``quantize_kv``), and read back as ``fp8 · scale``. An int8 cache likewise, with 127 for 448 and the values
rounded to nearest even; everything said of the FP8 cache below holds for it.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``y = x / sqrt(mean(x², -1) + eps) * w`` for ``x: (..., H)``, ``weight: (H,)``.

    Cast order matches HF Qwen3/Llama exactly: reduce and normalise in fp32, cast the normalised value back to
    the input dtype, then multiply by the weight in the input dtype.
    """
    dtype = x.dtype
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    return weight * (xf * torch.rsqrt(var + eps)).to(dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add + RMSNorm: ``r = x + residual`` (in the input dtype); returns ``(rms_norm(r), r)``."""
    r = x + residual
    return rms_norm(r, weight, eps), r


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU on the fused gate/up projection: ``gate_up: (..., 2I)`` → ``silu(gate) * up: (..., I)``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gate_up_swiglu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The MLP's gate/up projection and its SwiGLU: ``silu_and_mul(linear(x, weight))`` for ``weight: (2I, K)``
    stacked gate over up → ``(M, I)``."""
    return silu_and_mul(linear(x, weight))


def silu_and_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The MLP's SwiGLU and down projection: ``linear(silu_and_mul(gate_up), weight)``."""
    return linear(silu_and_mul(gate_up), weight)


def add_rms_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual add and RMSNorm feeding a projection: ``(linear(rms_norm(r), weight), r)``, ``r = x + residual``;
    with no residual (a model's first layer) ``r = x``. ``out``: as ``linear``'s."""
    normed, r = (rms_norm(x, norm_weight, eps), x) if residual is None else add_rms_norm(x, residual, norm_weight, eps)
    return linear(normed, weight, out=out), r


def add_silu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``silu(a + b)`` elementwise (the teaching fusion of the vector-add chapter)."""
    return F.silu(a + b)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Numerically stable softmax over the last dimension, reduced in fp32, returned in x's dtype."""
    return torch.softmax(x.float(), dim=-1).to(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``y = x @ W^T`` for ``x: (M, K)``, ``weight: (N, K)`` (no bias: Qwen3 and Llama have none). ``out``: where
    ``y``, rounded to x's dtype as computed, is stored; it may be fp32 (the LM head's logits: the values of
    ``linear(x, W).float()``)."""
    y = F.linear(x, weight)
    if out is None:
        return y
    return out.copy_(y)


def argmax(logits: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Greedy token per row: ``logits: (B, V)`` → ``(B,)`` int64; ties resolve to the lowest index. ``out``: a
    ``(B,)`` int64 buffer to write them to (a decode window's row of tokens)."""
    return torch.argmax(logits, dim=-1, out=out)


def l2_prefetch(*tensors: torch.Tensor, lines: bool = False, pdl: bool | None = None) -> None:
    """A cache hint: fetch these tensors' bytes into the GPU's L2 ahead of the kernels that read them. It changes
    no value, so the reference does nothing (the kernel: ``kernels/prefetch.py``; ``lines`` and ``pdl`` choose
    how it issues and launches)."""
    return None


def rope_cos_sin_cache(
    head_dim: int, max_position: int, base: float, scaling: dict | None = None, device=None
) -> torch.Tensor:
    """``(max_position, head_dim)`` fp32 table: ``[:, :D/2] = cos(p·f)``, ``[:, D/2:] = sin(p·f)``.

    ``scaling`` supports HF's ``rope_type == "llama3"`` (Llama 3.1/3.2 frequency-dependent scaling).
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))
    if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * torch.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    inv_freq = inv_freq.float()
    t = torch.arange(max_position, dtype=torch.float32, device=device)
    freqs = torch.outer(t, inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # NeoX / HF "rotate_half" convention: pairs are (i, i + D/2). Written on the halves (no duplicated cos/sin,
    # no negated copy); each element is the same product-and-sum HF computes, so the rounding is identical.
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on Q and K together. ``positions: (T,)``, ``q: (T, Hq, D)``, ``k: (T, Hk, D)``.

    Matches HF: cos/sin are cast to the activation dtype before the multiply.
    """
    cs = cos_sin_cache[positions]
    half = cs.shape[-1] // 2
    cos = cs[:, None, :half].to(q.dtype)
    sin = cs[:, None, half:].to(q.dtype)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def qk_norm_rope(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's per-head RMSNorm on q and k (over D), then RoPE. Shapes as in ``rotary_embedding``."""
    return rotary_embedding(positions, rms_norm(q, q_norm_weight, eps), rms_norm(k, k_norm_weight, eps), cos_sin_cache)


FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3 value
FP8_MIN_AMAX = 1e-12  # an all-zero row still gets a finite reciprocal (its values quantize to 0)
INT8_DTYPE = torch.int8
INT8_MAX = 127.0  # symmetric: -127 … 127
# The 8-bit caches, each with the value its rows' amax maps to. Both store one fp32 scale per (token, KV head)
# row; e4m3 keeps ~3 significant bits of every value, int8 uniform steps of amax / 127 (for K and V spread like
# a model's, ~4.5× less loss: docs/gpu-engine.md).
QUANTIZED_KV = {FP8_DTYPE: FP8_MAX, INT8_DTYPE: INT8_MAX}


def quantize_kv(x: torch.Tensor, dtype: torch.dtype = FP8_DTYPE) -> tuple[torch.Tensor, torch.Tensor]:
    """``x: (..., D)`` → ``(values (..., D) in dtype, scales (...) fp32)``: one scale per row of D values (per
    token and KV head in the cache), ``amax / top`` (``top``: 448 for e4m3, 127 for int8). The values are
    ``x · (top / amax)`` rounded to nearest even: a multiply by the correctly rounded reciprocal, so a kernel
    doing the same two IEEE operations stores the same bits."""
    top = QUANTIZED_KV[dtype]
    xf = x.float()
    amax = xf.abs().amax(-1).clamp(min=FP8_MIN_AMAX)
    # a tensor divide: ``448.0 / amax`` would be computed as ``amax.reciprocal() * 448`` (two roundings)
    inv = torch.full_like(amax, top) / amax
    y = xf * inv[..., None]
    if dtype == INT8_DTYPE:
        y = torch.round(y)  # half to even (the cast alone would truncate)
    return y.clamp(-top, top).to(dtype), amax / top


# Whether the engine lays out the int8 cache's V transposed within its blocks (``v_cache_zeros``); a switch for
# side-by-side measurements (benchmarks/gpu/decode_attention_sweep.py), read when a runner allocates its cache.
INT8_V_TRANSPOSED = True


def v_cache_zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A zeroed V cache of ``shape`` ``(num_blocks, block_size, Hk, D)``. The int8 cache's V is transposed within
    its blocks: the view of a ``(num_blocks, Hk, D, block_size)`` tensor, so the decode attention reads each
    dimension's tokens as one run, the layout its int8 tensor-core dots take (kernels/kv_cache.py,
    kernels/paged_attention.py); every other cache is dense like K."""
    if dtype != INT8_DTYPE or not INT8_V_TRANSPOSED:
        return torch.zeros(shape, dtype=dtype, device=device)
    nb, bs, hk, d = shape
    return torch.zeros((nb, hk, d, bs), dtype=dtype, device=device).permute(0, 3, 1, 2)


# Whether the engine lays out the int8 cache's scales head-major within a block (``scale_zeros``); a switch for
# side-by-side measurements (``knob_ab.py --set``), read when a runner allocates its cache.
INT8_SCALES_HEAD_MAJOR = True


def scale_zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """Zeroed fp32 scales ``(num_blocks, block_size, Hk)`` for an 8-bit cache of ``dtype``. The int8 cache's are
    head-major within each block: the view of a ``(num_blocks, Hk, block_size)`` tensor, so the decode attention's
    tile of one head reads its block's scales as one run of ``block_size`` floats rather than one 4-byte value
    every ``Hk`` floats (kernels/kv_cache.py: ``scales_head_major``); FP8's stay dense."""
    if dtype != INT8_DTYPE or not INT8_SCALES_HEAD_MAJOR:
        return torch.zeros(shape, dtype=torch.float32, device=device)
    nb, bs, hk = shape
    return torch.zeros((nb, hk, bs), dtype=torch.float32, device=device).permute(0, 2, 1)


def dequantize_kv(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 values an 8-bit cache row stands for: ``value · scale``."""
    return q.float() * scales[..., None]


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

    An 8-bit cache (FP8 or int8) quantizes each (token, head) row (``quantize_kv``) and writes its scale to
    ``k_scales`` / ``v_scales``."""
    block_size = k_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    # (block, offset) pairs, not rows of a flat view: a V cache transposed within its blocks (the int8 cache's
    # layout, kernels/kv_cache.py) has no such view
    at = (slots // block_size, slots % block_size)
    for x, cache, scales in ((k, k_cache, k_scales), (v, v_cache, v_scales)):
        if cache.dtype in QUANTIZED_KV:
            assert scales is not None, "an 8-bit cache needs its scales"
            q, s = quantize_kv(x[valid], cache.dtype)
            # scattered as bytes: indexing kernels do not cover float8 on every device
            cache.view(torch.uint8)[at] = q.view(torch.uint8)
            scales[at] = s
        else:
            cache[at] = x[valid]


def read_cache(
    cache: torch.Tensor, index: torch.Tensor | tuple[torch.Tensor, ...], scales: torch.Tensor | None
) -> torch.Tensor:
    """``cache[index]``: blocks of ``(N, block_size, Hk, D)`` (``index`` int64 of any shape), or a tuple of block
    and offset indices; an 8-bit cache's values dequantized to fp32 (gathered as bytes: indexing kernels do not
    cover float8 everywhere)."""
    if cache.dtype not in QUANTIZED_KV:
        return cache[index]
    assert scales is not None, "an 8-bit cache needs its scales"
    return dequantize_kv(cache.view(torch.uint8)[index].view(cache.dtype), scales[index])


def read_slots(cache: torch.Tensor, slots: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """The cache rows at token ``slots`` (int64, any shape) → ``(*slots.shape, Hk, D)``, an 8-bit cache's
    dequantized to fp32; indexed by (block, offset), so V transposed within its blocks reads the same."""
    return read_cache(cache, (slots // cache.shape[1], slots % cache.shape[1]), scales)


def _gather_context(
    cache: torch.Tensor, block_table: torch.Tensor, context_len: int, scales: torch.Tensor | None = None
) -> torch.Tensor:
    n = -(-context_len // cache.shape[1])
    return read_cache(cache, block_table[:n].long(), scales).flatten(0, 1)[:context_len]


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence over its paged context (GQA).

    ``q: (B, Hq, D)``, ``block_tables: (B, max_blocks)`` int32, ``context_lens: (B,)`` int32 (≥ 1, including
    the current token, whose K/V is already in the cache). Returns ``(B, Hq, D)`` in q's dtype; softmax in fp32.
    An FP8 cache is read as ``fp8 · scale`` and attended in fp32.
    """
    B, Hq, D = q.shape
    Hk = k_cache.shape[2]
    max_len = int(context_lens.max())
    n_blocks = -(-max_len // k_cache.shape[1])
    table = block_tables[:, :n_blocks].clamp(min=0).long()

    k, v = (
        read_cache(cache, table, scales).flatten(1, 2)[:, :max_len].transpose(1, 2)  # (B, Hk, L, D)
        for cache, scales in ((k_cache, k_scales), (v_cache, v_scales))
    )
    # GQA without repeating K/V: the group's query heads play the role of SDPA's query length.
    qg = q.view(B, Hk, Hq // Hk, D).to(k.dtype)
    valid = torch.arange(max_len, device=q.device)[None, :] < context_lens[:, None].to(q.device)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=valid[:, None, None, :], scale=scale)
    return out.reshape(B, Hq, D).to(q.dtype)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention for packed query chunks over paged contexts (chunked prefill, prefix caching).

    ``q: (T, Hq, D)`` packs each sequence's new tokens; sequence b's queries are rows
    ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and sit at the last positions of its ``context_lens[b]`` tokens, all of
    whose K/V are already in the cache. Returns ``(T, Hq, D)``. An FP8 cache's context is dequantized to q's
    dtype.
    """
    out = torch.empty_like(q)
    Hq, Hk = q.shape[1], k_cache.shape[2]
    cu = cu_seqlens_q.tolist()
    lens = context_lens.tolist()
    for b in range(len(lens)):
        s, e, ctx = cu[b], cu[b + 1], lens[b]
        if e == s:
            continue
        k = _gather_context(k_cache, block_tables[b], ctx, k_scales).to(q.dtype)
        v = _gather_context(v_cache, block_tables[b], ctx, v_scales).to(q.dtype)
        out[s:e] = causal_attention(q[s:e], k, v, scale, Hq // Hk)
    return out


# SDPA's backend order for prefill on a GPU: cuDNN first, where this PyTorch can set an order (checked once here,
# not per layer call)
_PREFILL_ORDER = [
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]
_CAN_SET_ORDER = "set_priority" in inspect.signature(sdpa_kernel).parameters


def _prefill_backends(q: torch.Tensor) -> contextlib.AbstractContextManager:
    """SDPA's backend order for prefill: ``_PREFILL_ORDER`` on a GPU, else PyTorch's own."""
    if not (q.is_cuda and _CAN_SET_ORDER):
        return contextlib.nullcontext()
    return sdpa_kernel(_PREFILL_ORDER, set_priority=True)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, group: int) -> torch.Tensor:
    """Causal GQA attention of ``q: (Tq, Hq, D)`` over ``k, v: (Tk, Hk, D)``, Tk ≥ Tq, queries at the end."""
    tq, tk = q.shape[0], k.shape[0]
    # (1, H, T, D): SDPA's flash/memory-efficient kernels need a batch dimension; 3-D input falls back to the
    # fp32 math path (measured on the H200: ~45 ms instead of < 1 ms for a 2,048-token prompt).
    if tq == tk:
        # Each KV head is read once for its query group (``enable_gqa``), with no repeated K/V copy. On a GPU,
        # cuDNN's attention first, on dense inputs (given views into the fused QKV projection, SDPA fell back to
        # FlashAttention): H200, 2,048 tokens, 54 µs a layer against FlashAttention's 103 and 130 with
        # repeat_interleave (results/gpu/prefill_attention_h200.json).
        if q.is_cuda:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        with _prefill_backends(q):
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=group > 1)
    else:
        qh = q.transpose(0, 1).unsqueeze(0)
        # a bottom-right causal mask: the memory-efficient kernel takes the mask but not ``enable_gqa``
        kh = k.transpose(0, 1).repeat_interleave(group, dim=0).unsqueeze(0)
        vh = v.transpose(0, 1).repeat_interleave(group, dim=0).unsqueeze(0)
        allowed = torch.arange(tk, device=q.device)[None, :] <= (torch.arange(tq, device=q.device)[:, None] + tk - tq)
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=allowed, scale=scale)
    return o[0].transpose(0, 1)


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
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    v_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's attention prologue in one op: ``qk_norm_rope`` then ``store_kv`` of the rotated k and v (and a
    dense copy of v into ``v_out`` where given)."""
    q, k = qk_norm_rope(positions, q, k, q_norm_weight, k_norm_weight, eps, cos_sin_cache)
    store_kv(k, v, k_cache, v_cache, slot_mapping, k_scales=k_scales, v_scales=v_scales)
    if v_out is not None:
        v_out.copy_(v)
    return q, k


def qkv_proj_norm_rope_store_kv(
    x: torch.Tensor,
    weight: torch.Tensor,
    positions: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """Qwen3's QKV projection and attention prologue: ``linear(x, weight)`` → ``(M, (Hq + 2·Hk)·D)`` rows whose q
    and k heads are replaced by ``qk_norm_rope``'s, k and v written to the caches (``store_kv``); v as projected."""
    D = k_cache.shape[-1]
    qkv = linear(x, weight)
    q, k, v = qkv.split([num_heads * D, num_kv_heads * D, num_kv_heads * D], dim=-1)
    q, k, v = q.view(-1, num_heads, D), k.view(-1, num_kv_heads, D), v.view(-1, num_kv_heads, D)
    q2, k2 = qk_norm_rope_store_kv(
        positions, q, k, v, q_norm_weight, k_norm_weight, eps, cos_sin_cache, k_cache, v_cache, slot_mapping
    )
    q.copy_(q2)
    k.copy_(k2)
    return qkv


def paged_decode_attention_qk_norm_rope(
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
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """A decode step's attention from its raw projections: ``qk_norm_rope_store_kv`` of each row at position
    ``context_lens - 1``, then ``paged_decode_attention`` (Qwen3's decode layer, one op for the fused kernel)."""
    positions = context_lens.long() - 1
    q, _ = qk_norm_rope_store_kv(
        positions, q, k, v, q_norm_weight, k_norm_weight, eps, cos_sin_cache, k_cache, v_cache, slot_mapping
    )
    return paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)


def decode_attention_o_proj(
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
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    o_weight: torch.Tensor,
) -> torch.Tensor:
    """A decode step's attention (``paged_decode_attention_qk_norm_rope``) and its output projection → ``(B,
    hidden)`` (one op for batch-1 decode, whose kernel leaves a few-slice attention's merge to the projection)."""
    o = paged_decode_attention_qk_norm_rope(
        q, k, v, q_norm_weight, k_norm_weight, eps, cos_sin_cache, k_cache, v_cache, slot_mapping, block_tables,
        context_lens, scale,
    )  # fmt: skip
    return linear(o.reshape(o.shape[0], -1), o_weight)


_PADDED: dict = {}


def _padded_rows(cu_seqlens: list[int], device) -> tuple[torch.Tensor, int, int]:
    """Row of each packed token in a (B · Lmax) padded layout; cached for the step's (all layers') calls."""
    key = (tuple(cu_seqlens), str(device))
    if _PADDED.get("key") != key:
        lens = [e - s for s, e in itertools.pairwise(cu_seqlens)]
        width = max(lens)
        rows = [b * width + i for b, n in enumerate(lens) for i in range(n)]
        _PADDED.update(key=key, value=(torch.tensor(rows, device=device), len(lens), width))
    return _PADDED["value"]


def varlen_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: list[int],
    scale: float,
    cu_device: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed fresh prompts (no cached prefix): sequence b is rows
    ``cu_seqlens[b]:cu_seqlens[b+1]`` of ``q: (T, Hq, D)`` and ``k, v: (T, Hk, D)``. ``cu_seqlens`` is a host
    list so no device sync is needed to slice. ``cu_device``: the same offsets on the device, which the Triton
    op (``kernels/attention.py``) reads inside a CUDA graph; here the host list is taken as exact.

    Several prompts are scattered into one right-padded batch and attended in a single SDPA (FlashAttention)
    call: with the padding after each prompt, causal masking keeps it out of every real row, so each row equals
    the per-prompt result. One launch sequence per layer instead of one per prompt (the per-prompt loop cost
    ~150 µs a prompt per layer on the H200's host)."""
    group = q.shape[1] // k.shape[1]
    if len(cu_seqlens) == 2:
        return causal_attention(q, k, v, scale, group)
    rows, batch, width = _padded_rows(cu_seqlens, q.device)

    def padded(x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(batch * width, *x.shape[1:])
        out[rows] = x
        return out.view(batch, width, *x.shape[1:]).transpose(1, 2)  # (B, H, Lmax, D)

    o = F.scaled_dot_product_attention(
        padded(q), padded(k), padded(v), is_causal=True, scale=scale, enable_gqa=group > 1
    )
    return o.transpose(1, 2).reshape(batch * width, *q.shape[1:])[rows]
