"""Decode GEMV: ``y = x @ Wᵀ`` for a few rows of x (M = 1…16), warp-reduced, split-K on demand, PDL.

Formula
    ``y[m, n] = Σ_k x[m, k] · W[n, k]`` for ``x: (M, K)``, ``weight: (N, K)`` (``nn.Linear`` layout, unit stride
    along K) → ``y: (M, N)`` in x's dtype (reference ``ops.linear``). The same kernel serves the quantized
    weights of ``quant_gemv.py`` (int8, or two int4 per byte, with one scale per output channel).

Why a GEMV at all
    At decode a linear layer is a pure weight stream: ``2·N·K`` bytes read for ``2·M·N·K`` FLOPs — 1 FLOP/byte
    at M = 1 against the H200's ~200 FLOP/byte balance point. The only goal is to keep enough bytes in flight
    to saturate HBM, and for Qwen3-0.6B's 4–13 MB matrices that is a large fraction of the whole matrix at once:
    at the H200's 4.56 TB/s and ~0.7 µs memory latency, ~3 MB must be outstanding.

Program mapping
    A 2-D grid ``(cdiv(N, BLOCK_N), SPLIT_K)``. Program ``(j, s)`` owns output columns ``[j·BLOCK_N, …)`` and
    the K range ``[s·k_per_split, (s+1)·k_per_split)``, which it walks in ``[BLOCK_N, BLOCK_K]`` weight tiles.
    - M = 1 ("warp-reduced" path): the tile is multiplied elementwise by the broadcast x chunk and accumulated
      into a ``[BLOCK_N, BLOCK_K]`` fp32 register tile — the inner loop is loads and FMAs only; the cross-lane
      reduction along K (warp shuffles, then shared memory between warps) happens once, after the loop.
    - M = 2…16: x is padded to 16 rows and each tile goes through ``tl.dot`` (tensor cores), reading every
      weight byte once for all M rows; the arithmetic is free at this intensity.
    - At Qwen3-0.6B's M = 1 shapes a tile holds ``BLOCK_N·BLOCK_K ≤ 8K`` elements (``M1_GRID``): q/k/v and
      gate/up take 16 rows in two K steps of 512, o_proj 4 × 2048 in one, down_proj 4 × 2048 in two (the
      second half masked), so a program has a step's loads all in flight at once; ``BLOCK_N`` shrinks until
      there are ~2 programs per SM (N = 1024 → 4 rows → 256 programs). Whole-K tiles of 16K elements were the
      default until the batch-1 A/B: their 128 registers left two programs an SM, and the gate/up GEMV's 384
      programs ran as ~1.45 waves (3 % slower ITL on the H200).
    - Split-K (opt-in via ``GemvConfig.split_k``; default only when even 1-row programs leave SMs idle): K is
      cut into ``SPLIT_K`` slices. Each program stores its fp32 partial, then increments a per-column-block
      counter with an acquire-release atomic; the program that brings the counter to ``SPLIT_K`` sums the
      partials in slice order (deterministic), writes y and resets the counter to 0 for the next call. One
      launch, no memset, no second kernel. (Counters and partials live in cached device buffers: warm up before
      CUDA-graph capture and do not run two GEMVs concurrently on different streams.)

Coalescing
    A tile row is ``BLOCK_K`` contiguous weight elements (1–4 K elements): each warp reads whole 512-byte runs
    and each thread issues 16-byte loads (8 of them per thread for a 32 KB tile over 8 warps). x (a few KB) is re-read by every column block from L2.
    Bytes: read ``N·K·w_bytes + M·K·2`` (+ ``4·N`` scales), write ``M·N·2``.

Precision
    Products and the K reduction in fp32 (for the dot path: bf16 operands, fp32 accumulation, like cuBLAS);
    per-channel scales applied to the fp32 sums; one rounding to x's dtype at the end.

Programmatic dependent launch (PDL; the M = 1 default on Hopper)
    A decode GEMV moves 2–12 MB, i.e. 0.5–3 µs of HBM time, while a kernel launch inside a CUDA graph costs
    ~1.5 µs before and after its bytes (launch gap, first-byte latency, tail: an RMSNorm over 64 rows takes
    1.6 µs for 0.26 MB). Launched with Hopper's PDL attribute, the GEMV may start while the previous kernel
    is still draining: it signals ``griddepcontrol.launch_dependents`` at once, issues its weight loads
    (weights never depend on the previous kernel), and only then waits (``griddepcontrol.wait``, which
    returns once the previous grid has completed and its writes are visible) before reading x or writing
    anything. So it is correct after any kernel; the overlap is largest after a kernel that triggers early
    (another GEMV). ``GemvConfig(pdl=False)`` turns it off.

SwiGLU in the prologue (``silu_and_mul_linear``, batch-1 decode)
    The MLP's down projection at M = 1 takes the fused gate/up row (2·I values) instead of its SwiGLU: each x
    chunk is computed as ``silu(g) · u`` from the two halves as it is loaded, rounded to x's dtype exactly where
    the SwiGLU kernel rounds, so the result equals SwiGLU kernel + GEMV bit for bit (CPU test). The (1, I)
    activation is never written and the layer launches one kernel fewer; each program re-reads the 2·I inputs
    from L2 (12 KB at Qwen3-0.6B) instead of I. Experimental until the gate's ablation measures it.

RMSNorm in the prologue (``add_rms_norm_linear``, batch-1 decode)
    A decoder layer's residual add + RMSNorm feeds a projection twice per layer (input norm → q/k/v, post-attention
    norm → gate/up). At M = 1 the GEMV takes the un-normalised ``x`` and ``residual`` instead: every program first
    walks the whole row (``H`` values, a few KB from L2) to form ``r = x + residual`` in x's dtype and its
    ``rstd``, then normalises each x chunk as it loads it, rounding where ``rms_norm.add_rms_norm`` rounds; program
    (0, 0) stores ``r`` to a new buffer (every program reads ``residual``, so it cannot be updated in place). Two
    launches fewer per layer; on the interpreter the result equals norm kernel + GEMV bit for bit (CPU test), on
    the GPU the row's sum of squares may be reduced in another order (an ulp of ``rstd`` now and then).
    With no residual (a model's first layer: its input norm reads the embedding) the row is ``x`` itself and
    nothing is stored. The final norm before the LM head could take the same path; on the H200 it saved nothing
    (batch-1 ITL 0.765 vs 0.767 ms at context 128, interleaved: each of the head's ~9,500 programs reads the row
    first; results/gpu/engine_h200_dev/fused_final_norm_ab_3fc91bb.json), so that norm keeps its own kernel.

The attention's merge in the prologue (``paged_attention.decode_attention_o_proj``, batch-1 decode)
    At batch 1 the split-KV decode attention cuts a context into 64-token slices, and the last slice to finish
    merges them behind a semaphore (publish, fence, atomic, re-read: dependent L2 trips at the end of the layer's
    critical path). For the output projection that follows, a context of 2 to ``DEFER_MAX_SLICES`` (4) slices is
    left unmerged: each program of the o_proj GEMV reads the slices' partials (``acc``, ``m``, ``l``, fp32 from L2,
    8 KB a slice at Qwen3-0.6B) and merges them head by head of its K tile as it loads x (``merge_slices``: the sums
    in slice order, each product and sum rounded on its own, through PTX ``mul.rn``/``add.rn`` on the GPU). The
    attention merges up to that many slices with the same function, so the output equals attention + GEMV bit
    for bit (CPU test). One slice, or more (long contexts: up to 32 partials a head would be re-read by each of
    the 256 programs), and the attention writes x itself. The merging GEMV needs more registers (128 at Qwen3
    shapes); it launches capped (``MERGE_MAXNREG``) so that its programs fit beside the attention's and fetch
    their weights before the wait. Measured on the H100 and rejected (runtime/kernel_status.json,
    docs/gpu-engine.md): -1 % batch-1 ITL at context 64, ~0 at 128, +2 % at 2,048; the gain the first A/B showed
    came from skipping the attention's tile merge, which the attention now avoids itself for few slices.

fp32 output (the LM head)
    ``out`` may be fp32 where x is bf16/fp16: each value is rounded to x's dtype, then stored widened, so the
    logits equal ``linear(x, W).float()`` bit for bit without the cast kernel after the projection.

Trade-offs tried
    The first version looped over K in 512-wide tiles with split-K to fill the SMs: on the H200 the split-K
    handshake (fence, atomic, re-read of the partials: three dependent L2 round trips) cost ~2 µs, more than
    it saved (q/k/v: 6.9 µs with split-K, 4.7 µs without). The default now has no loop and no split at Qwen3
    shapes (o_proj: 4 rows × 2048 per program, 256 programs) and launches with PDL: q/k/v 3.5 µs, o 2.3,
    gate/up 4.7, down 3.0 — 1.2× to 5.6× faster than cuBLAS (which picks a poor kernel for N = 1024 at
    M = 1: 12.7 µs for o_proj). Without PDL the same tiles take 5.8 / 3.5 / 7.7 / 4.0 µs; there the K-looping
    8 × 512 tiles are better for the wide matrices (q/k/v 4.5, gate/up 5.2 µs) and the single tile for
    N = 1024 — the default is tuned for Hopper with PDL. Split-K by atomically adding into an fp32 output was
    rejected: it needs a memset and a cast kernel (three launches). M = 8–16 (tensor-core path): 7.3 µs for
    gate/up (cuBLAS 5.7, a loss) and 6.3 µs for down (cuBLAS 7.7, a win); ``linear.py`` dispatches M = 1 only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ._common import cached_empty, cached_zeros, cdiv, next_pow2, num_sms, require, rows_2d, supports_pdl, use_pdl

__all__ = [
    "GemvConfig",
    "add_rms_norm_linear",
    "default_config",
    "linear",
    "silu_and_mul_linear",
    "split_for",
]

MAX_M = 16
# A one-sequence decode attention leaves its output unmerged when its context took from two up to this many slices,
# and the output projection's GEMV merges them as it loads x (``paged_attention.decode_attention_o_proj``); more
# slices and the attention merges them itself. At most ``paged_attention.SEQ_MERGE_SLICES``. Read at each launch
# (a knob of ``benchmarks/gpu/knob_ab.py``): each GEMV program re-reads every deferred slice's partials
# (S · Hq · D fp32 from L2), so the bound is measured.
DEFER_MAX_SLICES = 4
# The merging GEMV's register cap (``maxnreg``; None: the compiler's choice, 128 at Qwen3-0.6B's o_proj). Its PDL
# launch starts while the attention's programs still hold their SMs (two of 20K registers each, idle slices
# included, until the QKV projection ends): a 256-thread program fits beside them only at ≤ 96 registers, and
# only a program already resident fetches its weight tile before the wait. On the H100 (interleaved, batch-1 ITL
# at contexts 64 / 128): uncapped 0.780 / 0.787 ms, 96 0.774 / 0.780, 80 (88 bytes of spills at four slices)
# 0.831 / 0.836 (results/gpu/engine_h200_dev/knob_ab_k3_h100_00cf04e_log.txt). A knob, read at launch.
MERGE_MAXNREG: int | None = 96
# The M = 1 grid, ``(max rows, programs an SM, max weights a tile)``: a tile's rows (BLOCK_N) start at the first and
# halve while the grid has fewer programs an SM than the second; its K width is the whole row up to the third over
# the rows. A knob, read at each launch (``benchmarks/gpu/knob_ab.py``). At Qwen3-0.6B's shapes, 8K weights a tile
# keep the QKV and gate/up GEMVs' 16 rows in two K steps of 512: 76 registers at sm_90 instead of 128, three
# programs an SM instead of two, so the gate/up GEMV's 384 programs run as one wave instead of ~1.45. Batch-1 ITL on
# the H200 0.750 → 0.726 ms at context 128, 0.847 → 0.830 at 2,048 (interleaved, every round; on H100s −3.4 to
# −5.7 % in three runs); ``(16, 1.8, 4096)`` (four K steps), 32-row and 8-row tiles were slower
# (docs/gpu-engine.md). On the Llama-3.2-1B shape, whose GEMVs it gives twice the K steps (up to 8), it costs 0.6 %
# (0.966 → 0.972 ms, two runs); SmolLM2's tiles are unchanged.
M1_GRID: tuple[int, float, int] = (16, 1.8, 8192)
# K steps of an M = 1 PDL program's weights fetched before it waits for x: 1, or 2 where its range has two (the
# second step's tile in flight during the wait too, at the cost of its registers: 80 against 76 at sm_90, three
# programs an SM either way). A knob, read at each launch. 2 since its A/B (H100, 84c2ae3, 6 interleaved rounds in
# each build order, the same tokens): batch-1 ITL 0.788 → 0.755 and 0.782 → 0.762 ms at context 128, 0.905 → 0.883
# and 0.900 → 0.888 at 2,048 (results/gpu/engine_h200_dev/knob_ab_prefetch_*_h100_84c2ae3.json).
PDL_PREFETCH_STEPS = 2


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 1
    pdl: bool = False  # programmatic dependent launch (Hopper); dense M = 1 only, see the module docstring


@triton.jit
def _mul_rn(a, b, ASM: tl.constexpr):
    """``a · b`` in fp32 rounded on its own (never contracted into an FMA with a following add); ``ASM``: through
    PTX ``mul.rn`` (a GPU only), which the assembler never fuses; else a plain product (the interpreter and a
    kernel compiled without FP fusion do not fuse either)."""
    if ASM:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True,
                                         pack=1)  # fmt: skip
    else:
        return a * b


@triton.jit
def _add_rn(a, b, ASM: tl.constexpr):
    """``a + b`` in fp32 (``_mul_rn``'s counterpart: PTX ``add.rn`` with ``ASM``)."""
    if ASM:
        return tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True,
                                         pack=1)  # fmt: skip
    else:
        return a + b


@triton.jit
def merge_slices(acc_ws_ptr, ml_ws_ptr, rows, row_mask, cols, col_mask, n_active, d_pad, MAX_S: tl.constexpr,
                 ASM: tl.constexpr):  # fmt: skip
    """The split-KV decode attention's merge of ``n_active`` (≤ ``MAX_S``) slices for a tile of heads:
    ``o[r, c] = Σ_s 2^(m_s − M) acc_s[c] / Σ_s 2^(m_s − M) l_s``, head r's slice s at workspace row ``rows[r] + s``
    (``paged_attention._finish_rows``). The sums run in slice order, each product and sum rounded on its own, so
    the attention (``_merge_last``, up to ``DEFER_MAX_SLICES`` slices) and the output projection's GEMV
    (``decode_attention_o_proj``) merge bit for bit alike. The loads bypass L1 (``.cg``: the attention's other
    programs wrote the partials during this kernel). Rows outside ``row_mask`` come out 0."""
    top = tl.where(row_mask, -float("inf"), 0.0)
    for s in tl.static_range(MAX_S):
        live = row_mask & (s < n_active)
        m = tl.load(ml_ws_ptr + (rows + s) * 2, mask=live, other=-float("inf"), cache_modifier=".cg")
        top = tl.maximum(top, m)
    for s in tl.static_range(MAX_S):
        live = row_mask & (s < n_active)
        m = tl.load(ml_ws_ptr + (rows + s) * 2, mask=live, other=-float("inf"), cache_modifier=".cg")
        l_s = tl.load(ml_ws_ptr + (rows + s) * 2 + 1, mask=live, other=0.0, cache_modifier=".cg")
        a = tl.load(acc_ws_ptr + (rows + s)[:, None] * d_pad + cols[None, :], mask=live[:, None] & col_mask[None, :],
                    other=0.0, cache_modifier=".cg")  # fmt: skip
        w = tl.where(live, tl.exp2(m - top), 0.0)
        num_s = _mul_rn(a, w[:, None], ASM)
        den_s = _mul_rn(l_s, w, ASM)
        if s == 0:
            num = num_s
            den = den_s
        else:
            num = _add_rn(num, num_s, ASM)
            den = _add_rn(den, den_s, ASM)
    return num / tl.where(row_mask, den, 1.0)[:, None]


@triton.jit
def _deferred(ctx_ptr, n_splits, min_slice, att_block_n, MAX_S: tl.constexpr):
    """How many slices a one-sequence decode attention left unmerged (0: it merged or wrote x itself): its slice
    count as the attention cuts it (``paged_attention._slice_of``) from the sequence's context length, when from 2
    to ``MAX_S``. The length was written before the step's first kernel (the attention reads it before waiting for
    its producer, too), so a PDL launch reads it before ``gdc_wait``: the merge's loads then need no extra
    dependent trip."""
    ctx = tl.load(ctx_ptr).to(tl.int32)
    per_split = tl.maximum(tl.cdiv(tl.cdiv(ctx, n_splits), att_block_n) * att_block_n, min_slice)
    n_active = tl.cdiv(ctx, per_split)
    return tl.where((n_active >= 2) & (n_active <= MAX_S), n_active, 0)


@triton.jit
def _x_or_merged(x_ptr, k0, k_hi, deferred, acc_ws_ptr, ml_ws_ptr, n_splits, d_pad, BLOCK_K: tl.constexpr,
                 HEAD_DIM: tl.constexpr, MAX_S: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
    """x[k0 : k0 + BLOCK_K] (fp32) where x is a one-sequence decode attention's output
    (``paged_attention.decode_attention_o_proj``): ``deferred`` slices (``_deferred``) left unmerged are merged
    here, head by head of the chunk (``BLOCK_K`` a multiple of ``HEAD_DIM``), and rounded to x's dtype; with none
    (one slice, or more than ``MAX_S``, which the attention merged itself) the attention wrote x."""
    if deferred > 0:
        H: tl.constexpr = BLOCK_K // HEAD_DIM
        head = k0 // HEAD_DIM + tl.arange(0, H)
        c = tl.arange(0, HEAD_DIM)
        o = merge_slices(acc_ws_ptr, ml_ws_ptr, head * n_splits, head * HEAD_DIM < k_hi, c, c < HEAD_DIM, deferred,
                         d_pad, MAX_S, ASM)  # fmt: skip
        xv = tl.reshape(o.to(x_ptr.dtype.element_ty).to(tl.float32), (BLOCK_K,))
    else:
        k = k0 + tl.arange(0, BLOCK_K)
        xv = tl.load(x_ptr + k, mask=k < k_hi, other=0.0).to(tl.float32)
    return xv


@triton.jit
def _x_chunk(x_ptr, res_ptr, nw_ptr, rstd, k, km, K, GLU: tl.constexpr, NORM: tl.constexpr, RES: tl.constexpr):
    """x[k] as fp32; with ``GLU`` x is a fused gate/up row of 2·K and the chunk is its SwiGLU, rounded to x's
    dtype exactly where ``swiglu.silu_and_mul`` rounds (so the fused GEMV reads the bits that kernel writes);
    with ``NORM`` the chunk is ``rms_norm(x + residual)`` (``rstd`` from ``_norm_rstd``), rounded where
    ``rms_norm.add_rms_norm`` rounds; without ``RES`` (no residual) ``rms_norm(x)``."""
    act_ty = x_ptr.dtype.element_ty
    if GLU:
        g = tl.load(x_ptr + k, mask=km, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + K + k, mask=km, other=0.0).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(act_ty).to(tl.float32)
        return (s * u).to(act_ty).to(tl.float32)
    if NORM:
        h = tl.load(x_ptr + k, mask=km, other=0.0).to(tl.float32)
        if RES:
            h = (h + tl.load(res_ptr + k, mask=km, other=0.0).to(tl.float32)).to(act_ty).to(tl.float32)
        normed = (h * rstd).to(act_ty).to(tl.float32)
        return (normed * tl.load(nw_ptr + k, mask=km, other=0.0).to(tl.float32)).to(act_ty).to(tl.float32)
    return tl.load(x_ptr + k, mask=km, other=0.0).to(tl.float32)


@triton.jit
def _norm_rstd(
    x_ptr, res_ptr, res_out_ptr, K, eps, write, NORM: tl.constexpr, BLOCK_K: tl.constexpr, RES: tl.constexpr
):
    """With ``NORM``: ``1 / sqrt(mean(h²) + eps)`` of the row ``h = x + residual`` (rounded to x's dtype, as
    ``add_rms_norm`` forms it), which the program where ``write`` holds also stores to ``res_out``; without
    ``RES``, of ``h = x`` (stored nowhere). Every program reads the whole row (a few KB, from L2) before its own
    tile. Without ``NORM``: 1."""
    if NORM:
        act_ty = x_ptr.dtype.element_ty
        ss = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            km = k < K
            hf = tl.load(x_ptr + k, mask=km, other=0.0).to(tl.float32)
            if RES:
                h = (hf + tl.load(res_ptr + k, mask=km, other=0.0).to(tl.float32)).to(act_ty)
                tl.store(res_out_ptr + k, h, mask=km & write)
                hf = h.to(tl.float32)
            ss += hf * hf
        return tl.math.rsqrt(tl.sum(ss, axis=0) / K + eps)
    return 1.0


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    out_ptr,
    ws_ptr,
    cnt_ptr,
    res_ptr,
    nw_ptr,
    res_out_ptr,
    eps,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    k_per_split,
    split_k,
    mg_acc_ptr,
    mg_ml_ptr,
    mg_ctx_ptr,
    mg_splits,
    mg_min_slice,
    mg_block_n,
    mg_d_pad,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    W_BITS: tl.constexpr,
    USE_DOT: tl.constexpr,
    SPLIT: tl.constexpr,
    IEEE: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PDL: tl.constexpr,
    GLU: tl.constexpr = False,
    EARLY: tl.constexpr = False,
    EARLY2: tl.constexpr = False,
    NORM: tl.constexpr = False,
    RES: tl.constexpr = True,
    MERGE: tl.constexpr = False,
    MERGE_ASM: tl.constexpr = False,
    MG_HEAD_DIM: tl.constexpr = 1,
    MG_MAX_S: tl.constexpr = 1,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    m = tl.arange(0, BLOCK_M)
    m_mask = m < M
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    x_ty = x_ptr.dtype.element_ty
    if USE_DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    elif W_BITS == 4:
        acc2 = tl.zeros([BLOCK_N, BLOCK_K // 2], dtype=tl.float32)
    else:
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)

    loop_start = k_lo
    write_res = (pid_n == 0) & (pid_k == 0)  # NORM: the one program that stores the residual sum
    if EARLY:  # dense, M = 1: fetch the first weight tile(s) before waiting for the producer of x (PDL)
        if PDL:
            gdc_launch_dependents()
        k = k_lo + tl.arange(0, BLOCK_K)
        km = k < k_hi
        w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & km[None, :], other=0)
        if EARLY2:  # the second K step's tile too (the host asks only where there is one)
            k2 = k + BLOCK_K
            km2 = k2 < k_hi
            w2 = tl.load(w_rows + k2[None, :], mask=n_mask[:, None] & km2[None, :], other=0)
        if MERGE:
            deferred = _deferred(mg_ctx_ptr, mg_splits, mg_min_slice, mg_block_n, MG_MAX_S)
        if PDL:
            gdc_wait()
        rstd = _norm_rstd(x_ptr, res_ptr, res_out_ptr, K, eps, write_res, NORM, BLOCK_K, RES)
        if MERGE:
            xv = _x_or_merged(x_ptr, k_lo, k_hi, deferred, mg_acc_ptr, mg_ml_ptr, mg_splits, mg_d_pad, BLOCK_K,
                              MG_HEAD_DIM, MG_MAX_S, MERGE_ASM)  # fmt: skip
        else:
            xv = _x_chunk(x_ptr, res_ptr, nw_ptr, rstd, k, km, K, GLU, NORM, RES)
        acc2 += w.to(tl.float32) * xv[None, :]
        loop_start = k_lo + BLOCK_K
        if EARLY2:  # the loop's next step, in its order: the same sums
            acc2 += w2.to(tl.float32) * _x_chunk(x_ptr, res_ptr, nw_ptr, rstd, k2, km2, K, GLU, NORM, RES)[None, :]
            loop_start = k_lo + 2 * BLOCK_K
    else:
        rstd = _norm_rstd(x_ptr, res_ptr, res_out_ptr, K, eps, write_res, NORM, BLOCK_K, RES)
        if MERGE:
            deferred = _deferred(mg_ctx_ptr, mg_splits, mg_min_slice, mg_block_n, MG_MAX_S)

    for k0 in tl.range(loop_start, k_hi, BLOCK_K, num_stages=NUM_STAGES):
        if W_BITS == 4:
            # byte j of a row packs columns 2j (low nibble) and 2j+1 (high nibble), each stored as q + 8
            j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            jm = 2 * j < k_hi
            b = tl.load(w_rows + j[None, :], mask=n_mask[:, None] & jm[None, :], other=0).to(tl.int32)
            lo = ((b & 15) - 8).to(tl.float32)
            hi = ((b >> 4) - 8).to(tl.float32)
            if USE_DOT:
                k = k0 + tl.arange(0, BLOCK_K)
                xt = tl.load(
                    x_ptr + m[:, None] * stride_xm + k[None, :], mask=m_mask[:, None] & (k < k_hi)[None, :], other=0.0
                )
                w = tl.interleave(lo, hi).to(x_ty)
                acc = tl.dot(xt, tl.trans(w), acc)
            else:
                xe = tl.load(x_ptr + 2 * j, mask=jm, other=0.0).to(tl.float32)
                xo = tl.load(x_ptr + 2 * j + 1, mask=jm, other=0.0).to(tl.float32)
                acc2 += lo * xe[None, :] + hi * xo[None, :]
        else:
            k = k0 + tl.arange(0, BLOCK_K)
            km = k < k_hi
            w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & km[None, :], other=0)
            if USE_DOT:
                xt = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=m_mask[:, None] & km[None, :], other=0.0)
                wt = tl.trans(w.to(tl.float32).to(x_ty))  # int8 → fp32 → x dtype: exact for |q| ≤ 128
                if IEEE:
                    acc = tl.dot(xt, wt, acc, input_precision="ieee")
                else:
                    acc = tl.dot(xt, wt, acc)
            else:
                if MERGE:
                    xv = _x_or_merged(x_ptr, k0, k_hi, deferred, mg_acc_ptr, mg_ml_ptr, mg_splits, mg_d_pad,
                                      BLOCK_K, MG_HEAD_DIM, MG_MAX_S, MERGE_ASM)  # fmt: skip
                else:
                    xv = _x_chunk(x_ptr, res_ptr, nw_ptr, rstd, k, km, K, GLU, NORM, RES)
                acc2 += w.to(tl.float32) * xv[None, :]

    if not USE_DOT:
        acc = tl.sum(acc2, axis=1)[None, :]  # BLOCK_M == 1
    if W_BITS != 16:
        acc = acc * tl.load(scale_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]

    out_mask = m_mask[:, None] & n_mask[None, :]
    out_ptrs = out_ptr + m[:, None] * stride_om + n[None, :]
    out_ty = out_ptr.dtype.element_ty
    if SPLIT:
        tile = m[:, None] * N + n[None, :]
        tl.store(ws_ptr + pid_k * M * N + tile, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is stored before the release below
        arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == split_k - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(0, split_k):
                total += tl.load(ws_ptr + s * M * N + tile, mask=out_mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptrs, total.to(x_ty).to(out_ty), mask=out_mask)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)
    else:
        tl.store(out_ptrs, acc.to(x_ty).to(out_ty), mask=out_mask)  # rounded as x's dtype, stored as out's


def default_config(M: int, N: int, K: int, w_bits: int, device: torch.device) -> GemvConfig:
    """The shape heuristic (from the H200 sweep in docs/kernels.md).

    M = 1: as many output rows per program as still leave ~2 programs per SM (``M1_GRID``), and the K range in
    tiles of ≤ 8K elements (one or two at Qwen3-0.6B's shapes), each program's loads all in flight at once;
    split-K only when even one row per program leaves SMs idle. Hopper launches it with PDL.
    M > 1: 32-column tensor-core tiles, K pipelined 3 deep, split-K up to 2 programs per SM.
    """
    if M > 1:
        block_n, block_k = 32, min(128, max(32, next_pow2(K)))
        return GemvConfig(block_n, block_k, split_for(N, K, block_n, block_k, device), 4, 3)
    sms = num_sms(device)
    block_n, per_sm, tile = M1_GRID
    while block_n > 1 and cdiv(N, block_n) < per_sm * sms:
        block_n //= 2
    block_k = min(max(32, next_pow2(K)), max(32, tile // block_n))
    warps = 8 if block_n * block_k >= 8192 else 4
    # split-K only where the grid falls short of a wave (of the knob's fraction of one, when it asks for less)
    split = 1 if cdiv(N, block_n) >= min(1.0, per_sm) * sms else split_for(N, K, block_n, block_k, device)
    return GemvConfig(block_n, block_k, split, warps, 1, pdl=w_bits == 16 and supports_pdl(device))


def split_for(N: int, K: int, block_n: int, block_k: int, device: torch.device) -> int:
    """Split K until there are ≥ 2 programs per SM (never more slices than K tiles)."""
    n_blocks = cdiv(N, block_n)
    target = 2 * num_sms(device)
    return 1 if n_blocks >= target else min(cdiv(K, block_k), cdiv(target, n_blocks))


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor | None,
    w_bits: int,
    out: torch.Tensor | None,
    config: GemvConfig | None,
    glu: bool = False,
    norm: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float] | None = None,
    merge: tuple | None = None,
) -> torch.Tensor:
    """Launcher shared by the dense and quantized entry points. ``weight`` holds K/2 bytes per row for int4.
    ``glu``: x is a fused gate/up projection (M = 1, dense) whose SwiGLU is the GEMV's input.
    ``norm = (residual, norm_weight, residual_out, eps)``: the input is ``rms_norm(x + residual)`` (M = 1,
    dense), and ``x + residual`` is stored to ``residual_out``; ``residual`` and ``residual_out`` None: the input
    is ``rms_norm(x)``. ``out`` may be fp32 where x is not: y rounded to x's dtype, stored widened (the LM head's
    logits, with no cast kernel after it). ``merge = (acc_ws, ml_ws, context_lens, n_splits, min_slice, block_n,
    head_dim, d_pad, max_slices)``: x is a one-sequence decode attention's output that may have been left as up to
    ``max_slices`` unmerged slices in those workspaces (``paged_attention.decode_attention_o_proj``; M = 1, dense)."""
    K = x.shape[-1] // 2 if glu else x.shape[-1]
    x2 = rows_2d(x)
    M, N = x2.shape[0], weight.shape[0]
    require(M <= MAX_M, f"the GEMV handles at most {MAX_M} rows, got {M}")
    require(not glu or (M == 1 and w_bits == 16 and x.shape[-1] % 2 == 0), "the SwiGLU GEMV is dense, M = 1")
    require(norm is None or (M == 1 and w_bits == 16 and not glu), "the RMSNorm GEMV is dense, M = 1")
    require(
        merge is None or (M == 1 and w_bits == 16 and not glu and norm is None and x.is_contiguous()),
        "the merging GEMV is dense, M = 1",
    )
    has_res = True
    if norm is not None:
        res, nw, res_out, eps = norm
        has_res = res is not None
        if not has_res:
            res = res_out = x2  # unused (RES=False)
        for name, t in (("residual", res), ("norm weight", nw), ("residual_out", res_out)):
            require(t.numel() == K and t.dtype == x.dtype and t.is_contiguous(), f"{name} must be ({K},) like x")
        require(
            not has_res or res_out.data_ptr() not in (x.data_ptr(), res.data_ptr()), "residual_out must be a new buffer"
        )
    else:
        res = nw = res_out = x2  # unused (NORM=False)
        eps = 0.0
    require(weight.stride(1) == 1, "weight needs a unit stride along K")
    require(weight.shape[1] == (K // 2 if w_bits == 4 else K), "weight and x disagree on K")
    if w_bits == 4:
        require(K % 2 == 0, "int4 weights need an even K")
    if out is None:
        out = torch.empty((*x.shape[:-1], N), dtype=x.dtype, device=x.device)
    require(
        out.shape == (*x.shape[:-1], N) and out.dtype in (x.dtype, torch.float32) and out.stride(-1) == 1, "bad out"
    )
    out2 = out.view(-1, N)
    if M == 0 or N == 0:
        return out
    cfg = config or default_config(M, N, K, w_bits, x.device)
    k_per_split = cdiv(cdiv(K, cfg.split_k), cfg.block_k) * cfg.block_k
    split = cdiv(K, k_per_split)
    n_blocks = cdiv(N, cfg.block_n)
    use_dot = M > 1
    early = cfg.pdl and not use_dot and w_bits == 16  # the PDL program order, also where PDL itself is off
    pdl = early and use_pdl(x)
    if split > 1:
        ws = cached_empty("gemv.partials", split * M * N, torch.float32, x.device)
        cnt = cached_zeros("gemv.counters", n_blocks, torch.int32, x.device)
    else:
        ws = cnt = out2  # unused (SPLIT=False)
    if merge is not None:
        mg_acc, mg_ml, mg_ctx, mg_splits, mg_min, mg_bn, mg_d, mg_d_pad, mg_max = merge
        require(cfg.block_k % mg_d == 0, "the merging GEMV's K tiles must hold whole heads")
    else:
        mg_acc = mg_ml = mg_ctx = out2  # unused (MERGE=False)
        mg_splits = mg_min = mg_bn = mg_d = mg_d_pad = mg_max = 1
    _gemv_kernel[(n_blocks, split)](
        x2,
        weight,
        scales if scales is not None else weight,
        out2,
        ws,
        cnt,
        res,
        nw,
        res_out,
        eps,
        M,
        N,
        K,
        x2.stride(0),
        weight.stride(0),
        out2.stride(0),
        k_per_split,
        split,
        mg_acc,
        mg_ml,
        mg_ctx,
        mg_splits,
        mg_min,
        mg_bn,
        mg_d_pad,
        BLOCK_M=16 if use_dot else 1,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        W_BITS=w_bits,
        USE_DOT=use_dot,
        SPLIT=split > 1,
        IEEE=x.dtype == torch.float32,
        NUM_STAGES=cfg.num_stages,
        PDL=pdl,
        GLU=glu,
        EARLY=early,
        EARLY2=early and PDL_PREFETCH_STEPS >= 2 and merge is None and k_per_split > cfg.block_k,
        NORM=norm is not None,
        RES=has_res,
        MERGE=merge is not None,
        MERGE_ASM=merge is not None and x.is_cuda,
        MG_HEAD_DIM=mg_d,
        MG_MAX_S=mg_max,
        num_warps=cfg.num_warps,
        launch_pdl=pdl,
        **({"maxnreg": MERGE_MAXNREG} if merge is not None and MERGE_MAXNREG and x.is_cuda else {}),
    )
    return out


def linear(
    x: torch.Tensor, weight: torch.Tensor, *, out: torch.Tensor | None = None, config: GemvConfig | None = None
) -> torch.Tensor:
    """``x @ weight.T`` for ``x: (M, K)`` with M ≤ 16, ``weight: (N, K)``; returns ``(M, N)`` in x's dtype (or in
    ``out``, which may be fp32)."""
    require(weight.dtype == x.dtype, "weight and x must share a dtype")
    return gemv(x, weight, None, 16, out, config)


def silu_and_mul_linear(
    gate_up: torch.Tensor, weight: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``linear(silu_and_mul(gate_up), weight)``: the MLP's SwiGLU and down projection. One row (batch-1
    decode): one GEMV whose x loads compute the SwiGLU of the fused gate/up row, so the (1, I) activation never
    exists and the layer has one launch fewer (at M = 1 each launch costs ~1.5 µs of fixed time, more than the
    SwiGLU's bytes). Other shapes: the SwiGLU kernel, then ``linear.linear``."""
    rows = gate_up.numel() // gate_up.shape[-1] if gate_up.shape[-1] else 0
    if rows == 1 and weight.dtype == gate_up.dtype:
        return gemv(gate_up, weight, None, 16, out, None, glu=True)
    from .linear import linear as dense_linear
    from .swiglu import silu_and_mul

    return dense_linear(silu_and_mul(gate_up), weight, out=out)


def add_rms_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(linear(rms_norm(r), weight), r)`` with ``r = x + residual``: a decoder layer's residual add and
    RMSNorm feeding its next projection. One row (batch-1 decode): one GEMV whose every program forms ``r`` and
    its ``rstd`` from the row (a few KB, from L2) and normalises its x chunks as it loads them; one program
    writes ``r``. The norm's launch and its (1, H) output are gone. With ``residual`` None (a model's first layer)
    ``r`` is x itself and nothing is stored. Other shapes: ``rms_norm.add_rms_norm`` (or ``rms_norm``), then
    ``linear.linear``."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    res_ok = residual is None or (residual.dtype == x.dtype and residual.is_contiguous())
    same = res_ok and norm_weight.dtype == x.dtype and weight.dtype == x.dtype
    if rows == 1 and same and x.is_contiguous():
        if residual is None:
            return gemv(x, weight, None, 16, out, None, norm=(None, norm_weight.contiguous(), None, eps)), x
        r = torch.empty_like(x)
        return gemv(x, weight, None, 16, out, None, norm=(residual, norm_weight.contiguous(), r, eps)), r
    from .linear import linear as dense_linear
    from .rms_norm import add_rms_norm, rms_norm

    if residual is None:
        normed, r = rms_norm(x, norm_weight, eps), x
    else:
        normed, r = add_rms_norm(x, residual, norm_weight, eps)
    return dense_linear(normed, weight, out=out), r
