"""L2 prefetch of the weights a batch-1 decode layer reads next, while the attention waits on latency (rejected).

Formula
    None: ``l2_prefetch(*tensors)`` changes no value. It asks the GPU's L2 to fetch the bytes of up to four
    contiguous tensors from HBM now (reference ``ops.l2_prefetch``, which does nothing); the kernels that read
    them next find them in L2 or already on their way.

Why it was tried
    At batch 1 a Qwen3-0.6B layer reads 31 MB of weights, 8.7 µs of HBM time at the 3.6 TB/s the H200 streams,
    but takes ~20 µs: five kernels in a dependent chain, each paying launch, ramp-up and tail, and the attention
    between the QKV and the output projection (~4.6 µs at context 128) reads only a few hundred KB, so the HBM
    idles through it. Issued right after the QKV GEMV, the prefetch streams the output projection's, the MLP's
    and the next layer's QKV weights (``model.PREFETCH_NEXT_QKV``) while the attention runs, for the GEMVs after
    it to read from L2 (50 MB on the H200: one layer's weights fit, two do not).

Program mapping
    A 1-D grid of at most one one-warp program per SM. Each tensor's bytes are cut into chunks: ``CHUNK_BYTES``
    for a bulk prefetch (``cp.async.bulk.prefetch.L2.global``: the SM's bulk-copy unit fetches the range, and
    the instruction has no completion to wait for) or one 128-byte line for ``lines`` (``prefetch.global.L2``,
    eight per lane per trip). Lane ``l`` of program ``p`` issues chunks ``p·B + l``, ``+ P·B``, … of every
    tensor; lanes past a tensor's last chunk repeat the last chunk, which is harmless, instead of branching.

Coalescing
    Not a load: each instruction names a contiguous range (8 KB, or a line), so the memory system sees whole
    lines in address order.

Precision
    No arithmetic on values; the tensors are only addressed as bytes.

PDL and streams
    In a PDL chain the program signals ``launch_dependents`` first (the attention after it may start), issues
    its prefetches and waits for the kernel before it only at the end, so that a kernel that waits on it also
    waits on everything before it. The model can instead launch it on a side stream that forks after the QKV
    GEMV and joins at the end of the forward (``model.PREFETCH_SIDE_STREAM``), so no kernel of the layer waits
    for it.

Trade-offs (H200, ``benchmarks/gpu/l2_prefetch_ab.py``, interleaved rounds, the same greedy tokens everywhere)
    - Batch-1 ITL at context 128, against 0.768 ms without: bulk prefetches in the PDL chain 2.159 ms (the
      attention waited for every prefetch to land: ~35 µs a layer for 31 MB from a dozen programs); on a side
      stream 0.834 ms (one program per SM); line prefetches on a side stream 1.177, in the chain 1.322.
    - Why it cannot win here: a GEMV whose weight is already in L2 is only ~1.3 µs faster (o_proj 4.8 against
      5.8 µs, gate/up 7.6 against 9.0, event-timed): at these sizes fixed latency, not bandwidth, sets a GEMV's
      time, so the ceiling is ~5 µs a layer, and the prefetch stream's contention with the GEMVs' own loads
      costs more than that. Rejected (``runtime/kernel_status.json``); the way to the 0.7 ms target is fewer
      dependent launches a layer, not more bytes in flight.
    - Off the GPU (the interpreter has no inline assembly) the launcher returns without launching.
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
        require(
            t.data_ptr() % 16 == 0 and t.nbytes % 16 == 0, "l2_prefetch needs 16-byte aligned, 16-byte sized ranges"
        )
    tensors = tuple(t for t in tensors if t.numel())
    if not tensors or not tensors[0].is_cuda:
        return None
    device = tensors[0].device
    require(all(t.device == device for t in tensors), "l2_prefetch needs its tensors on one device")
    sizes = [t.nbytes for t in tensors]
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
