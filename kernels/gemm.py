"""Shape-bucketed GEMM: ``y = x @ Wᵀ`` for prefill-sized M, with one fixed tile config per M bucket.

Formula
    ``y[m, n] = Σ_k x[m, k] · W[n, k]`` for ``x: (M, K)``, ``weight: (N, K)`` → ``(M, N)`` in x's dtype
    (reference ``ops.linear``, i.e. cuBLAS).

Program mapping
    One program per ``[BLOCK_M, BLOCK_N]`` output tile, walking K in ``BLOCK_K`` steps: two tile loads (x rows,
    weight rows — the weight tile is read as ``Wᵀ`` simply by swapping the index roles, no transpose copy) and a
    ``tl.dot`` into an fp32 accumulator; Triton software-pipelines the loads ``num_stages`` deep and, on
    Hopper, lowers the dot to wgmma. Programs are ordered in groups of ``GROUP_M`` row tiles so that
    consecutive programs share weight tiles in L2 ("grouped ordering").

Buckets (exact-shape dispatch without autotuning, so a call never compiles or benchmarks on the hot path):
    M ≤ 64: 64×64×128 tiles, 4 warps; M ≤ 512: 128×128×64, 8 warps; larger: 128×256×64, 8 warps.
    Decode-sized M (≤ 16) belongs to ``gemv.py``.

Coalescing
    Both operands are K-contiguous, so each tile load is BLOCK_K-long contiguous runs per row. Bytes (ideal):
    read ``2(MK + NK)``, write ``2MN``; FLOPs ``2MNK``.

Precision
    bf16/fp16 operands, fp32 accumulation, one rounding at the end (like cuBLAS). fp32 inputs use IEEE fp32 dot
    (no TF32) so CPU tests compare tightly.

Trade-offs tried
    This is a teaching kernel, not dispatched: cuBLAS (with its hand-tuned Hopper kernels, TMA and warp
    specialisation) serves every M above the decode GEMV's in ``linear.py``, and this kernel runs only when
    called (tests, ``benchmarks/kernels/bench_gemm.py``). On the H200 at M = 4096 it reaches 462–520 TFLOP/s,
    68–76 % of the measured 683 TFLOP/s bf16 matmul, and 0.66–0.69× cuBLAS's speed at every Qwen3-0.6B
    projection (0.50× at M = 128): no bucket wins, so none is routed here. The gap is what the module docstring
    lists as missing: TMA loads, warp-specialised producer/consumer warps and a persistent tile scheduler.

The Hopper form (``linear_desc``) and its epilogues
    Tiles through tensor descriptors (TMA), optionally one program an SM walking the tiles (``persistent``) and
    launched with PDL. Plain, it is 0.92–0.99× cuBLAS at Qwen3-0.6B's prefill projections on the H100 (2,048
    rows: QKV 28.9 against 26.9 µs; ``benchmarks/gpu/gemm_sweep.py``), still no reason to route a plain GEMM here.
    What it has that cuBLAS lacks is an epilogue of our own, where two of the prefill's elementwise kernels go:
    - ``gate_up_swiglu`` (the op, accepted for steps of ≥ 1,024 rows): the gate and up tiles of the same columns
      in two accumulators, ``silu(gate) · up`` from fp32, the ``(M, 2I)`` projection never written: 42.2 against
      49.9 µs for cuBLAS + ``silu_and_mul`` at 2,048 rows (1.18×), a 2,048-token TTFT 4 % lower;
    - ``qkv_proj_norm_rope_store_kv`` (experimental): Qwen3's QK-norm, RoPE and KV write on tiles of two whole
      heads, with the rope kernel's roundings; 39.4 against 39.9 µs, its norm + RoPE (~5 µs: the rotation pairs
      ``i, i + D/2`` lie in other threads of the accumulator, so the tile is reshaped and split through shared
      memory) and cache write (~4 µs) eat what the fusion saves.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

from ._common import cdiv, num_sms, require, rows_2d, use_pdl

__all__ = [
    "DESC_GLU_TILES",
    "DESC_QKV_TILES",
    "DESC_TILES",
    "bucket_config",
    "gate_up_swiglu",
    "linear",
    "linear_desc",
    "qkv_proj_norm_rope_store_kv",
]

# The descriptor form's default tiles (``linear_desc``), plain and with the SwiGLU epilogue (BLOCK_N there is each
# half's: a program computes BLOCK_N gate and BLOCK_N up columns). Picked by ``benchmarks/gpu/gemm_sweep.py``.
DESC_TILES = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3}
DESC_GLU_TILES = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3}
# The QKV projection with the QK-norm + RoPE + KV write in the epilogue: 256 columns are two heads of 128
# (the sweep's fastest plain tile at Qwen3-0.6B's QKV shape, 0.93x cuBLAS at 2,048 rows on the H100).
DESC_QKV_TILES = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3}
# Whether that kernel's persistent tile loop is flattened (the K loop pipelined across tiles, so the next tile's
# loads overlap this one's epilogue; the epilogue then runs without branches). Read at each call, so a CUDA graph
# keeps what was in force at capture (``benchmarks/gpu/knob_ab.py`` A/Bs it).
QKV_FLATTEN = False


@triton.jit
def _gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_cm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    group_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % group_m
    pid_n = (pid % group) // group_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rm.to(tl.int64)[:, None] * stride_am + rk[None, :]
    b_ptrs = b_ptr + rn.to(tl.int64)[None, :] * stride_bn + rk[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=(rm < M)[:, None] & (rk < k_left)[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=(rk < k_left)[:, None] & (rn < N)[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    c_ptrs = c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])


def bucket_config(M: int) -> dict:
    """Tile config of M's bucket (see the module docstring)."""
    if M <= 64:
        return {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 4}
    if M <= 512:
        return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3}
    return {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3}


def linear(
    x: torch.Tensor, weight: torch.Tensor, *, out: torch.Tensor | None = None, config: dict | None = None
) -> torch.Tensor:
    """``x @ weight.T`` for ``x: (..., K)``, ``weight: (N, K)``; returns ``(..., N)`` in x's dtype."""
    require(weight.dtype == x.dtype, "weight and x must share a dtype")
    require(weight.dim() == 2 and weight.shape[1] == x.shape[-1], "weight must be (N, K)")
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    x2 = rows_2d(x)
    M, K = x2.shape
    N = weight.shape[0]
    if out is None:
        out = torch.empty((*x.shape[:-1], N), dtype=x.dtype, device=x.device)
    require(out.shape == (*x.shape[:-1], N) and out.dtype == x.dtype and out.stride(-1) == 1, "bad out")
    out2 = out.view(-1, N)
    if M == 0 or N == 0:
        return out
    cfg = dict(config or bucket_config(M))
    grid = (cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"]),)
    _gemm_kernel[grid](
        x2,
        weight,
        out2,
        M,
        N,
        K,
        x2.stride(0),
        weight.stride(0),
        out2.stride(0),
        IEEE=x.dtype == torch.float32,
        **cfg,
    )
    return out


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _tile_origin(tile, num_m, num_n, GROUP_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The first row and column of output tile ``tile`` in grouped order: ``GROUP_M`` row tiles walk the columns
    together, so consecutive tiles share weight tiles in L2."""
    group = GROUP_M * num_n
    first_m = (tile // group) * GROUP_M
    group_m = tl.minimum(num_m - first_m, GROUP_M)
    return (first_m + (tile % group) % group_m) * BLOCK_M, ((tile % group) // group_m) * BLOCK_N


@triton.jit
def _gemm_desc_kernel(
    a_desc,
    b_desc,
    c_desc,
    M,
    N,
    K,
    up_row,
    programs,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    STAGES: tl.constexpr,
    GLU: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
    FLATTEN: tl.constexpr = False,
    WS: tl.constexpr = False,
):
    # tiles in grouped order, each program walking tiles pid, pid + programs, ... (one each when the grid has
    # every tile; persistent when it has one program an SM). GLU: weight rows [n, n + BLOCK_N) are the gate's and
    # rows up_row + n ... the up projection's; the output is silu(gate) · up, N columns (gate rows past N read
    # the up rows, but their columns are outside c_desc and never stored; up rows past the weight load as zeros)
    if PDL:  # see _common.use_pdl: x is the previous kernel's output
        gdc_launch_dependents()
        gdc_wait()
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # programs: the grid size. FLATTEN: the compiler pipelines the K loop across tiles, so a persistent program
    # loads its next tile while it runs this one's epilogue; WS: producer warps issue those loads
    for tile in tl.range(tl.program_id(0), num_m * num_n, programs, flatten=FLATTEN, warp_specialize=WS):
        om, on = _tile_origin(tile, num_m, num_n, GROUP_M, BLOCK_M, BLOCK_N)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N if GLU else 16], dtype=tl.float32)
        for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            a = a_desc.load([om, k])
            acc = _dot(a, b_desc.load([on, k]).T, acc, IEEE)
            if GLU:
                acc_up = _dot(a, b_desc.load([up_row + on, k]).T, acc_up, IEEE)
        if GLU:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        c_desc.store([om, on], acc.to(c_desc.dtype))


def _desc_rows_ok(x2: torch.Tensor, weight: torch.Tensor, n_out: int) -> bool:
    """Whether tensor descriptors can read ``x2: (M, K)`` and ``weight: (·, K)`` and write ``n_out`` columns: unit
    strides along K, every row starting 16-byte aligned."""
    esize = x2.element_size()
    return (
        x2.stride(1) == 1
        and weight.stride(1) == 1
        and all(v * esize % 16 == 0 for v in (x2.shape[1], n_out, x2.stride(0), weight.stride(0)))
        and x2.data_ptr() % 16 == 0
        and weight.data_ptr() % 16 == 0
    )


def linear_desc(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    glu: bool = False,
    out: torch.Tensor | None = None,
    config: dict | None = None,
    persistent: bool = False,
    pdl: bool = False,
    flatten: bool = False,
    warp_specialize: bool = False,
) -> torch.Tensor:
    """The Hopper form: tiles through tensor descriptors (TMA on the GPU), software-pipelined ``num_stages``
    deep. ``x @ weight.T`` for ``x: (..., K)``, ``weight: (N, K)``; with ``glu`` the MLP's SwiGLU in the epilogue:
    ``weight: (2I, K)`` stacked gate over up (the engine's gate/up projection), returning ``silu(x @ gateᵀ) ·
    (x @ upᵀ): (..., I)`` from the fp32 accumulators (``ops.silu_and_mul(ops.linear(x, weight))`` rounds the
    projection to x's dtype first). ``persistent``: one program an SM walking the tiles; ``pdl``: launched with
    programmatic dependent launch where the GPU has it; ``flatten`` / ``warp_specialize``: the tile loop's
    software pipelining across tiles / producer warps (``benchmarks/gpu/gemm_sweep.py`` times them). Rows of x and
    weight must start 16-byte aligned."""
    require(weight.dtype == x.dtype, "weight and x must share a dtype")
    require(weight.dim() == 2 and weight.shape[1] == x.shape[-1], "weight must be (N, K)")
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    x2 = rows_2d(x)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    M, K = x2.shape
    rows = weight.shape[0]
    require(not glu or rows % 2 == 0, "a gate/up weight has an even number of rows")
    N = rows // 2 if glu else rows
    require(_desc_rows_ok(x2, weight, N), "the descriptor form needs 16-byte-aligned rows")
    if out is None:
        out = torch.empty((*x.shape[:-1], N), dtype=x.dtype, device=x.device)
    require(out.shape == (*x.shape[:-1], N) and out.dtype == x.dtype and out.is_contiguous(), "bad out")
    out2 = out.view(-1, N)
    if M == 0 or N == 0:
        return out
    cfg = dict(config or (DESC_GLU_TILES if glu else DESC_TILES))
    bm, bn, bk = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
    stages = cfg.pop("num_stages")
    tiles = cdiv(M, bm) * cdiv(N, bn)
    grid = (min(tiles, num_sms(x.device)) if persistent else tiles,)
    launch_pdl = pdl and use_pdl(x)
    _gemm_desc_kernel[grid](
        TensorDescriptor(x2, [M, K], [x2.stride(0), 1], [bm, bk]),
        TensorDescriptor(weight, [rows, K], [weight.stride(0), 1], [bn, bk]),
        TensorDescriptor(out2, [M, N], [N, 1], [bm, bn]),
        M,
        N,
        K,
        N if glu else 0,
        grid[0],
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        STAGES=stages,
        GLU=glu,
        IEEE=x.dtype == torch.float32,
        PDL=launch_pdl,
        FLATTEN=flatten,
        WS=warp_specialize,
        num_stages=stages,
        launch_pdl=launch_pdl,
        **cfg,
    )
    return out


def gate_up_swiglu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The op ``gate_up_swiglu`` (reference ``ops.gate_up_swiglu``): the prefill MLP's gate/up projection with the
    SwiGLU in its epilogue, one kernel instead of cuBLAS's GEMM and ``silu_and_mul``, never writing the
    ``(M, 2I)`` projection. Persistent tiles at ``DESC_GLU_TILES``, launched with PDL (it follows the RMSNorm
    kernel, a PDL kernel). Rows that the descriptors cannot read (unaligned) take the reference's two steps.

    On the H100 at Qwen3-0.6B's MLP (``benchmarks/gpu/gemm_sweep.py``, c3748e1): 42.2 µs against 49.9 for cuBLAS +
    ``silu_and_mul`` at 2,048 rows (1.18×), 82.9 against 98.6 at 4,096 (1.19×), 15.7 against 15.1 at 512 (0.96×),
    so the engine calls it from ``model.GATE_UP_SWIGLU_MIN_ROWS`` rows up."""
    if weight.shape[0] % 2 or not _desc_rows_ok(rows_2d(x), weight, weight.shape[0] // 2):
        from kernellab.runtime import ops

        return ops.gate_up_swiglu(x, weight)
    return linear_desc(x, weight, glu=True, persistent=True, pdl=True)


@triton.jit
def _gemm_qkv_rope_kernel(
    a_desc,
    b_desc,
    c_desc,
    pos_ptr,
    cs_ptr,
    qw_ptr,
    kw_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    M,
    N,
    K,
    eps,
    q_cols,
    kv_cols,
    block_size,
    stride_cs,
    stride_cb,
    stride_co,
    stride_ch,
    programs,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    STAGES: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
    FLATTEN: tl.constexpr = False,
    WS: tl.constexpr = False,
    ROPE: tl.constexpr = True,
    CACHE: tl.constexpr = True,
):
    # The QKV projection ``x @ Wᵀ`` (N = q_cols + 2·kv_cols columns: q heads, k heads, v heads, D each) with
    # Qwen3's attention prologue in the epilogue, a tile of BLOCK_N // D whole heads of one kind at a time: the
    # accumulator is rounded to the activation dtype (what the GEMM would store), then q and k heads are
    # RMS-normalised over D and rotated exactly as ``rope._norm_rope_heads`` does (every rounding of the eager
    # reference, so with fp fusion off the values equal the two-kernel path's for equal GEMM outputs); every
    # head is stored back into the QKV rows (q, k rotated in place; v as computed), k and v also into the
    # paged caches at ``slot_ptr`` (slots < 0: padding rows, not cached).
    if PDL:  # see _common.use_pdl: x is the previous kernel's output
        gdc_launch_dependents()
        gdc_wait()
    act_ty = c_desc.dtype
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # programs: the grid size. FLATTEN: the compiler pipelines the K loop across tiles, so a persistent program
    # loads its next tile while it runs this one's epilogue; WS: producer warps issue those loads
    for tile in tl.range(tl.program_id(0), num_m * num_n, programs, flatten=FLATTEN, warp_specialize=WS):
        om, on = _tile_origin(tile, num_m, num_n, GROUP_M, BLOCK_M, BLOCK_N)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            acc = _dot(a_desc.load([om, k]), b_desc.load([on, k]).T, acc, IEEE)
        y = acc.to(act_ty)
        rows = om + tl.arange(0, BLOCK_M)
        pos = tl.load(pos_ptr + rows, mask=rows < M, other=0).to(tl.int64)
        is_q, is_k = on < q_cols, (on >= q_cols) & (on < q_cols + kv_cols)
        if FLATTEN:  # no branch in a flattened loop (sm_90 refuses one): every tile rotates, q and k tiles keep it
            if ROPE:  # (ROPE, CACHE off: the sweep's timing split)
                wq = tl.load(qw_ptr + tl.arange(0, D))
                w = tl.where(is_q, wq, tl.load(kw_ptr + tl.arange(0, D))).to(tl.float32)
                rot = _norm_rope_tile(y, w, pos, cs_ptr, stride_cs, eps, BLOCK_M, BLOCK_N, D)
                y = tl.where(is_q | is_k, rot, y)
        elif ROPE and on < q_cols + kv_cols:  # q or k heads: norm, then RoPE
            w_ptr = qw_ptr if on < q_cols else kw_ptr
            w = tl.load(w_ptr + tl.arange(0, D)).to(tl.float32)
            y = _norm_rope_tile(y, w, pos, cs_ptr, stride_cs, eps, BLOCK_M, BLOCK_N, D)
        c_desc.store([om, on], y)
        if CACHE:  # k or v heads: into the cache too (masked stores: no branch)
            slot = tl.load(slot_ptr + rows, mask=rows < M, other=-1).to(tl.int64)
            cols = tl.arange(0, BLOCK_N)
            row_off = ((slot // block_size) * stride_cb + (slot % block_size) * stride_co)[:, None]
            keep = (slot >= 0)[:, None]
            k_head, v_head = (on - q_cols) // D, (on - q_cols - kv_cols) // D
            k_dst = k_cache_ptr + row_off + ((k_head + cols // D) * stride_ch + cols % D)[None, :]
            v_dst = v_cache_ptr + row_off + ((v_head + cols // D) * stride_ch + cols % D)[None, :]
            tl.store(k_dst, y, mask=keep & is_k)
            tl.store(v_dst, y, mask=keep & (on >= q_cols + kv_cols))


@triton.jit
def _norm_rope_tile(y, w, pos, cs_ptr, stride_cs, eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    """Qwen3's QK-norm and RoPE on a ``[BLOCK_M, BLOCK_N]`` tile of whole heads of D (``y`` in the activation
    dtype; ``w`` the norm weight, fp32; ``pos`` each row's position), with ``rope._norm_rope_heads``' roundings."""
    HEADS: tl.constexpr = BLOCK_N // D
    HALF: tl.constexpr = D // 2
    act_ty = y.dtype
    yf = tl.reshape(y.to(tl.float32), [BLOCK_M, HEADS, D])
    rstd = tl.math.rsqrt(tl.sum(yf * yf, axis=2) / D + eps)[:, :, None]
    yn = ((yf * rstd).to(act_ty).to(tl.float32) * w[None, None, :]).to(act_ty).to(tl.float32)
    x1, x2 = tl.split(tl.permute(tl.reshape(yn, [BLOCK_M, HEADS, 2, HALF]), (0, 1, 3, 2)))
    cs = cs_ptr + pos[:, None] * stride_cs + tl.arange(0, HALF)[None, :]
    cos = tl.load(cs).to(act_ty).to(tl.float32)[:, None, :]
    sin = tl.load(cs + HALF).to(act_ty).to(tl.float32)[:, None, :]
    o1 = ((x1 * cos).to(act_ty).to(tl.float32) - (x2 * sin).to(act_ty).to(tl.float32)).to(act_ty)
    o2 = ((x2 * cos).to(act_ty).to(tl.float32) + (x1 * sin).to(act_ty).to(tl.float32)).to(act_ty)
    return tl.reshape(tl.permute(tl.join(o1, o2), (0, 1, 3, 2)), [BLOCK_M, BLOCK_N])


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
    *,
    config: dict | None = None,
    persistent: bool = True,
    epilogue: tuple[bool, bool] = (True, True),
    flatten: bool | None = None,
    warp_specialize: bool = False,
) -> torch.Tensor:
    """The op ``qkv_proj_norm_rope_store_kv`` (reference ``ops.qkv_proj_norm_rope_store_kv``): Qwen3's QKV
    projection of a prefill step's rows with the QK-norm, RoPE and the KV-cache write in its epilogue, one kernel
    instead of cuBLAS's GEMM and ``qk_norm_rope_store_kv``. Returns the ``(M, (Hq + 2·Hk)·D)`` rows, q and k
    rotated in place, which the prefill attention reads as strided views. Persistent tiles of two heads at
    ``DESC_QKV_TILES`` (``config``, ``persistent``: others, for tests and the sweep; ``epilogue``: (norm + RoPE,
    cache write), both off only to time the parts, ``benchmarks/gpu/gemm_sweep.py``), launched with PDL. Takes the
    reference's two steps where the epilogue cannot: a cache in another dtype than x's (the 8-bit caches), V
    transposed within its blocks, heads that a 256-column tile does not hold whole, unaligned rows."""
    from kernellab.runtime import ops

    from .kv_cache import check_layout

    M, K = x.shape
    D = k_cache.shape[-1]
    q_cols, kv_cols = num_heads * D, num_kv_heads * D
    N = q_cols + 2 * kv_cols
    cfg = dict(config or DESC_QKV_TILES)
    bn = max(cfg.pop("BLOCK_N"), D)
    fused = (
        k_cache.dtype == x.dtype
        and v_cache.dtype == x.dtype
        and not check_layout(k_cache, v_cache)
        and weight.shape == (N, K)
        and q_cols % bn == 0
        and kv_cols % bn == 0
        and bn % D == 0
        and D & (D - 1) == 0
        and _desc_rows_ok(x, weight, N)
        and cos_sin_cache.stride(1) == 1
    )
    if not fused:
        return ops.qkv_proj_norm_rope_store_kv(
            x, weight, positions, q_norm_weight, k_norm_weight, eps, cos_sin_cache, k_cache, v_cache, slot_mapping,
            num_heads, num_kv_heads,
        )  # fmt: skip
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    bm, bk, stages = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_K"), cfg.pop("num_stages")
    tiles = cdiv(M, bm) * cdiv(N, bn)
    grid = (min(tiles, num_sms(x.device)) if persistent else tiles,)
    pdl = use_pdl(x)
    _gemm_qkv_rope_kernel[grid](
        TensorDescriptor(x, [M, K], [x.stride(0), 1], [bm, bk]),
        TensorDescriptor(weight, [N, K], [weight.stride(0), 1], [bn, bk]),
        TensorDescriptor(out, [M, N], [N, 1], [bm, bn]),
        positions,
        cos_sin_cache,
        q_norm_weight,
        k_norm_weight,
        k_cache,
        v_cache,
        slot_mapping,
        M,
        N,
        K,
        eps,
        q_cols,
        kv_cols,
        k_cache.shape[1],
        cos_sin_cache.stride(0),
        *k_cache.stride()[:3],
        grid[0],
        D=D,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        STAGES=stages,
        IEEE=x.dtype == torch.float32,
        PDL=pdl,
        ROPE=epilogue[0],
        CACHE=epilogue[1],
        FLATTEN=QKV_FLATTEN if flatten is None else flatten,
        WS=warp_specialize,
        num_stages=stages,
        enable_fp_fusion=False,  # every rounding of the reference's norm and rotation (kernels/rope.py: Precision)
        launch_pdl=pdl,
        **cfg,
    )
    return out
