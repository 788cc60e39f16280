"""L2 prefetch of weights a batch-1 decode layer is about to read: HBM works while the attention waits on latency.

Formula
    None: ``l2_prefetch(*tensors)`` changes no value. It asks the GPU's L2 to fetch the bytes of up to four
    contiguous tensors from HBM now (reference ``ops.l2_prefetch``, which does nothing); the kernels that read
    them next find them in L2 or already on their way.

Why
    At batch 1 a Qwen3-0.6B layer reads 31 MB of weights, 8.7 µs of HBM time at the 3.6 TB/s the H200 streams,
    but takes ~20 µs: five kernels in a dependent chain, each paying launch, ramp-up and tail, and the attention
    between the QKV and the output projection (~4.6 µs at context 128) reads only a few hundred KB, so the HBM
    idles through it. Issued right after the QKV GEMV, the prefetch streams the output projection's, the MLP's
    and (``next``) the next layer's QKV weights while the attention runs; the GEMVs after it then read from L2.
    L2 holds 50 MB on the H200: one layer's weights (31 MB) fit, two do not, so the window never reaches past the
    next layer's QKV. No value depends on it: a prefetch that arrives late only costs what the load would have.

Program mapping
    A 1-D grid of ``P`` one-warp programs. Each tensor's bytes are cut into ``CHUNK``-byte chunks (the last one
    shorter, a multiple of 16), and lane ``l`` of program ``p`` issues chunks ``p·32 + l``, ``+ P·32``, … of
    every tensor: one ``cp.async.bulk.prefetch.L2.global`` each (Hopper's bulk-copy unit fetches the range; the
    instruction has no completion to wait for). Lanes past a tensor's last chunk repeat the last chunk, which is
    harmless, instead of branching.

Coalescing
    Not a load: each instruction names a contiguous range of ``CHUNK`` bytes (32 KB: a few thousand instructions
    for a layer), so the memory system sees whole lines in address order.

Precision
    No arithmetic on values; the tensors are only addressed as bytes.

PDL
    Launched with programmatic dependent launch, the program signals ``launch_dependents`` first (the attention
    kernel after it may start), issues its prefetches, which depend on nothing, and waits for the kernel before
    it only at the end, so that a PDL kernel after it that waits on it also waits on everything before it.

Trade-offs
    - The bulk prefetch (one instruction per 32 KB) rather than ``prefetch.global.L2`` per 128-byte line (256
      instructions per 32 KB) or loads whose results are discarded (which hold registers until they return,
      and which the compiler may remove).
    - A kernel of its own rather than extra programs inside the attention kernel: one launch more, overlapped
      by PDL, and the attention kernel keeps its grid.
    - Off the GPU (the interpreter has no inline assembly) the launcher returns without launching: there is no
      L2 to warm.
    - Only at batch 1: with more rows the GEMVs are longer and stream their weights at full bandwidth themselves.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ._common import cdiv, num_sms, require, use_pdl

__all__ = ["CHUNK_BYTES", "LINE_BYTES", "l2_prefetch"]

CHUNK_BYTES = 8 * 1024  # a bulk prefetch's range
LINE_BYTES = 128
LANES = 32  # one warp a program
MAX_TENSORS = 4


@triton.jit
def _prefetch_range(base, nbytes, pid, nprog, CHUNK: tl.constexpr, BLOCK: tl.constexpr, LINES: tl.constexpr):
    n_chunks = tl.cdiv(nbytes, CHUNK)
    for c0 in range(pid * BLOCK, n_chunks, nprog * BLOCK):
        c = tl.minimum(c0 + tl.arange(0, BLOCK), n_chunks - 1)  # past the end: the last chunk again
        off = c.to(tl.int64) * CHUNK
        if LINES:  # one 128-byte line per element, from the load/store unit
            tl.inline_asm_elementwise(
                "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;",
                "=r,l",
                [base + off],
                dtype=tl.int32,
                is_pure=False,
                pack=1,
            )
        else:  # CHUNK bytes per element, from the SM's bulk-copy unit
            size = tl.minimum(nbytes - off, CHUNK).to(tl.int32)
            tl.inline_asm_elementwise(
                "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;",
                "=r,l,r",
                [base + off, size],
                dtype=tl.int32,
                is_pure=False,
                pack=1,
            )


@triton.jit
def _l2_prefetch_kernel(
    p0,
    n0,
    p1,
    n1,
    p2,
    n2,
    p3,
    n3,
    COUNT: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    LINES: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    _prefetch_range(p0, n0, pid, nprog, CHUNK, BLOCK, LINES)
    if COUNT > 1:
        _prefetch_range(p1, n1, pid, nprog, CHUNK, BLOCK, LINES)
    if COUNT > 2:
        _prefetch_range(p2, n2, pid, nprog, CHUNK, BLOCK, LINES)
    if COUNT > 3:
        _prefetch_range(p3, n3, pid, nprog, CHUNK, BLOCK, LINES)
    if PDL:  # the chain's order: a kernel that waits on this one also waits on the one before it
        gdc_wait()


def l2_prefetch(*tensors: torch.Tensor, lines: bool = False, pdl: bool | None = None) -> None:
    """Ask L2 to fetch the bytes of up to four contiguous tensors (16-byte aligned, a multiple of 16 bytes
    each); changes nothing. ``lines``: one ``prefetch.global.L2`` per 128-byte line instead of bulk prefetches of
    ``CHUNK_BYTES``. ``pdl``: launch as part of a PDL chain (default: where PDL is on; off for a launch on a side
    stream, which nothing waits on). One one-warp program per SM. A no-op off the GPU and for an empty list."""
    require(len(tensors) <= MAX_TENSORS, f"l2_prefetch takes at most {MAX_TENSORS} tensors, got {len(tensors)}")
    for t in tensors:
        require(t.is_contiguous(), "l2_prefetch needs contiguous tensors")
        nbytes = t.numel() * t.element_size()
        require(t.data_ptr() % 16 == 0 and nbytes % 16 == 0, "l2_prefetch needs 16-byte aligned, 16-byte sized ranges")
    tensors = tuple(t for t in tensors if t.numel())
    if not tensors or not tensors[0].is_cuda:
        return None
    device = tensors[0].device
    require(all(t.device == device for t in tensors), "l2_prefetch needs its tensors on one device")
    sizes = [t.numel() * t.element_size() for t in tensors]
    chunk, block = (LINE_BYTES, 8 * LANES) if lines else (CHUNK_BYTES, LANES)
    programs = max(1, min(num_sms(device), cdiv(max(cdiv(n, chunk) for n in sizes), block)))
    args: list = []
    for i in range(MAX_TENSORS):
        t = tensors[i] if i < len(tensors) else tensors[0]
        args += [t.view(-1).view(torch.uint8), sizes[i] if i < len(tensors) else 0]
    chain = use_pdl(tensors[0]) if pdl is None else (pdl and use_pdl(tensors[0]))
    _l2_prefetch_kernel[(programs,)](
        *args,
        COUNT=len(tensors),
        CHUNK=chunk,
        BLOCK=block,
        LINES=lines,
        PDL=chain,
        num_warps=1,
        launch_pdl=chain,
    )
    return None
