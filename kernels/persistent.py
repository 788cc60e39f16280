"""Persistent batch-1 MLP: one launch for a decoder layer's second half, two phases split by a grid barrier.

Formula
    ``r = x + residual``; ``gu = rms_norm(r) · w_norm @ W_guᵀ`` (the fused gate/up projection, 2·F values);
    ``y = silu(gu[:F]) · gu[F:] @ W_downᵀ``. Returns ``(y, r)``, bit for bit what ``gemv.add_rms_norm_linear``
    followed by ``gemv.silu_and_mul_linear`` return (the same prologue helpers and roundings; CPU tests).

Why (a probe, not dispatched)
    At batch 1 the layer is ~27 µs on the H200 (the decode graph back to back at context 128) for ~30 MB of
    weights, 8.3 µs at its read bandwidth: the rest is what each of the layer's five kernel boundaries costs
    (launch, ramp-up, the dependent wait, tail) even with PDL. A persistent kernel that walks the layer with grid
    barriers instead of launches is the design behind the fastest published batch-1 decoders. Before building the
    whole layer that way, this kernel measures the premise on the two GEMVs of the MLP: is one barrier cheaper than
    one PDL kernel boundary? ``benchmarks/gpu/persistent_mlp_probe.py`` times it against the engine's two GEMVs
    on the GPU, on 28 layers' worth of distinct weights (no L2 reuse).

Program mapping
    One program per SM (``programs``), each walking tiles ``pid, pid + P, …``:
    - phase A: ``[BLOCK_A, H]`` tiles of ``W_gu`` (16 rows × the whole K = H, as the engine's GEMV at these
      shapes); every program first forms ``r`` and its ``rstd`` from the row (a few KB from L2), program 0 stores
      ``r``; each tile's rows go to ``gu`` rounded to x's dtype;
    - the barrier: each program's first phase-B weight tile is loaded *before* it (weights never depend on
      phase A), then ``_grid_sync``: a release add on a device counter, then acquire reads until all P programs
      have arrived (one thread a program, ``tl.debug_barrier`` around it: the acquire and the CTA barrier order
      every thread's later loads of ``gu``, which other SMs wrote in this launch, after those writes, as a
      cooperative-groups grid sync does);
    - phase B: ``[BLOCK_B, F]`` tiles of ``W_down`` (4 rows × F), the SwiGLU formed from ``gu`` as it loads;
    - at the end each program counts itself out on a second counter; the last one resets both, so the next launch
      (or CUDA-graph replay) starts from zero without a memset.
    Every program must be resident at once or the barrier never opens: P ≤ the SM count, one program an SM.

Interpreter
    The interpreter runs programs one after another, so a barrier over several programs would wait forever. The
    CPU tests run the fused form with one program (it walks every tile, passes its own barrier and resets the
    counters) and the two-launch form (``fused=False``: phase A, then phase B, no barrier) with several.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ._common import cached_zeros, cdiv, next_pow2, num_sms, require, use_pdl
from .gemv import _norm_rstd, _x_chunk

__all__ = ["mlp_decode"]


@triton.jit
def _grid_sync(cnt_ptr, target):
    """Wait until ``target`` programs have arrived at ``cnt_ptr`` (this one included). Stores before it are
    visible to every program after it (release add, acquire reads at GPU scope)."""
    tl.debug_barrier()  # every thread of this program has issued its stores
    tl.atomic_add(cnt_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _weight_tile(w_ptr, t, N, k, km, K, BLOCK: tl.constexpr):
    """Rows ``[t·BLOCK, (t + 1)·BLOCK)`` of an ``(N, K)`` row-major weight at columns ``k`` (zeros past either end)."""
    n = t * BLOCK + tl.arange(0, BLOCK)
    return tl.load(w_ptr + n.to(tl.int64)[:, None] * K + k[None, :], mask=(n < N)[:, None] & km[None, :], other=0)


@triton.jit
def _gemv_tiles(w_ptr, out_ptr, xv, first, pid, n_prog, N, k, km, K, BLOCK: tl.constexpr):
    """``out = W · x`` over this program's row tiles ``pid, pid + n_prog, …``; ``first`` is its first tile,
    already loaded. Each value rounded to out's dtype."""
    for t in range(pid, tl.cdiv(N, BLOCK), n_prog):
        if t == pid:
            w = first
        else:
            w = _weight_tile(w_ptr, t, N, k, km, K, BLOCK)
        n = t * BLOCK + tl.arange(0, BLOCK)
        acc = tl.sum(w.to(tl.float32) * xv[None, :], axis=1)
        tl.store(out_ptr + n, acc.to(out_ptr.dtype.element_ty), mask=n < N)


@triton.jit
def _mlp_kernel(
    x_ptr,
    res_ptr,
    nw_ptr,
    res_out_ptr,
    wgu_ptr,
    gu_ptr,
    wd_ptr,
    out_ptr,
    sync_ptr,
    eps,
    H,
    F,
    n_prog,
    BLOCK_A: tl.constexpr,
    BLOCK_B: tl.constexpr,
    KA: tl.constexpr,
    KB: tl.constexpr,
    PHASE_A: tl.constexpr,
    PHASE_B: tl.constexpr,
    SYNC: tl.constexpr,
    RES: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pid = tl.program_id(0)
    if PHASE_A:
        ka = tl.arange(0, KA)
        kam = ka < H
        w_first = _weight_tile(wgu_ptr, pid, 2 * F, ka, kam, H, BLOCK_A)  # never depends on the last kernel
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        rstd = _norm_rstd(x_ptr, res_ptr, res_out_ptr, H, eps, pid == 0, True, KA, RES)
        xa = _x_chunk(x_ptr, res_ptr, nw_ptr, rstd, ka, kam, H, False, True, RES)
        _gemv_tiles(wgu_ptr, gu_ptr, xa, w_first, pid, n_prog, 2 * F, ka, kam, H, BLOCK_A)
    if PHASE_B:
        kb = tl.arange(0, KB)
        kbm = kb < F
        w_next = _weight_tile(wd_ptr, pid, H, kb, kbm, F, BLOCK_B)
        if PDL and not PHASE_A:  # the two-launch form's second kernel
            gdc_launch_dependents()
            gdc_wait()
        if SYNC:
            _grid_sync(sync_ptr, n_prog)
        xb = _x_chunk(gu_ptr, gu_ptr, gu_ptr, 1.0, kb, kbm, F, True, False, False)  # the SwiGLU of the gu row
        _gemv_tiles(wd_ptr, out_ptr, xb, w_next, pid, n_prog, H, kb, kbm, F, BLOCK_B)
    if SYNC:  # the last program out resets both counters: every program has passed the barrier by then
        out_count = tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu")
        if out_count == n_prog - 1:
            tl.atomic_xchg(sync_ptr, 0)
            tl.atomic_xchg(sync_ptr + 1, 0)


def mlp_decode(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    programs: int | None = None,
    fused: bool = True,
    block_a: int = 16,
    block_b: int = 4,
    cooperative: bool = True,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(silu_and_mul_linear(add_rms_norm_linear(x, residual, norm_weight, eps, w_gate_up)[0], w_down), r)``
    for one row. ``fused``: one launch of ``programs`` programs (default: one an SM) with a grid barrier between
    the phases; else two launches of the same kernel. ``residual`` None: ``r`` is x (a first layer).
    ``cooperative``: the fused form is a cooperative launch, which the driver refuses (instead of the barrier
    hanging) when the programs cannot all be resident. ``pdl``: launched with programmatic dependent launch
    (Hopper; ignored elsewhere), each program's first weight tile loaded before it waits for the previous kernel."""
    H = x.shape[-1]
    F2 = w_gate_up.shape[0]
    require(x.numel() == H and x.is_contiguous(), "mlp_decode takes one contiguous row")
    require(F2 % 2 == 0 and w_gate_up.shape[1] == H, "w_gate_up must be (2·F, H)")
    F = F2 // 2
    require(w_down.shape == (H, F), "w_down must be (H, F)")
    for t in (w_gate_up, w_down, norm_weight):
        require(t.dtype == x.dtype and t.is_contiguous(), "weights must be contiguous, in x's dtype")
    if residual is not None:
        require(residual.shape == x.shape and residual.dtype == x.dtype and residual.is_contiguous(), "bad residual")
    pdl = pdl and use_pdl(x)  # Hopper only (and not while kernels._common.pdl(False) holds)
    P = programs or num_sms(x.device)
    require(P >= 1, "programs must be positive")
    r = torch.empty_like(x) if residual is not None else x
    gu = torch.empty(F2, dtype=x.dtype, device=x.device)
    out = torch.empty_like(x)
    sync = cached_zeros("persistent.mlp_sync", 2, torch.int32, x.device)
    res = residual if residual is not None else x  # unused without a residual (RES=False)
    common = dict(BLOCK_A=block_a, BLOCK_B=block_b, KA=next_pow2(H), KB=next_pow2(F), RES=residual is not None)
    args = (x, res, norm_weight, r, w_gate_up, gu, w_down, out, sync, eps, H, F)
    if fused:
        _mlp_kernel[(P,)](
            *args, P, PHASE_A=True, PHASE_B=True, SYNC=True, PDL=pdl, **common,
            num_warps=8, launch_cooperative_grid=cooperative, launch_pdl=pdl,
        )  # fmt: skip
    else:
        for n_tiles, phase_a in ((cdiv(F2, block_a), True), (cdiv(H, block_b), False)):
            p = min(P, n_tiles)
            _mlp_kernel[(p,)](
                *args, p, PHASE_A=phase_a, PHASE_B=not phase_a, SYNC=False, PDL=pdl, **common,
                num_warps=8, launch_pdl=pdl,
            )  # fmt: skip
    return out, r
