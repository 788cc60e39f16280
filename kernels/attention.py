"""Tiled causal prefill attention with an online softmax (FlashAttention-style): the teaching kernel.

Formula
    ``o_i = Σ_j softmax_j(q_i·k_j·scale) v_j`` over keys ``j ≤ i + (Tk − Tq)`` (queries sit at the end of the
    keys), grouped-query: query head h reads KV head ``h // group``. ``q: (Tq, Hq, D)``, ``k, v: (Tk, Hk, D)``
    → ``(Tq, Hq, D)`` (reference ``ops.causal_attention``, which calls PyTorch SDPA).

Program mapping
    Grid ``(cdiv(Tq, BLOCK_M), Hq)``: a program owns ``BLOCK_M`` queries of one head and keeps them in
    registers; it streams that head's K/V in ``BLOCK_N``-key tiles, computing ``S = Q·Kᵀ`` (``tl.dot``), the
    running row max ``m``, the running denominator ``l`` and ``acc = Σ p·V``, rescaling ``l`` and ``acc`` by
    ``2^(m_old − m_new)`` whenever the max grows. The ``Tq × Tk`` score matrix never exists in memory: each
    K/V tile is read once per query tile, so HBM traffic is ``O(T·D)`` per query tile rather than ``O(T²)``.
    The key range splits in two loops: tiles wholly below the diagonal run without a mask; only the last
    ``BLOCK_M / BLOCK_N + 1`` tiles apply the causal mask. Tiles above the diagonal are never visited (half
    the FLOPs of the full product).

Coalescing
    Q/K/V rows of one head are ``D`` contiguous elements (256 B at D = 128 bf16) with a token stride of
    ``H·D``; each tile load is ``BLOCK`` such runs — fully used 32-byte sectors.

Precision
    ``S`` accumulates in fp32 (bf16 operands on tensor cores); the softmax runs in the base-2 domain
    (``scale·log2 e`` folded into one multiply) in fp32; ``P`` is rounded to bf16 for the ``P·V`` tensor-core
    dot (as FlashAttention does), ``acc`` stays fp32 and is divided by ``l`` once at the end. fp32 inputs use
    IEEE fp32 dots.

Trade-offs tried
    A teaching kernel: FlashAttention behind PyTorch SDPA uses warp specialisation, TMA and ping-pong
    scheduling that this ~60-line kernel does not. On the H200 (16 query / 8 KV heads, D = 128) it runs at
    223 TFLOP/s for 2,048 tokens and 309 TFLOP/s for 4,096: 1.02× / 0.87× ``ops.causal_attention`` (4-D SDPA
    after ``repeat_interleave`` of K/V) and 0.68× PyTorch's FlashAttention path (4-D SDPA with ``enable_gqa``) at
    both lengths — it loses, as expected. BLOCK_M = 128 / BLOCK_N = 64 / 8 warps / 3 stages at
    D = 128; smaller tiles lose tensor-core efficiency, larger ones spill the fp32 accumulator.
    The Hopper form (``tma=True``, ``_causal_attention_desc_kernel``) adds what the pointer form lacks: Q/K/V
    tiles through tensor descriptors (TMA: one bulk copy a tile, no address arithmetic per element, the
    descriptor's bounds instead of masks), the unmasked key loop optionally warp-specialised (producer warps
    issuing the copies, consumer warps the dots; ``warp_specialize``, 8 warps on sm_90), and the query tiles
    that walk the most keys launched first (``heavy_first``). q/k/v are read where the QKV projection left them
    (strided views, unit-stride heads). Not measured on the H200 yet: ``benchmarks/gpu/prefill_attention.py
    --triton-sweep`` times ~30 settings of both forms against cuDNN's 53 µs (323 TFLOP/s) at 2,048 tokens.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

from ._common import cdiv, next_pow2, require, use_pdl

__all__ = ["PREFILL_LAUNCH", "PREFILL_TILES", "causal_attention", "packed_causal_attention", "varlen_causal_attention"]

_LOG2E = 1.4426950408889634
# The engine's prefill launch (``varlen_causal_attention``): the H200 sweep's best at Qwen3-0.6B's 16 / 8 heads,
# D = 128 (results/gpu/engine_h200_dev/prefill_attention_sweep_06f765e.json): 46.0 µs at 2,048 tokens against
# cuDNN's 52.8 (373.6 against 325.7 TFLOP/s), 152.2 against 149.6 µs at 4,096. Longest query tiles first made
# the difference (60.4 µs without); the warp-specialised key loop changed nothing.
PREFILL_TILES = {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3}  # the packed form's too
PREFILL_LAUNCH = {**PREFILL_TILES, "tma": True, "heavy_first": True}
# Whether the descriptor forms launch with programmatic dependent launch on Hopper (``_common.use_pdl``): read at
# each launch, so a CUDA graph keeps what was in force at capture (``benchmarks/gpu/knob_ab.py --ttft`` A/Bs it). The
# QK-norm + RoPE + KV-write kernel before the attention is a PDL kernel, so a PDL attention's launch and ramp-up
# overlap its tail; every program waits (``griddepcontrol.wait``) before its first load. On two H100s, one build
# order each (engine_h200_dev/knob_ab_prefill_pdl*_h100_*): TTFT of a 2,048-token prompt 5.415 against 5.435 ms
# and 5.047 against 5.054 (-0.4 %, -0.1 %: the ~0.3 µs boundary it hides, 28 times), batch-1 ITL unchanged.
PREFILL_PDL = True


@triton.jit
def _scores(q, k, qk_scale, IEEE: tl.constexpr):
    """``q·kᵀ`` scaled into the base-2 domain."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
    else:
        s = tl.dot(q, tl.trans(k)) * qk_scale
    return s


@triton.jit
def _softmax_step(s, m_i, l_i):
    """The online softmax over one key tile: its probabilities, the rescale of what came before, the new running
    max and denominator."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _accumulate(acc, alpha, p, v, IEEE: tl.constexpr):
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc


@triton.jit
def _attend(
    acc,
    l_i,
    m_i,
    q,
    k_base,
    v_base,
    stride_kt,
    stride_vt,
    q_pos,
    start,
    end,
    n_keys,
    d,
    d_mask,
    qk_scale,
    BLOCK_N: tl.constexpr,
    CAUSAL_MASK: tl.constexpr,
    IEEE: tl.constexpr,
):
    for s0 in range(start, end, BLOCK_N):
        kp = s0 + tl.arange(0, BLOCK_N)
        kv_mask = (kp < n_keys)[:, None] & d_mask[None, :]
        k = tl.load(k_base + kp.to(tl.int64)[:, None] * stride_kt + d[None, :], mask=kv_mask, other=0.0)
        s = _scores(q, k, qk_scale, IEEE)
        if CAUSAL_MASK:
            allowed = (kp[None, :] <= q_pos[:, None]) & (kp < n_keys)[None, :]
            s = tl.where(allowed, s, -float("inf"))
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i)
        v = tl.load(v_base + kp.to(tl.int64)[:, None] * stride_vt + d[None, :], mask=kv_mask, other=0.0)
        acc = _accumulate(acc, alpha, p, v, IEEE)
    return acc, l_i, m_i


@triton.jit
def _causal_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    n_queries,
    n_keys,
    qk_scale,
    group,
    head_dim,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D_PAD: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // group
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D_PAD)
    d_mask = d < head_dim
    row_mask = (rows < n_queries)[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + rows.to(tl.int64)[:, None] * stride_qt + h * stride_qh + d[None, :], mask=row_mask, other=0.0)
    shift = n_keys - n_queries
    q_pos = rows + shift
    # keys [0, lo) are visible to every query of the tile; [lo, hi) straddle the diagonal and need the mask
    hi = tl.minimum(n_keys, (pid_m + 1) * BLOCK_M + shift)
    lo = tl.minimum(((pid_m * BLOCK_M + shift + 1) // BLOCK_N) * BLOCK_N, hi)
    lo = tl.maximum(lo, 0)
    m_i = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    k_base = k_ptr + hk * stride_kh
    v_base = v_ptr + hk * stride_vh
    acc, l_i, m_i = _attend(
        acc,
        l_i,
        m_i,
        q,
        k_base,
        v_base,
        stride_kt,
        stride_vt,
        q_pos,
        0,
        lo,
        n_keys,
        d,
        d_mask,
        qk_scale,
        BLOCK_N,
        False,
        IEEE,
    )
    acc, l_i, m_i = _attend(
        acc,
        l_i,
        m_i,
        q,
        k_base,
        v_base,
        stride_kt,
        stride_vt,
        q_pos,
        lo,
        hi,
        n_keys,
        d,
        d_mask,
        qk_scale,
        BLOCK_N,
        True,
        IEEE,
    )
    o = acc / l_i[:, None]
    tl.store(
        o_ptr + rows.to(tl.int64)[:, None] * stride_ot + h * stride_oh + d[None, :],
        o.to(o_ptr.dtype.element_ty),
        mask=row_mask,
    )


@triton.jit
def _attend_desc(
    acc,
    l_i,
    m_i,
    q,
    k_desc,
    v_desc,
    row0,
    col,
    q_pos,
    start,
    end,
    qk_scale,
    BLOCK_N: tl.constexpr,
    CAUSAL_MASK: tl.constexpr,
    IEEE: tl.constexpr,
    STAGES: tl.constexpr,
    WS: tl.constexpr,
):
    # keys [start, end) of the sequence whose first row is row0 (the packed form's prompt; 0 for one sequence).
    # Keys past the end load as zeros (the descriptor's bounds) or as the next prompt's rows, and only query rows
    # that are not stored may see them
    for s0 in tl.range(start, end, BLOCK_N, num_stages=STAGES, warp_specialize=WS):
        k = k_desc.load([row0 + s0, col])
        s = _scores(q, k, qk_scale, IEEE)
        if CAUSAL_MASK:
            kp = s0 + tl.arange(0, BLOCK_N)
            s = tl.where(kp[None, :] <= q_pos[:, None], s, -float("inf"))
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i)
        v = v_desc.load([row0 + s0, col])
        acc = _accumulate(acc, alpha, p, v, IEEE)
    return acc, l_i, m_i


@triton.jit
def _attend_tile(
    q,
    k_desc,
    v_desc,
    row0,
    col,
    first,
    n_keys,
    qk_scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    IEEE: tl.constexpr,
    STAGES: tl.constexpr,
    WS: tl.constexpr,
):
    """A query tile whose first row sits at key position ``first`` of a sequence of ``n_keys`` keys starting at
    descriptor row ``row0``: keys [0, lo) visible to every row (the unmasked loop, warp-specialised with WS),
    [lo, hi) across the diagonal (masked); returns the normalised output tile (fp32)."""
    q_pos = first + tl.arange(0, BLOCK_M)
    hi = tl.minimum(n_keys, first + BLOCK_M)
    lo = tl.maximum(tl.minimum(((first + 1) // BLOCK_N) * BLOCK_N, hi), 0)
    m_i = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    acc, l_i, m_i = _attend_desc(
        acc, l_i, m_i, q, k_desc, v_desc, row0, col, q_pos, 0, lo, qk_scale, BLOCK_N, False, IEEE, STAGES, WS
    )
    acc, l_i, m_i = _attend_desc(
        acc, l_i, m_i, q, k_desc, v_desc, row0, col, q_pos, lo, hi, qk_scale, BLOCK_N, True, IEEE, STAGES, False
    )
    return acc / l_i[:, None]


@triton.jit
def _causal_attention_desc_kernel(
    q_desc,
    k_desc,
    v_desc,
    o_desc,
    n_queries,
    n_keys,
    qk_scale,
    group,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    IEEE: tl.constexpr,
    STAGES: tl.constexpr,
    WS: tl.constexpr,
    HEAVY_FIRST: tl.constexpr,
    PDL: tl.constexpr = False,
):
    # grid (Hq, query tiles): the heads of one query tile are launched together, and with HEAVY_FIRST the last
    # tiles, which walk the most keys, go first, so the short ones fill the machine's tail
    if PDL:  # see _common.use_pdl: q, k and v are the previous kernel's output
        gdc_launch_dependents()
        gdc_wait()
    h = tl.program_id(0)
    pid_m = tl.program_id(1)
    if HEAVY_FIRST:
        pid_m = tl.num_programs(1) - 1 - pid_m
    q = q_desc.load([pid_m * BLOCK_M, h * D])
    first = pid_m * BLOCK_M + n_keys - n_queries  # the queries sit at the end of the keys
    o = _attend_tile(
        q, k_desc, v_desc, 0, (h // group) * D, first, n_keys, qk_scale, BLOCK_M, BLOCK_N, D, IEEE, STAGES, WS
    )
    o_desc.store([pid_m * BLOCK_M, h * D], o.to(o_desc.dtype))


@triton.jit
def _packed_causal_attention_kernel(
    q_desc,
    k_desc,
    v_desc,
    o_ptr,
    cu_ptr,
    n_seqs,
    qk_scale,
    group,
    stride_ot,
    stride_oh,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    S_PAD: tl.constexpr,
    IEEE: tl.constexpr,
    STAGES: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:  # as in _causal_attention_desc_kernel
        gdc_launch_dependents()
        gdc_wait()
    # grid (Hq, an upper bound of the query tiles of all prompts): program t of a head finds its prompt b and its
    # tile from the device offsets (a CUDA graph's host offsets are only its bucket's), each prompt's tiles
    # numbered from its last (the longest walk) to its first; programs past the last tile return
    h = tl.program_id(0)
    t = tl.program_id(1)
    idx = tl.arange(0, S_PAD)
    starts = tl.load(cu_ptr + idx, mask=idx < n_seqs, other=0)
    ends = tl.load(cu_ptr + idx + 1, mask=idx < n_seqs, other=0)
    tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
    cum = tl.cumsum(tiles, 0)
    if t < tl.sum(tiles):
        b = tl.sum((cum <= t).to(tl.int32))
        mine = idx == b
        start = tl.sum(tl.where(mine, starts, 0))
        n = tl.sum(tl.where(mine, ends, 0)) - start
        pid_m = tl.sum(tl.where(mine, cum, 0)) - 1 - t  # the prompt's tiles from its last
        q = q_desc.load([start + pid_m * BLOCK_M, h * D])
        # keys past the prompt's end (the next prompt's rows) are masked like the future: only the diagonal loop
        # reaches them, and no row of this prompt sees past its own position
        o = _attend_tile(
            q, k_desc, v_desc, start, (h // group) * D, pid_m * BLOCK_M, n, qk_scale, BLOCK_M, BLOCK_N, D, IEEE,
            STAGES, False,
        )  # fmt: skip
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # positions in the prompt
        d = tl.arange(0, D)
        # a tile's rows past the prompt's end are the next prompt's: stored through a mask, not the descriptor
        tl.store(
            o_ptr + (start + rows).to(tl.int64)[:, None] * stride_ot + h * stride_oh + d[None, :],
            o.to(o_ptr.dtype.element_ty),
            mask=(rows < n)[:, None],
        )


def _desc(t: torch.Tensor, rows: int, block_rows: int, D: int) -> TensorDescriptor:
    """(T, H, D) with unit-stride heads as the 2-D (T, H·D) matrix a tensor descriptor (TMA) reads in
    ``[block_rows, D]`` tiles."""
    return TensorDescriptor(t, [rows, t.shape[1] * D], [t.stride(0), 1], [block_rows, D])


_DESCRIPTOR_LAYOUT = (
    "the descriptor form needs a power-of-two head_dim >= 16 and contiguous heads (stride D) on 16-byte-aligned rows"
)


def _descriptor_ready(*tensors: torch.Tensor) -> bool:
    """Whether the descriptor form can read these (T, H, D) tensors: unit-stride heads of a power-of-two D ≥ 16,
    16-byte-aligned rows."""
    D = tensors[0].shape[2]
    return (
        D >= 16
        and D & (D - 1) == 0
        and all(
            t.stride(2) == 1
            and t.stride(1) == D
            and t.data_ptr() % 16 == 0
            and (t.stride(0) * t.element_size()) % 16 == 0
            for t in tensors
        )
    )


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    group: int,
    *,
    out: torch.Tensor | None = None,
    block_m: int = 128,
    block_n: int = 64,
    num_warps: int = 8,
    num_stages: int = 3,
    tma: bool = False,
    warp_specialize: bool = False,
    heavy_first: bool = False,
) -> torch.Tensor:
    """Causal GQA attention of ``q: (Tq, Hq, D)`` over ``k, v: (Tk, Hk, D)`` (Tk ≥ Tq, queries at the end).

    ``tma``: the Hopper form (see "Trade-offs tried"): tiles through tensor descriptors (TMA on the GPU), the
    key loop optionally warp-specialised (``warp_specialize``), and with ``heavy_first`` the longest query
    tiles launched first. It needs a power-of-two head_dim of at least 16 and 16-byte-aligned rows."""
    Tq, Hq, D = q.shape
    Tk, Hk = k.shape[0], k.shape[1]
    require(v.shape == k.shape and k.shape[2] == D, "k and v must be (Tk, Hk, D)")
    require(Hq == Hk * group, f"Hq ({Hq}) must equal Hk ({Hk}) × group ({group})")
    require(Tk >= Tq, "there must be at least as many keys as queries")
    require(q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1, "unit stride along head_dim needed")
    require(q.dtype == k.dtype == v.dtype, "q, k, v must share a dtype")
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    require(out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1, "bad out")
    if Tq == 0:
        return out
    require(tma or not (warp_specialize or heavy_first), "warp_specialize and heavy_first are the descriptor form's")
    if tma:
        require(_descriptor_ready(q, k, v, out), _DESCRIPTOR_LAYOUT)
        # Triton 3.6's warp-specialization pass fails on sm_90 with 4 warps (tests/unit/kernels/test_hopper_compile)
        require(not warp_specialize or num_warps >= 8, "a warp-specialised key loop needs num_warps >= 8")
        pdl = PREFILL_PDL and use_pdl(q)
        _causal_attention_desc_kernel[(Hq, cdiv(Tq, block_m))](
            _desc(q, Tq, block_m, D),
            _desc(k, Tk, block_n, D),
            _desc(v, Tk, block_n, D),
            _desc(out, Tq, block_m, D),
            Tq,
            Tk,
            scale * _LOG2E,
            group,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            D=D,
            IEEE=q.dtype == torch.float32,
            STAGES=num_stages,
            WS=warp_specialize,
            HEAVY_FIRST=heavy_first,
            PDL=pdl,
            num_warps=num_warps,
            num_stages=num_stages,
            launch_pdl=pdl,
        )
        return out
    _causal_attention_kernel[(cdiv(Tq, block_m), Hq)](
        q,
        k,
        v,
        out,
        Tq,
        Tk,
        scale * _LOG2E,
        group,
        D,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        D_PAD=max(16, next_pow2(D)),
        IEEE=q.dtype == torch.float32,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def packed_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: torch.Tensor,
    max_tokens: int,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    block_m: int = 128,
    block_n: int = 128,
    num_warps: int = 8,
    num_stages: int = 3,
) -> torch.Tensor:
    """Causal attention of packed fresh prompts in one launch: prompt b is rows ``cu[b]:cu[b+1]`` of
    ``q: (T, Hq, D)`` and ``k, v: (T, Hk, D)``, ``cu`` a device int32 tensor (a CUDA graph's static offsets) and
    ``max_tokens`` an upper bound of ``cu[-1]`` (the grid's size; rows past ``cu[-1]`` are left as they are).
    Descriptor tiles as ``causal_attention(tma=True)``, each prompt's query tiles longest first."""
    Tq, Hq, D = q.shape
    Hk = k.shape[1]
    group = Hq // Hk
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    require(_descriptor_ready(q, k, v), _DESCRIPTOR_LAYOUT)  # the output goes through pointers
    require(out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1, "bad out")
    n_seqs = cu.numel() - 1
    if n_seqs < 1 or Tq == 0:
        return out
    tiles = cdiv(max_tokens, block_m) + n_seqs  # Σ cdiv(n_b, block_m) ≤ cdiv(Σ n_b, block_m) + prompts
    pdl = PREFILL_PDL and use_pdl(q)
    _packed_causal_attention_kernel[(Hq, tiles)](
        _desc(q, Tq, block_m, D),
        _desc(k, k.shape[0], block_n, D),
        _desc(v, v.shape[0], block_n, D),
        out,
        cu,
        n_seqs,
        scale * _LOG2E,
        group,
        out.stride(0),
        out.stride(1),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        D=D,
        S_PAD=max(16, next_pow2(n_seqs)),
        IEEE=q.dtype == torch.float32,
        STAGES=num_stages,
        PDL=pdl,
        num_warps=num_warps,
        num_stages=num_stages,
        launch_pdl=pdl,
    )
    return out


def varlen_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: list[int],
    scale: float,
    cu_device: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed fresh prompts, prompt b being rows ``cu_seqlens[b]:cu_seqlens[b+1]`` of
    ``q: (T, Hq, D)`` and ``k, v: (T, Hk, D)`` (reference ``ops.varlen_causal_attention``; ``cu_seqlens`` a host
    list). One prompt: one launch at ``PREFILL_LAUNCH``. Several with ``cu_device`` (the same offsets on the
    device, all a CUDA graph can trust: its host list holds only the bucket's bounds, ``cu_seqlens[-1]`` the most
    rows): one launch of ``packed_causal_attention``. The pointer form, a launch a prompt, where the descriptor
    form cannot read the tensors."""
    group = q.shape[1] // k.shape[1]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    ready = _descriptor_ready(q, k, v, out)
    if ready and cu_device is not None and len(cu_seqlens) > 2:
        return packed_causal_attention(q, k, v, cu_device, cu_seqlens[-1], scale, out=out, **PREFILL_TILES)
    launch = PREFILL_LAUNCH if ready else {}
    for s, e in itertools.pairwise(cu_seqlens):
        if e > s:
            causal_attention(q[s:e], k[s:e], v[s:e], scale, group, out=out[s:e], **launch)
    return out
