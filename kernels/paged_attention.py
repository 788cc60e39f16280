"""GQA-aware split-KV paged decode attention: one new query token per sequence over its paged KV context.

Formula
    For sequence b and query head h (KV head ``h // G``, ``G = Hq / Hk``):
    ``o[b, h] = Σ_{t < L_b} softmax_t(q[b, h]·K[b, t]·scale) V[b, t]``, where token t of sequence b lives in
    physical block ``block_tables[b, t // bs]`` at offset ``t % bs`` of the caches
    ``(num_blocks, bs, Hk, D)``. ``q: (B, Hq, D)``, ``context_lens: (B,)`` int32 (≥ 1), ``block_tables:
    (B, max_blocks)`` int32 padded with -1 → ``(B, Hq, D)`` (reference ``ops.paged_decode_attention``).

Program mapping
    Grid ``(B, Hk, S)``. A program owns one sequence, one **KV head with all G query heads that share it**
    (GQA: each K/V byte is read once per group, not once per query head), and one of ``S`` equal slices of
    the context ("split-KV"). The G query rows are padded to 16 so both products run on tensor cores:
    ``S = Q·Kᵀ`` is ``[16, D]×[D, BLOCK_N]`` and ``P·V`` is ``[16, BLOCK_N]×[BLOCK_N, D]`` (the padding
    costs only idle tensor-core lanes: the kernel is bandwidth-bound). The program walks its slice in
    ``BLOCK_N``-token tiles; each tile gathers token addresses through the block table (one int32 per token,
    L1-resident), so any block size works, tiles may straddle blocks, and a sequence's blocks can be anywhere.
    Online softmax in the base-2 domain, as in ``attention.py``.

    ``S`` is chosen on the host from B, Hk and an upper bound on the context (``max_context_len`` if given,
    else ``block_tables.shape[1] · bs``: shape-only, so the choice is fixed under CUDA-graph capture): enough
    slices for ~2 programs per SM. Batch 64 × 8 KV heads already gives 512 programs → ``S = 1`` and the kernel
    writes the output directly; batch 1 × 8 KV heads gets up to ``S = 32``. The slices themselves are cut
    inside the kernel from each sequence's real length: ``ceil(L_b / S)`` tokens rounded up to whole tiles, so
    a sequence uses ``n_b = ceil(L_b / slice)`` of its ``S`` programs and the rest exit before any load (a
    decode graph captured for 4,096-token contexts replays at context 128 with 2 working slices, not 32 of
    which 31 published empty partials). With ``n_b > 1`` each working slice writes its unnormalised ``acc``
    plus ``(m, l)`` to an fp32 workspace and bumps a per-(sequence, KV head) counter; the one that arrives
    last merges the ``n_b`` partials (``o = Σ_s 2^(m_s − M) acc_s / Σ_s 2^(m_s − M) l_s``) and resets the
    counter — one launch, no merge kernel; with ``n_b = 1`` it writes the output directly. Batches of mixed
    lengths cost what their real tokens cost.

Coalescing
    A token's K row for one KV head is D contiguous elements (256 B at D = 128 bf16): every 32-byte sector
    fetched is used. Bytes: read ``2·Σ_b L_b·Hk·D·2`` (K and V) + q, write ``B·Hq·D·2`` (+ workspace at S > 1).

Precision
    ``Q·Kᵀ`` with bf16 operands and fp32 accumulation; softmax statistics and ``acc`` in fp32; ``P`` rounded
    to the cache dtype for the ``P·V`` dot (as FlashAttention/vLLM do); one rounding of the output. The
    reference does the whole thing in fp32, so bf16 outputs agree to ~1e-2 absolute. An FP8 cache
    (``float8_e4m3fn`` values, one fp32 scale per token and KV head, written by ``kv_cache.store_kv``) is
    read without a dequantize pass: the tile widens exactly to q's dtype for the same tensor-core dots, the
    K scales multiply the score columns and the V scales the probability columns before ``P`` is rounded
    (reference: the same attention over ``fp8 · scale`` in fp32). Bytes per token and head fall from
    ``2·D·2`` to ``2·(D + 4)``. With a bf16 q the tiles may widen to fp16 instead (``FP8_LAUNCH["widen"]``):
    e4m3 → fp16 is one conversion instruction per pair of values where bf16 takes several, every e4m3 value
    is exact in both, and q and ``P`` get fp16's 10 mantissa bits instead of 7; ``P`` goes into its dot as
    ``p · vs · 2^9`` (about p times the token's V amax: clear of fp16's subnormals), and the 2^9 leaves ``acc``
    exactly after the walk. q must then fit fp16's range (|q| < 65,504), as it does after Qwen3's QK-norm and in
    the Llama models served here. An int8 cache (the same layout and scales, values ``round(x · 127 / amax)``)
    widens exactly to fp16 too; on a GPU it does so by byte permutes (``_I8X4_TO_F16X4``: flip the sign bits, put
    each byte under the exponent of 1,024, subtract 1,152 from both halves of a register) instead of one I2F
    conversion per value, whose pipe runs at a quarter of the integer rate.

    The int8 cache as the engine lays it out (V transposed within its blocks, ``kv_cache.py``) is not widened at
    all (``_attend_tile_i8``, ``INT8_LAUNCH["mma"]``): both products are int8 tensor-core dots of the bytes as
    stored, with int32 sums. q is held in 16-bit fixed point per head (``q16 = round(q · 32,512 / amax)``) as two
    int8 halves, ``q16 = 256 · hi + lo``, so ``q16 · k = 256 · (hi · k) + lo · k`` exactly; the scores are that
    sum times q's step, the softmax scale and the K scales. The probabilities times the V scales go into ``P·V``
    the same way, in 16-bit fixed point per row of each tile (the step is the row's largest value over 32,512),
    and ``acc`` takes the int32 result times that step. Both operands then carry 15 bits against their row's
    largest value where the fp16 widening gave q and ``P`` 11 significant bits: the error against the reference
    is no larger (CPU tests). The dots' reduction runs along the operands' contiguous dimension, which an 8-bit
    dot needs: D for ``q·Kᵀ``, and for ``P·V`` the tokens, hence V's layout; a tile is whole blocks, each
    block's ``block_size`` tokens of a dimension one run of bytes (``_load_tile_i8``). Compiled for sm_90 the
    loop issues 7.7 instructions a token (985 per 128-token tile; the widened int8 form 13.1, the bf16 cache's
    7.6) in 166 registers instead of 224, with no byte-wise shared-memory reads left
    (``benchmarks/kernels/sass_loop.py``). At the 64-token tiles ``INT8_LAUNCH`` now takes (see "Occupancy of the
    int8 dots"), 11.5 a token in 128 registers (results/kernels/sass_decode_attention.json; 12.0 before the
    fixed-point halves were split with integer shifts instead of float floors, the same values): more issue slots
    a token, more CTAs an SM to hide the copies' latency.

Trade-offs tried
    (H200 sweeps in ``benchmarks/kernels/bench_attention.py``, figures in docs/kernels.md.) At batch 64 × 1,024
    one slice per sequence (66.5 µs, 88.6 % of the read bandwidth) beat 2 and 4 slices (75, 77 µs): extra
    waves were worth less than the merge traffic. The price is paid by mixed lengths: 64 sequences of
    1–2,048 tokens reach 63.8 % with one slice each (the longest sequences set the time) against 73.5 % with
    two slices in the first run. Batch 1 × 4,096 is latency-bound: 16.8 MB is 3.7 µs of
    HBM time, but each slice is a chain of dependent memory trips (block table → K/V gather → publish the
    partial → merge) on top of the ~1.5 µs launch floor. The first version (a separate merge kernel) took
    11.5 µs for 16–64 slices; merging in the last-arriving slice instead (this version, chosen to save the
    launch) measured 12.7 µs at 32 slices and 15.4 µs at 64: the fence + atomic + re-read handshake costs
    more than a launch, as it did for split-K in ``gemv.py``. Both miss the 50 % target (29–32 %). What
    would move it: prefetching the block-table entries of all tiles at kernel start, PDL to hide the launch,
    or leaving the merge to a kernel that runs anyway (fused into the o_proj GEMV's prologue). One program
    per query head (no GQA grouping) would read K/V G times.

    8-bit caches (H200 sweeps, ``benchmarks/gpu/decode_attention_sweep.py``; results/gpu/engine_h200_dev/
    decode_attention_sweep_*.json). At 256 × 1,024 the FP8 and int8 kernels take ~260 µs like the bf16 one (255
    µs, 4.2 TB/s) although they read half the bytes: 58 % of the read bandwidth for theirs. Compiled for sm_90
    (SASS counts, ``ptxas -v``), their loop issues ~1.5× the bf16 loop's instructions per token and needs 222
    registers against 114 (two CTAs per SM instead of four), and the K tile, the dot's transposed operand, comes
    out of shared memory a byte per instruction. What was tried: widening int8 by byte permutes (kept: 305 → 262
    µs, the same error); scores as K·qᵀ with the tile as the first operand (wgmma from registers; 6 % fewer
    instructions, yet 260 → 278 µs for FP8 and no gain for bf16: dropped); q quantized to int8 per head so the
    scores are an int8 dot of the tile as stored (245 µs, 7 % faster, but 8× the output error, 6.9e-3 against
    8.7e-4: dropped); the int8 conversion marked impure so the compiler keeps it on the tile as loaded (16-byte
    shared-memory reads, the fp16 tiles staged for ldmatrix: no byte loads left, but 103 KB of shared memory;
    262 → 282 µs, offline −8 % against −4 %: dropped); 64-token tiles, 8 warps, 3-4 stages (all slower or equal).
    What would move it: V stored transposed within a block, so both operands load in wide rows without staging,
    or a dot with 8-bit operands for P·V too. Both are now the int8 cache's form (see "Precision"); its H200
    timing is the next sweep's (``benchmarks/gpu/decode_attention_sweep.py`` times it against the widened form
    and runs the offline workload on both layouts side by side).

    Occupancy of the int8 dots (H100, ``ncu`` at 256 × 1,024; results/gpu/engine_h200_dev/
    decode_attention_ncu_h100_f78f42e.txt). At 128-token tiles in 2 stages the form reached 67 % of DRAM
    bandwidth against the bf16 cache's 89 %: 168 registers and 41 KB of shared memory left three CTAs an SM
    (18.75 % occupancy), and Triton gives the gathered K/V tile one shared buffer at 2-4 stages alike (the
    sm_90 TTGIR), so a CTA issues its next tile's copies only after its current tile's dots. 64-token tiles in
    3 stages (128 registers, 23 KB: four CTAs an SM; the third stage reads the block table a tile ahead of the
    copies) took 264 → 242 µs and the offline workload +7.3 % (``INT8_LAUNCH``). Loading V as one ``[D,
    BLOCK_N]`` tile, its 16-byte runs declared to the compiler (``tl.max_contiguous``), instead of per-block runs
    permuted in registers cut the loop from 986 to 861 instructions but ran slower (295 against 279 µs under
    ncu, with 35 % of its reads hitting L2 against 6 %): dropped.

    Several KV heads a program (``_paged_decode_i8_heads_kernel``, ``INT8_LAUNCH["pack_heads"]``). Qwen3's
    groups of 2 leave 14 of the dots' 16 rows padding, and the softmax's elementwise work runs on all 16: with
    ``heads_per_program`` heads a program their rows fill them (8 heads of 2), each head's dots see the others'
    rows as zeros, and the loop issues 3.0-3.9 instructions per token and head instead of 12.0, its copies
    4-8× the bytes a tile. H100 (results/gpu/engine_h200_dev/decode_attention_sweep_h100_eae6b8c.json): at 256 ×
    1,024 222 against 243 µs (32-token tiles, 4 warps), even at 256 × 384, but slower where fewer programs
    fill the card (64 × 1,024: 93 against 73 µs; 128 × 2,048: 242 against 230): its 152 registers and 103 KB
    of shared memory leave two CTAs an SM, and B programs (split to ~2 an SM) are few. So it runs only for
    launches of 256 rows or more (``pack_min_rows``), 8 heads in 32-token tiles, 2 stages: the offline workload
    gained 4.6 % over the one-head form in an interleaved A/B on the H100 (20,267 → 21,201 tok/s, every round;
    results/gpu/engine_h200_dev/decode_attention_sweep_pack256_h100_30fa041.json).

    Why the packed loop waits, and one dot a product (tried at 82ee2ef, removed). Compiled for sm_90 at 32-token
    tiles and 4 warps (results/kernels/sass_decode_attention.json) the loop above holds 41 barriers a tile: each
    of its 8 heads' dots selects that head's operand rows inside the loop and changes the result's layout through
    shared memory. ncu on the H100 at 256 × 1,024 (results/gpu/engine_h200_dev/
    decode_attention_ncu_packed_h100_82ee2ef.txt) shows where its time goes: 12 % occupancy (two CTAs of 4 warps an
    SM, 150 registers), 10.2 cycles between a warp's instructions, 46 % of them waiting on loads, and 80 % of DRAM
    bandwidth (210.9 µs; the bf16 kernel 88 %, 364.6 µs). The tried form put the 8 heads side by side in the score
    columns, ``[16, 8 · BLOCK_N]``: one pair of int8 dots for ``q·Kᵀ`` against the heads' K rows gathered as ``[8 ·
    BLOCK_N, D]``, each row masked to its own head's columns before the softmax, and the probabilities as they came
    out into one pair for ``P·V``. 13 barriers a tile instead of 41, but the softmax and the fixed-point split ran
    on 8× the elements, 1,137 loop instructions against 949 in 254 registers against 156. Timed on the H100
    (``decode_attention_sweep.py --packed``, results/gpu/engine_h200_dev/
    decode_attention_sweep_packed_h100_82ee2ef.json): slower at every tile setting, best 229.5 against 219.1 µs at
    256 × 1,024 and 106.3 against 104.8 at 256 × 384 (16- and 32-token tiles), 70.7 % of DRAM bandwidth under ncu
    against 79.6; the offline workload within the rounds' spread (23,259 against 23,188 and 23,472 tok/s for the
    current launch run twice, 2 rounds each). No gain on the complete workload: removed.

    Loading a tile's small loads ahead by hand (tried on the CPU only, at a68dd29, not kept): the packed loop's
    scale gathers are already copied a stage ahead (4-byte ``cp.async``, the compiler's pipelining); what it loads
    at the tile is the block table, whose ids the next tile's copies wait for with two stages. Carrying the block
    ids two tiles ahead as loop values made the compiler stop pipelining the K and V copies altogether (plain
    16-byte loads and shared-memory stores, 93 barriers a tile); carrying only the scales ahead kept the copies
    pipelined but moved work the compiler already did (983 loop instructions against 946). Neither was worth a GPU
    run.

    One block a tile through tensor descriptors (``_paged_decode_i8_tma_kernel``, ``INT8_LAUNCH["tma"]``, the
    default where ``tma_ready``: the engine's int8 cache takes 64-token blocks). K's ``[bs, D]`` and V's ``[D, bs]``
    boxes are TMA copies; the block id comes a tile ahead as a loop value, so the copies depend on no load of their
    iteration and the pipeliner may buffer them (two buffers at 3 stages). H100 (results/gpu/engine_h200_dev/
    decode_attention_sweep_int8_tma_bs64_h100_0decfa7.json): ~2.5 % under the pointer form at the same blocks, best
    at 2 stages (``tma_launch``; 128 × 1,024 113.6 against 116.3 µs); the engine at 64-token blocks through it
    +4.35 % offline against 16-token blocks and the pointer forms (docs/gpu-engine.md).

    Shared operands, selected results (``INT8_LAUNCH["pack_select"]``, 2026-12-07). Most of the 41 barriers come
    from the masking: each head's ``where`` on q's halves and on P's halves makes a new operand, and each one
    changes layout through shared memory. With every row in each head's dots and the head's rows picked from the
    int32 result (a ``where`` in the accumulator's layout, no shared memory), q's halves convert once for the whole
    walk and P's once a tile; the sums are the same integers, so the output is the same bits. sm_90 SASS (32-token
    tiles, 4 warps): 857 loop instructions against 949, 12 barriers against 41, 42 ldmatrix against 112, 75 KB of
    shared memory against 103, but 176 registers against 156 (``pack_select`` 1); summing the halves in one dot's
    accumulator (hi's product times 256 as the lo dot's start, 2) takes 166 registers, under the 168 of three CTAs
    an SM, for 987 instructions. ncu on an H100 at 256 × 1,024 (results/gpu/engine_h200_dev/
    decode_attention_ncu_packsel_h100_6067fea.txt): 234.1 and 233.4 µs against the masked form's 222.1, with 17 %
    occupancy against 12 % but 72 % of DRAM bandwidth against 75.6 %. Three CTAs an SM leave the launch's 512
    programs (256 sequences in 2 slices) at 1.29 waves, the masked form's two at 1.94; ``pack_splits`` fixes the
    packed launches' slices (3: 768 programs, 1.94 waves of three), which the next sweep times.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

from . import gemv as _gemv_module
from ._common import cached_empty, cached_zeros, cdiv, next_pow2, num_sms, require, use_pdl
from .gemv import gemv as _gemv
from .gemv import merge_slices
from .kv_cache import check_cache, check_layout, v_transposed
from .rope import _norm_rope_heads

__all__ = [
    "decode_attention_o_proj",
    "heads_per_program",
    "num_splits",
    "paged_decode_attention",
    "paged_decode_attention_qk_norm_rope",
    "tma_ready",
]

_LOG2E = 1.4426950408889634
# Launch settings of the bf16/fp16/fp32 caches' decode attention, and of the FP8 cache's ("widen": the dtype its
# tiles widen to for the tensor-core dots of a bf16 q; see "Precision"). The FP8 choice is the H200 sweep's best
# (results/gpu/engine_h200_dev/fp8_decode_sweep_3240917.json, 36 settings at the gate's shapes): fp16, 128-token
# tiles, 4 warps, 2 stages took 256 × 1,024 from 394 to 280 µs and 64 × 1,024 from 136 to 77 µs, with a third of
# the error, and the offline workload with the FP8 cache from 16,649 to 21,322 tok/s (+28 %, interleaved).
LAUNCH = {"block_n": 64, "num_warps": 4, "num_stages": 2}
# 2^9: P·V's fp16 operand is p·vs·2^9 (see "Precision"); acc gives it back after the walk
_P_SCALE = tl.constexpr(512.0)
# The largest 16-bit fixed-point value the int8 form's operands take: 127 · 256, so both int8 halves fit
_I16_TOP = tl.constexpr(32512.0)
FP8_LAUNCH = {"block_n": 128, "num_warps": 4, "num_stages": 2, "widen": "f16"}
# The int8 cache's. "mma": with V transposed within its blocks (the engine's int8 layout, kv_cache.py) the tiles
# skip widening altogether and go into int8 tensor-core dots as stored (``_attend_tile_i8``); "widen" and "i8_asm"
# apply to the other layout only ("i8_asm": on a GPU its tiles widen to fp16 by byte permutes and one fp16x2
# subtraction per pair (_widen_8bit) instead of a conversion instruction per value: H200, 256 × 1,024, 305 → 262
# µs, the same error; results/gpu/engine_h200_dev/decode_attention_sweep_e2b0cad.json). 64-token tiles in 3
# stages: the loop is latency-bound (ncu on the H100: 67 % of DRAM bandwidth, 18.75 % occupancy at 128-token
# tiles in 2 stages, 168 registers, three CTAs an SM); 64-token tiles take 128 registers (four CTAs an SM) and the
# third stage loads the block table a tile ahead of the K/V copies: 256 × 1,024 264 → 242 µs and the offline
# workload +7.3 % (18,411 → 19,753 tok/s, interleaved, H100; results/gpu/engine_h200_dev/
# decode_attention_sweep_h100_587dfab_run3.json).
# "pack_heads": with "mma", up to this many KV heads a program (``_paged_decode_i8_heads_kernel``; 0 or 1: one, the
# kernel above); "pack_min_rows": only for launches of at least this many sequences (the form wins at 256 × 1,024
# alone: "Several KV heads a program" above); "pack_launch": the packed launches' own block_n / num_warps /
# num_stages, over the ones above (the settings' offline A/B: "Several KV heads a program" above).
# "pack_select": the packed form's dots take every row and keep each head's rows (1: the 16-bit halves in dots of
# their own; 2: summed in one accumulator; 0: each head's operand rows masked); "pack_splits": the packed launches'
# slices per sequence (0: ``num_splits``, ~2 programs an SM). "tma": with "mma", caches of 32-128-token blocks
# (``tma_ready``) read one block a tile through tensor descriptors (``_paged_decode_i8_tma_kernel``) before any
# packing, with "tma_launch" over the settings above (H100, 64-token blocks: 2 stages best, ~2.5 % under the pointer
# form; the engine's int8 cache at 64-token blocks through it +4.35 % offline against 16-token blocks;
# results/gpu/engine_h200_dev/*_0decfa7.json; at 021b978 with head-major scales +11.8 % offline against the pointer
# forms at the same 64-token blocks). "tma": 2 stacks q's and P's 16-bit halves as the rows of one dot a product
# (half the int8 dots of 1; experimental until its A/B).
INT8_LAUNCH = {
    "block_n": 64,
    "num_warps": 4,
    "num_stages": 3,
    "widen": "f16",
    "i8_asm": True,
    "mma": True,
    "pack_heads": 8,
    "pack_min_rows": 256,
    "pack_launch": {"block_n": 32, "num_stages": 2},
    "tma": True,
    "tma_launch": {"num_stages": 2},
}
# Four int8 (one 32-bit register) → four fp16 (two), exactly: flip the sign bits (x + 128, offset binary), set
# each byte as the low half of an fp16 whose high byte is 0x64 (the value 1024 + x + 128, as 1024's ulp is 1),
# subtract 1152 from both halves. PRMT and LOP3 run on the integer pipes at 4× the rate of I2F.
_I8X4_TO_F16X4 = tl.constexpr(
    "{\n"
    ".reg .b32 u, lo, hi, hb, off;\n"
    "xor.b32 u, $2, 0x80808080;\n"
    "mov.b32 hb, 0x64646464;\n"
    "prmt.b32 lo, u, hb, 0x5140;\n"
    "prmt.b32 hi, u, hb, 0x7362;\n"
    "mov.b32 off, 0x64806480;\n"
    "sub.f16x2 $0, lo, off;\n"
    "sub.f16x2 $1, hi, off;\n"
    "}"
)
# The fewest context tokens one slice takes (see "Trade-offs tried"): below it, publishing a partial and merging
# it costs more than walking a few more tiles in the same program.
MIN_SLICE_TOKENS = 64
# The fused QK-norm + RoPE form is compiled without FMA contraction, keeping every rounding of rope.py (its
# "Precision"); True lets the backend contract the whole kernel's multiply-adds (the gate's A/B setting).
ROPE_FP_FUSION = False
# The last slice merges up to this many slices one by one (``gemv.merge_slices``: per slice a few scalar loads and
# one row load per thread, no cross-thread reduction) and more as one reduction over the ``[S_PAD, D]`` tile of
# every slice the launch could have (S_PAD: 64 at batch 1 on 132 SMs, whatever the context). It also bounds
# ``gemv.DEFER_MAX_SLICES`` (deferred slices are merged the same way, bit for bit). 16: batch-1 ITL at context 512
# (nine slices) 0.843 against 0.858 ms at 4 (H100, both orders; results/gpu/engine_h200_dev/
# knob_ab_k7_h100_ba95c7e_log.txt); 64 would take 255 registers and spill (sm_90 compile). A knob, read at launch.
SEQ_MERGE_SLICES = 16
# Contexts of more than ``SEQ_MERGE_SLICES`` slices (batch 1 past ~1,024 tokens: 32 slices at 2,048) are merged as
# one reduction over the slices' tile; with ``SEQ_MERGE_CHUNKS`` > 1, up to that many times ``SEQ_MERGE_SLICES``
# are merged slice by slice instead, one unrolled chunk of ``SEQ_MERGE_SLICES`` at a time (``_merge_chunked``: the
# registers of one chunk). 1 (the tile) until its batch-1 A/B at context 2,048; a knob, read at launch.
SEQ_MERGE_CHUNKS = 1
# The split-KV decode attention cuts contexts until its grid has about this many programs an SM (``num_splits``):
# at batch 1 on 132 SMs and Qwen3-0.6B's 8 KV heads, 2 gives 32 slices of 64 tokens at context 2,048, 1 gives 16 of
# 128. 1 was slower on the H100 (batch-1 ITL 0.955 against 0.906 ms at context 2,048, 0.871 against 0.835 at
# 1,024: more programs each reading less beat the slice-by-slice merge;
# results/gpu/engine_h200_dev/knob_ab_programs_per_sm_p2_h100_2fc2cd6.json); more than 2 cuts no finer at a 4,096-token
# bound (slices are whole 64-token tiles). A knob, read at launch.
PROGRAMS_PER_SM = 2
# Length balance for batches whose (sequence, KV head) programs already fill the card (``num_splits`` gives them one
# slice each): a launch's time is then its longest sequences' walk, and in a batch of mixed lengths (the offline
# workload: contexts of ~100 to ~2,000 tokens in one step) the last long programs run alone at the end. With
# ``BALANCE_SLICE_TOKENS`` > 0 such launches take up to ``BALANCE_MAX_SPLITS`` slices, each at least that many
# tokens: a context shorter than it keeps one slice (the others exit at once), a longer one is cut into slices of
# ~ctx / splits and merged like a batch-1 split. A list-scheduling model of the offline workload's full-batch steps
# (``benchmarks/kernels/decode_balance_model.py``, results/kernels/decode_balance_model.json: 528 concurrent programs,
# a CPU model that overstates the gain, since a program left alone at a tail runs faster on the GPU) puts those
# launches 6-13 % under one slice at 512 tokens and 3 splits, by what an idle program costs. Knobs, read at launch
# (a CUDA graph keeps its capture's): ``BALANCE_SLICE_TOKENS`` for the bf16/fp16 and FP8 caches (0, off),
# ``BALANCE_SLICE_TOKENS_INT8`` for the int8 one (512).
# The int8 cache's offline A/Bs (3 interleaved rounds each, every round faster): +2.0 % on an H100 at d840afb, +2.2
# and +2.3 % at 84c2ae3 in both build orders (26,243 → 26,823 and 26,247 → 26,838 tok/s); a 256-row step of equal
# short contexts, where idle slices only cost, 1.8-2.7 % slower. The bf16 cache showed no gain in its one run (H200,
# a116037: 20,848 → 20,752), so it stays off there (docs/gpu-engine.md).
BALANCE_SLICE_TOKENS = 0
BALANCE_SLICE_TOKENS_INT8 = 512
BALANCE_MAX_SPLITS = 3
# Whether a slice of the fused (QK-norm + RoPE) form with no tokens to read still waits for its producer (the QKV
# projection) before it exits. Not needed for order: every sequence has an active slice, which waits, so the grid
# still ends after its producer. But a waiting idle slice holds its SM's registers (20K at Qwen3-0.6B's shapes) for
# the whole QKV projection: at batch 1 and context 128, 232 of the 256 programs are idle, and the output
# projection's PDL programs can only be resident, and fetch their weights before their own wait, where registers
# are free (the rejected decode_attention_o_proj showed that residency costing 2-6 %). False lets idle slices exit
# at once. Unmeasured; a knob, read at launch.
IDLE_SLICES_WAIT = True


@triton.jit
def _load_tile(table, t0, end, k_cache_ptr, v_cache_ptr, block_size, stride_cb, stride_co, stride_ch, hk, d, d_mask,
               BLOCK_N: tl.constexpr, stride_vcb=0, stride_vch=0, V_T: tl.constexpr = False):  # fmt: skip
    """The K and V rows of context tokens ``t0 .. t0 + BLOCK_N - 1`` below ``end`` for KV head ``hk``, gathered
    through the block table; also the tokens, their mask and their blocks (an FP8 cache's scales sit by block).
    ``V_T``: V is transposed within its blocks (strides ``stride_vcb, stride_vch``; kv_cache.py), read here a
    byte at a time (the int8 form that reads it whole is ``_load_tile_i8``)."""
    t = t0 + tl.arange(0, BLOCK_N)
    t_mask = t < end
    block = tl.load(table + t // block_size, mask=t_mask, other=0).to(tl.int64)
    row = block * stride_cb + (t % block_size) * stride_co + hk * stride_ch
    kv_mask = t_mask[:, None] & d_mask[None, :]
    # K and V are both issued before any arithmetic: their latencies overlap instead of adding up
    k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
    if V_T:
        v_row = block * stride_vcb + hk * stride_vch + t % block_size
        v = tl.load(v_cache_ptr + v_row[:, None] + d[None, :] * block_size, mask=kv_mask, other=0.0)
    else:
        v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
    return t, t_mask, block, k, v


@triton.jit
def _load_tile_i8(table, t0, end, k_cache_ptr, v_cache_ptr, stride_cb, stride_co, stride_ch, stride_vcb, stride_vch,
                  hk, d, d_mask, block_size: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr):  # fmt: skip
    """``_load_tile`` for an int8 cache whose V is transposed within its blocks, a tile of whole blocks (``t0`` a
    multiple of ``block_size``, which divides ``BLOCK_N``): K as ``[BLOCK_N, D]`` and V as ``[D, BLOCK_N]``, each
    block's ``block_size`` tokens of one dimension one contiguous run. The block table is read once per block.
    Rows of the last block past ``end`` are loaded too (whole runs load as wide vectors): whatever they hold,
    the caller gives them no weight (their scores are masked, their scales read as 0)."""
    NB: tl.constexpr = BLOCK_N // block_size
    j = t0 // block_size + tl.arange(0, NB)
    j_mask = j * block_size < end
    blocks = tl.load(table + j, mask=j_mask, other=0).to(tl.int64)
    block = tl.reshape(tl.broadcast_to(blocks[:, None], (NB, block_size)), (BLOCK_N,))
    o = tl.arange(0, block_size)
    t = t0 + tl.arange(0, BLOCK_N)
    t_mask = t < end
    row = block * stride_cb + (t % block_size) * stride_co + hk * stride_ch
    k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=t_mask[:, None] & d_mask[None, :], other=0)
    v_runs = blocks[:, None, None] * stride_vcb + hk * stride_vch + d[None, :, None] * block_size + o[None, None, :]
    v3 = tl.load(v_cache_ptr + v_runs, mask=j_mask[:, None, None] & d_mask[None, :, None], other=0)
    vt = tl.reshape(tl.permute(v3, (1, 0, 2)), (D_PAD, BLOCK_N))
    return t, t_mask, block, k, vt


@triton.jit
def _split_i16(x, inv):
    """``round(x · inv)`` (|x · inv| ≤ 32,512) as two int8 halves ``(hi, lo)`` with ``hi · 256 + lo`` equal to it:
    16-bit fixed point for the int8 tensor-core dots, exact in their int32 sums."""
    x16 = tl.floor(x * inv + 0.5).to(tl.int32)  # exact: |x16| ≤ 32,512
    hi = (x16 + 128) >> 8  # arithmetic shift: the floor of the division, negative values too
    return hi.to(tl.int8), (x16 - (hi << 8)).to(tl.int8)


@triton.jit
def _q16(q, qk_scale):
    """q in 16-bit fixed point per row as the int8 dots take it: its two int8 halves and the scores' scale (q's step
    times the softmax scale)."""
    qf = q.to(tl.float32)
    q_step = tl.maximum(tl.max(tl.abs(qf), axis=1), 1e-30) * (1.0 / _I16_TOP)
    q_hi, q_lo = _split_i16(qf, 1.0 / q_step[:, None])
    return q_hi, q_lo, q_step * qk_scale


@triton.jit
def _dot_i16(a_hi, a_lo, b):
    """``(a_hi · 256 + a_lo) @ b`` for int8 operands, as int32: two int8 tensor-core dots."""
    return tl.dot(a_hi, b, out_dtype=tl.int32) * 256 + tl.dot(a_lo, b, out_dtype=tl.int32)


@triton.jit
def _stack_rows(a, b):
    """``[R, C]`` a and b → ``[2R, C]``: a's rows, then b's."""
    R: tl.constexpr = a.shape[0]
    C: tl.constexpr = a.shape[1]
    return tl.reshape(tl.permute(tl.join(a, b), (2, 0, 1)), (2 * R, C))


@triton.jit
def _unstack_i16(x):
    """``[2R, N]`` int32 products of 16-bit halves stacked as rows (``_stack_rows(hi, lo)``) → ``hi · 256 + lo``
    ``[R, N]``. (In the tensor cores' accumulator layout rows r and r + 8 of a 16-row tile sit in one thread.)"""
    R: tl.constexpr = x.shape[0] // 2
    N: tl.constexpr = x.shape[1]
    hi, lo = tl.split(tl.permute(tl.reshape(x, (2, R, N)), (1, 2, 0)))
    return hi * 256 + lo


@triton.jit
def _attend_tile_i8(q_hi, q_lo, s_scale, k, vt, ks, vs, t_mask, m_i, l_i, acc, STACK: tl.constexpr = False):
    """One tile of an int8 cache into the online softmax: scores as ``q16 · k`` (q in 16-bit fixed point per row,
    ``s_scale`` = its step times the softmax scale) times the K scales; ``P·V`` as ``p16 · v`` with the
    probabilities times the V scales in 16-bit fixed point per row of the tile. Both products are int8
    tensor-core dots read straight from the cache's bytes (no widening). ``STACK``: ``q_hi`` holds both halves
    stacked as rows (``_stack_rows(q_hi, q_lo)``, ``q_lo`` unused), and P's halves are stacked likewise, so each
    product is one dot of ``2R`` rows instead of two of ``R`` padded to 16 (a GQA group of 2 fills 2 of 16 rows:
    stacked, 4 of 16 in half the dots), the sums the same integers."""
    if STACK:
        s16 = _unstack_i16(tl.dot(q_hi, tl.trans(k), out_dtype=tl.int32))
    else:
        s16 = _dot_i16(q_hi, q_lo, tl.trans(k))
    s = s16.to(tl.float32) * s_scale[:, None] * ks[None, :]
    s = tl.where(t_mask[None, :], s, -float("inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    pv = p * vs[None, :]
    step = tl.maximum(tl.max(pv, axis=1), 1e-30) * (1.0 / _I16_TOP)
    p_hi, p_lo = _split_i16(pv, 1.0 / step[:, None])
    if STACK:
        pv16 = _unstack_i16(tl.dot(_stack_rows(p_hi, p_lo), tl.trans(vt), out_dtype=tl.int32))
    else:
        pv16 = _dot_i16(p_hi, p_lo, tl.trans(vt))
    acc = acc * alpha[:, None] + pv16.to(tl.float32) * step[:, None]
    return m_new, l_i, acc


@triton.jit
def _widen_8bit(x, dtype: tl.constexpr, I8_ASM: tl.constexpr):
    """An FP8 or int8 tile widened exactly to ``dtype``; with ``I8_ASM`` an int8 tile goes to fp16 through
    ``_I8X4_TO_F16X4`` (a GPU only: the interpreter runs no PTX)."""
    if I8_ASM:
        return tl.inline_asm_elementwise(_I8X4_TO_F16X4, "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)
    else:
        return x.to(dtype)


@triton.jit
def _join_halves(x1, x2, ROWS: tl.constexpr, HALF: tl.constexpr):
    """``[ROWS, HALF]`` first and second halves of head vectors → ``[ROWS, 2·HALF]``."""
    return tl.reshape(tl.permute(tl.join(x1, x2), (0, 2, 1)), (ROWS, 2 * HALF))


@triton.jit
def _attend_tile(q, k, v, ks, vs, t_mask, m_i, l_i, acc, qk_scale, IEEE: tl.constexpr, FP8: tl.constexpr):
    """One tile of keys/values into the online softmax ``(m_i, l_i, acc)`` (base 2); FP8 tiles come widened to q's
    dtype with their per-token scales ``ks``/``vs``."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
    else:
        s = tl.dot(q, tl.trans(k)) * qk_scale
    if FP8:
        s = s * ks[None, :]
    s = tl.where(t_mask[None, :], s, -float("inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    pv = p
    if FP8:
        pv = p * vs[None, :]
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(pv.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _slice_of(ctx, split, n_splits, min_slice, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
    """This program's slice ``[start, end)`` of a ``ctx``-token context and how many of the sequence's slices
    hold tokens. Slices are cut from the sequence's own length, not the launch's bound (the graph's widest
    context): ceil(ctx / S) tokens each, in whole tiles. A short context needs few slices; the rest exit before
    any load and take no part in the merge."""
    if SPLIT:
        per_split = tl.maximum(tl.cdiv(tl.cdiv(ctx, n_splits), BLOCK_N) * BLOCK_N, min_slice)
        n_active = tl.cdiv(ctx, per_split)
    else:
        per_split = ctx
        n_active = 1
    start = split * per_split
    return start, tl.minimum(ctx, start + per_split), n_active


@triton.jit
def _finish_rows(acc, m_i, l_i, b, split, n_active, n_splits, n_q_heads, heads, first_head, row_mask, d, d_mask,
                 counter, out_ptr, stride_ob, stride_oh, acc_ws_ptr, ml_ws_ptr, N_ROWS: tl.constexpr,
                 D_PAD: tl.constexpr, S_PAD: tl.constexpr, SPLIT: tl.constexpr, DEFER: tl.constexpr = 0,
                 SEQ_S: tl.constexpr = 2, SEQ_CHUNKS: tl.constexpr = 1):  # fmt: skip
    """A slice's online-softmax state ``(acc, m_i, l_i)`` for query heads ``heads`` (the ``N_ROWS`` from
    ``first_head`` where ``row_mask``) into the output: directly when the sequence has one slice; else published
    to the fp32 workspace, and the last of its ``n_active`` slices to arrive (``counter``, the same semaphore
    pattern as gemv.py's split-K) merges them (``o = Σ_s 2^(m_s − M) acc_s / Σ_s 2^(m_s − M) l_s``) and resets the
    counter. The workspace rows stay strided by the launch's S. With ``DEFER`` > 0 (one sequence, its output
    projection next: ``decode_attention_o_proj``) a context of 2 to ``DEFER`` slices is left unmerged: the slices
    publish their partials and end, and the projection's GEMV merges them as it loads its x. Up to ``SEQ_S``
    slices the merge is ``gemv.merge_slices`` (the GEMV's own), more a reduction over the slices' tile."""
    out_mask = row_mask[:, None] & d_mask[None, :]
    # SPLIT is a compile-time guard: without it n_active (a tensor even when it is the literal 1) would keep
    # the merge in the unsplit kernel, whose workspace and counter arguments are not fp32 / int32 buffers
    if SPLIT and n_active > 1:
        ws_row = (b.to(tl.int64) * n_q_heads + heads) * n_splits + split
        tl.store(acc_ws_ptr + ws_row[:, None] * D_PAD + d[None, :], acc, mask=out_mask)
        tl.store(ml_ws_ptr + ws_row * 2, m_i, mask=row_mask)
        tl.store(ml_ws_ptr + ws_row * 2 + 1, l_i, mask=row_mask)
        if DEFER > 0:
            if n_active > DEFER:
                _merge_last(counter, n_active, b, n_q_heads, first_head, n_splits, d, d_mask, out_ptr, stride_ob,
                            stride_oh, acc_ws_ptr, ml_ws_ptr, N_ROWS, D_PAD, S_PAD, SEQ_S, SEQ_CHUNKS)  # fmt: skip
        else:
            _merge_last(counter, n_active, b, n_q_heads, first_head, n_splits, d, d_mask, out_ptr, stride_ob, stride_oh,
                        acc_ws_ptr, ml_ws_ptr, N_ROWS, D_PAD, S_PAD, SEQ_S, SEQ_CHUNKS)  # fmt: skip
    else:
        o = acc / l_i[:, None]
        out_rows = out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(out_rows, o.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _merge_last(counter, n_active, b, n_q_heads, first_head, n_splits, d, d_mask, out_ptr, stride_ob, stride_oh,
                acc_ws_ptr, ml_ws_ptr, N_ROWS: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr,
                SEQ_S: tl.constexpr, SEQ_CHUNKS: tl.constexpr = 1):  # fmt: skip
    """``_finish_rows``'s semaphore, after a slice published its partials: the last of the ``n_active`` slices to
    arrive merges them into the output and resets the counter. Up to ``SEQ_S`` slices through
    ``gemv.merge_slices`` (slice by slice, as the output projection merges deferred slices: the same bits either
    way); with ``SEQ_CHUNKS`` > 1 up to ``SEQ_CHUNKS · SEQ_S`` slice by slice too, ``SEQ_S`` at a time
    (``_merge_chunked``); more as one reduction over the ``[S_PAD, D]`` tile (fewer instructions than ``S_PAD``
    unrolled steps)."""
    tl.debug_barrier()
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if arrived == n_active - 1:
        if n_active <= SEQ_S:
            for gi in tl.static_range(N_ROWS):
                row = (b.to(tl.int64) * n_q_heads + first_head + gi) * n_splits + tl.zeros([1], dtype=tl.int64)
                o_1 = merge_slices(acc_ws_ptr, ml_ws_ptr, row, row >= 0, d, d_mask, n_active, D_PAD, SEQ_S, False)
                _store_head(o_1, b, first_head + gi, d, d_mask, out_ptr, stride_ob, stride_oh)
        elif SEQ_CHUNKS > 1:
            if n_active <= SEQ_S * SEQ_CHUNKS:
                for gi in tl.static_range(N_ROWS):
                    row = (b.to(tl.int64) * n_q_heads + first_head + gi) * n_splits + tl.zeros([1], dtype=tl.int64)
                    o_1 = _merge_chunked(acc_ws_ptr, ml_ws_ptr, row, d, d_mask, n_active, D_PAD, SEQ_S, SEQ_CHUNKS)
                    _store_head(o_1, b, first_head + gi, d, d_mask, out_ptr, stride_ob, stride_oh)
            else:
                _merge_tile(n_active, b, n_q_heads, first_head, n_splits, d, d_mask, out_ptr, stride_ob, stride_oh,
                            acc_ws_ptr, ml_ws_ptr, N_ROWS, D_PAD, S_PAD)  # fmt: skip
        else:
            _merge_tile(n_active, b, n_q_heads, first_head, n_splits, d, d_mask, out_ptr, stride_ob, stride_oh,
                        acc_ws_ptr, ml_ws_ptr, N_ROWS, D_PAD, S_PAD)  # fmt: skip
        tl.atomic_xchg(counter, 0)


@triton.jit
def _store_head(o_1, b, head, d, d_mask, out_ptr, stride_ob, stride_oh):
    """One head's merged ``[1, D_PAD]`` row into the output."""
    tl.store(
        out_ptr + b.to(tl.int64) * stride_ob + head * stride_oh + d[None, :],
        o_1.to(out_ptr.dtype.element_ty),
        mask=d_mask[None, :],
    )


@triton.jit
def _merge_chunked(acc_ws_ptr, ml_ws_ptr, row, d, d_mask, n_active, D_PAD: tl.constexpr, MAX_S: tl.constexpr,
                   CHUNKS: tl.constexpr):  # fmt: skip
    """One head's merge of up to ``CHUNKS · MAX_S`` slices, its first slice at workspace row ``row`` (``[1]``): the
    slices' largest ``m`` in a first walk, then ``Σ_s 2^(m_s − M) acc_s / Σ_s 2^(m_s − M) l_s`` in a second, each
    walk a loop over chunks of ``MAX_S`` unrolled slices, so the unrolled code (and its registers) is one chunk's
    where unrolling every slice spills (32 slices: 203 registers at sm_90). The loads bypass L1 (``.cg``), as in
    ``gemv.merge_slices``; the sums' order differs from the tile reduction's, so the bits may too."""
    end = row + n_active  # past the head's last active slice
    top = tl.full([1], -float("inf"), dtype=tl.float32)
    for c in range(CHUNKS):
        for s in tl.static_range(MAX_S):
            at = row + c * MAX_S + s
            m = tl.load(ml_ws_ptr + at * 2, mask=at < end, other=-float("inf"), cache_modifier=".cg")
            top = tl.maximum(top, m)
    num = tl.zeros([1, D_PAD], dtype=tl.float32)
    den = tl.zeros([1], dtype=tl.float32)
    for c in range(CHUNKS):
        for s in tl.static_range(MAX_S):
            at = row + c * MAX_S + s
            live = at < end
            m = tl.load(ml_ws_ptr + at * 2, mask=live, other=-float("inf"), cache_modifier=".cg")
            l_s = tl.load(ml_ws_ptr + at * 2 + 1, mask=live, other=0.0, cache_modifier=".cg")
            a = tl.load(acc_ws_ptr + at[:, None] * D_PAD + d[None, :], mask=live[:, None] & d_mask[None, :],
                        other=0.0, cache_modifier=".cg")  # fmt: skip
            w = tl.where(live, tl.exp2(m - top), 0.0)
            num += a * w[:, None]
            den += l_s * w
    return num / den[:, None]


@triton.jit
def _merge_tile(n_active, b, n_q_heads, first_head, n_splits, d, d_mask, out_ptr, stride_ob, stride_oh, acc_ws_ptr,
                ml_ws_ptr, N_ROWS: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr):  # fmt: skip
    """The merge as one reduction over the ``[S_PAD, D]`` tile of a head's slices."""
    sl = tl.arange(0, S_PAD)
    s_mask = sl < n_active
    for gi in tl.static_range(N_ROWS):
        rows = (b.to(tl.int64) * n_q_heads + first_head + gi) * n_splits + sl
        m_s = tl.load(ml_ws_ptr + rows * 2, mask=s_mask, other=-float("inf"), cache_modifier=".cg")
        l_s = tl.load(ml_ws_ptr + rows * 2 + 1, mask=s_mask, other=0.0, cache_modifier=".cg")
        a_s = tl.load(
            acc_ws_ptr + rows[:, None] * D_PAD + d[None, :],
            mask=s_mask[:, None] & d_mask[None, :],
            other=0.0,
            cache_modifier=".cg",
        )
        w = tl.exp2(m_s - tl.max(m_s, axis=0))  # finite: every active slice holds a token
        o = tl.sum(a_s * w[:, None], axis=0) / tl.sum(l_s * w, axis=0)
        tl.store(
            out_ptr + b.to(tl.int64) * stride_ob + (first_head + gi) * stride_oh + d,
            o.to(out_ptr.dtype.element_ty),
            mask=d_mask,
        )


@triton.jit
def _paged_decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    acc_ws_ptr,
    ml_ws_ptr,
    cnt_ptr,
    k_scale_ptr,
    v_scale_ptr,
    kn_ptr,
    vn_ptr,
    qw_ptr,
    kw_ptr,
    cs_ptr,
    slot_ptr,
    eps,
    stride_knb,
    stride_knh,
    stride_vnb,
    stride_vnh,
    stride_cs,
    qk_scale,
    block_size: tl.constexpr,  # a power of two or not: a constant makes a token's block and offset cheap
    n_splits,
    min_slice,
    n_q_heads,
    n_kv_heads,
    head_dim,
    stride_qb,
    stride_qh,
    stride_cb,
    stride_co,
    stride_ch,
    stride_vcb,
    stride_vch,
    stride_sb,
    stride_so,
    stride_sh,
    stride_bt,
    stride_ob,
    stride_oh,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    S_PAD: tl.constexpr,
    IEEE: tl.constexpr,
    FP8: tl.constexpr,
    WIDEN_F16: tl.constexpr = False,
    ROPE: tl.constexpr = False,
    HALF: tl.constexpr = 64,
    PDL: tl.constexpr = False,
    I8_ASM: tl.constexpr = False,
    V_T: tl.constexpr = False,
    I8_MMA: tl.constexpr = False,
    DEFER: tl.constexpr = 0,
    SEQ_S: tl.constexpr = 2,
    SEQ_CHUNKS: tl.constexpr = 1,
    IDLE_WAIT: tl.constexpr = True,
):
    if PDL:  # see _common.use_pdl; every program waits, even a slice that exits at once (the chain's order)
        gdc_launch_dependents()
        if not ROPE:  # the fused form waits after loading its first tile (below)
            gdc_wait()
    b = tl.program_id(0)
    hk = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + b)
    start, end, n_active = _slice_of(ctx, split, n_splits, min_slice, BLOCK_N, SPLIT)
    if split < n_active:
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D_PAD)
        g_mask = g < GROUP
        d_mask = d < head_dim
        heads = hk * GROUP + g
        walk_end = end
        loop_start = start
        m_i = tl.full([G_PAD], -float("inf"), dtype=tl.float32)
        l_i = tl.zeros([G_PAD], dtype=tl.float32)
        acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
        table = block_tables_ptr + b.to(tl.int64) * stride_bt
        if ROPE:
            # q, k and v are this step's raw projections: the group's q heads and the new token's k get Qwen3's
            # QK-norm and RoPE here (rope.py's code and roundings), the first slice writes the new k and v to the
            # cache, and the slice that ends the context attends the new token from registers, not the cache.
            # Every cache row read here is an older token's, written by an earlier step (which ended before this
            # one began), so the slice's first tile is loaded before waiting for the QKV projection (PDL): its
            # latency overlaps that kernel instead of following it.
            walk_end = tl.minimum(end, ctx - 1)
            _, first_mask, _, k_first, v_first = _load_tile(
                table, start, walk_end, k_cache_ptr, v_cache_ptr, block_size, stride_cb, stride_co, stride_ch, hk, d,
                d_mask, BLOCK_N,
            )  # fmt: skip
            if PDL:
                gdc_wait()
            act_ty = q_ptr.dtype.element_ty
            pos = (ctx - 1).to(tl.int64)
            dh = tl.arange(0, HALF)
            cos = tl.load(cs_ptr + pos * stride_cs + dh).to(act_ty).to(tl.float32)[None, :]
            sin = tl.load(cs_ptr + pos * stride_cs + HALF + dh).to(act_ty).to(tl.float32)[None, :]
            q1, q2, _ = _norm_rope_heads(
                q_ptr + b.to(tl.int64) * stride_qb + (hk * GROUP) * stride_qh,
                stride_qh,
                GROUP,
                qw_ptr,
                cos,
                sin,
                eps,
                G_PAD,
                HALF,
                HALF,
                True,
            )
            q = _join_halves(q1, q2, G_PAD, HALF)
            k1, k2, _ = _norm_rope_heads(
                kn_ptr + b.to(tl.int64) * stride_knb + hk * stride_knh,
                stride_knh,
                1,
                kw_ptr,
                cos,
                sin,
                eps,
                1,
                HALF,
                HALF,
                True,
            )
            k_new = _join_halves(k1, k2, 1, HALF)
            v_new = tl.load(vn_ptr + b.to(tl.int64) * stride_vnb + hk * stride_vnh + d, mask=d_mask, other=0.0)
            if split == 0:
                slot = tl.load(slot_ptr + b).to(tl.int64)
                if slot >= 0:
                    new_row = (slot // block_size) * stride_cb + (slot % block_size) * stride_co + hk * stride_ch
                    tl.store(k_cache_ptr + new_row + dh[None, :], k1)
                    tl.store(k_cache_ptr + new_row + HALF + dh[None, :], k2)
                    tl.store(v_cache_ptr + new_row + d, v_new, mask=d_mask)
            if start < walk_end:  # (a one-token context has no cached tile)
                m_i, l_i, acc = _attend_tile(
                    q, k_first, v_first, l_i, l_i, first_mask, m_i, l_i, acc, qk_scale, IEEE, False
                )
            loop_start = start + BLOCK_N
        else:
            q = tl.load(
                q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :],
                other=0.0,
            )
            if WIDEN_F16:  # FP8 tiles widen to fp16 (one conversion instruction per pair): q joins them there
                q = q.to(tl.float16)
            if I8_MMA:  # int8 tiles go into int8 dots as stored: q as 16-bit fixed point per head, in two halves
                q_hi, q_lo, s_scale = _q16(q, qk_scale)

        for t0 in range(loop_start, walk_end, BLOCK_N):
            if I8_MMA:
                t, t_mask, block, k, vt = _load_tile_i8(
                    table, t0, walk_end, k_cache_ptr, v_cache_ptr, stride_cb, stride_co, stride_ch, stride_vcb,
                    stride_vch, hk, d, d_mask, block_size, BLOCK_N, D_PAD,
                )  # fmt: skip
                srow = block * stride_sb + (t % block_size) * stride_so + hk * stride_sh
                ks = tl.load(k_scale_ptr + srow, mask=t_mask, other=0.0)
                vs = tl.load(v_scale_ptr + srow, mask=t_mask, other=0.0)
                m_i, l_i, acc = _attend_tile_i8(q_hi, q_lo, s_scale, k, vt, ks, vs, t_mask, m_i, l_i, acc)
            else:
                t, t_mask, block, k, v = _load_tile(
                    table, t0, walk_end, k_cache_ptr, v_cache_ptr, block_size, stride_cb, stride_co, stride_ch, hk,
                    d, d_mask, BLOCK_N, stride_vcb, stride_vch, V_T,
                )  # fmt: skip
                ks = l_i  # unused without FP8
                vs = l_i
                if FP8:
                    # FP8 rows widen exactly to q's dtype; their per-token scales multiply the scores' columns (K)
                    # and the probabilities' columns (V) instead of a dequantized copy of the tile
                    srow = block * stride_sb + (t % block_size) * stride_so + hk * stride_sh
                    ks = tl.load(k_scale_ptr + srow, mask=t_mask, other=0.0)
                    vs = tl.load(v_scale_ptr + srow, mask=t_mask, other=0.0)
                    if WIDEN_F16:
                        # P·V's fp16 operand is p·vs·2^9 ≈ p·(the token's V amax), as vs = amax / 448: without
                        # the factor, small p·vs fall below fp16's normal range. The power of two leaves acc
                        # exactly.
                        vs = vs * _P_SCALE
                    k = _widen_8bit(k, q.dtype, I8_ASM)
                    v = _widen_8bit(v, q.dtype, I8_ASM)
                m_i, l_i, acc = _attend_tile(q, k, v, ks, vs, t_mask, m_i, l_i, acc, qk_scale, IEEE, FP8)
        if WIDEN_F16:
            acc = acc * (1.0 / _P_SCALE)
        if ROPE:  # noqa: SIM102 (a constexpr guard: the tensor test must not be compiled without ROPE)
            if end == ctx:  # the new token, from registers (its cache row may not be written yet)
                s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), axis=1) * qk_scale
                m_new = tl.maximum(m_i, s_new)
                alpha = tl.exp2(m_i - m_new)
                p_new = tl.exp2(s_new - m_new)
                l_i = l_i * alpha + p_new
                pv_new = p_new.to(v_new.dtype).to(tl.float32)[:, None] * v_new.to(tl.float32)[None, :]
                acc = acc * alpha[:, None] + pv_new
                m_i = m_new

        _finish_rows(
            acc, m_i, l_i, b, split, n_active, n_splits, n_q_heads, heads, hk * GROUP, g_mask, d, d_mask,
            cnt_ptr + b * n_kv_heads + hk, out_ptr, stride_ob, stride_oh, acc_ws_ptr, ml_ws_ptr, GROUP, D_PAD, S_PAD,
            SPLIT, DEFER, SEQ_S, SEQ_CHUNKS,
        )  # fmt: skip
    if ROPE and PDL and IDLE_WAIT:  # noqa: SIM102 (a constexpr guard) — an idle slice waits for the producer too
        if split >= n_active:
            gdc_wait()


@triton.jit
def _paged_decode_i8_heads_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    acc_ws_ptr,
    ml_ws_ptr,
    cnt_ptr,
    k_scale_ptr,
    v_scale_ptr,
    qk_scale,
    n_splits,
    min_slice,
    n_q_heads,
    n_programs_h,
    head_dim,
    stride_qb,
    stride_qh,
    stride_cb,
    stride_co,
    stride_ch,
    stride_vcb,
    stride_vch,
    stride_sb,
    stride_so,
    stride_sh,
    stride_bt,
    stride_ob,
    stride_oh,
    block_size: tl.constexpr,
    GROUP: tl.constexpr,
    HEADS: tl.constexpr,
    ROWS: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    S_PAD: tl.constexpr,
    PDL: tl.constexpr = False,
    SELECT: tl.constexpr = 0,
):
    """The int8 dots (``_attend_tile_i8``) with ``HEADS`` KV heads a program: the ``HEADS · GROUP`` query rows of
    those heads fill the dots' 16 rows instead of one group padded to 16, so the softmax's elementwise work is
    shared by ``HEADS`` heads and a tile's copies are ``HEADS`` times the bytes. Each head's dots take the rows
    of the others as zeros (their q, their probabilities masked), so the int32 sums over heads give every row
    its own head's product; the K and V scales are gathered per row. Same split-KV and merge as
    ``_paged_decode_kernel``."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    b = tl.program_id(0)
    ph = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + b)
    start, end, n_active = _slice_of(ctx, split, n_splits, min_slice, BLOCK_N, SPLIT)
    if split < n_active:
        hk0 = ph * HEADS
        r = tl.arange(0, ROWS)
        d = tl.arange(0, D_PAD)
        r_mask = r < HEADS * GROUP
        d_mask = d < head_dim
        row_head = r // GROUP  # the row's KV head within the program
        heads = hk0 * GROUP + r
        q = tl.load(
            q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :],
            mask=r_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        q_hi, q_lo, s_scale = _q16(q, qk_scale)
        m_i = tl.full([ROWS], -float("inf"), dtype=tl.float32)
        l_i = tl.zeros([ROWS], dtype=tl.float32)
        acc = tl.zeros([ROWS, D_PAD], dtype=tl.float32)
        table = block_tables_ptr + b.to(tl.int64) * stride_bt
        NB: tl.constexpr = BLOCK_N // block_size
        o = tl.arange(0, block_size)
        for t0 in range(start, end, BLOCK_N):
            j = t0 // block_size + tl.arange(0, NB)
            j_mask = j * block_size < end
            blocks = tl.load(table + j, mask=j_mask, other=0).to(tl.int64)
            block = tl.reshape(tl.broadcast_to(blocks[:, None], (NB, block_size)), (BLOCK_N,))
            t = t0 + tl.arange(0, BLOCK_N)
            t_mask = t < end
            tok = block * stride_cb + (t % block_size) * stride_co
            kv_mask = t_mask[:, None] & d_mask[None, :]
            # per row and token: the row's head's scales (rows past the heads and tokens past the end read 0)
            srow = block * stride_sb + (t % block_size) * stride_so
            sc_off = srow[None, :] + (hk0 + row_head)[:, None] * stride_sh
            sc_mask = r_mask[:, None] & t_mask[None, :]
            ks = tl.load(k_scale_ptr + sc_off, mask=sc_mask, other=0.0)
            vs = tl.load(v_scale_ptr + sc_off, mask=sc_mask, other=0.0)
            s_hi = tl.zeros([ROWS, BLOCK_N], dtype=tl.int32)
            s_lo = tl.zeros([ROWS, BLOCK_N], dtype=tl.int32)
            for hh in tl.static_range(HEADS):
                k = tl.load(k_cache_ptr + tok[:, None] + (hk0 + hh) * stride_ch + d[None, :], mask=kv_mask, other=0)
                mine = (row_head == hh)[:, None]
                if SELECT == 1:  # every row against this head's K, the head's rows kept: one operand for all heads
                    s_hi = tl.where(mine, tl.dot(q_hi, tl.trans(k), out_dtype=tl.int32), s_hi)
                    s_lo = tl.where(mine, tl.dot(q_lo, tl.trans(k), out_dtype=tl.int32), s_lo)
                elif SELECT == 2:  # the same, the halves summed in the dot (|.| < 2^29): fewer registers
                    s_h = tl.dot(q_hi, tl.trans(k), out_dtype=tl.int32) * 256
                    s_hi = tl.where(mine, tl.dot(q_lo, tl.trans(k), s_h, out_dtype=tl.int32), s_hi)
                else:
                    s_hi = tl.dot(tl.where(mine, q_hi, 0), tl.trans(k), s_hi, out_dtype=tl.int32)
                    s_lo = tl.dot(tl.where(mine, q_lo, 0), tl.trans(k), s_lo, out_dtype=tl.int32)
            if SELECT != 2:  # SELECT 2 summed the halves in its dots
                s_hi = s_hi * 256 + s_lo
            s = s_hi.to(tl.float32) * s_scale[:, None] * ks
            s = tl.where(t_mask[None, :], s, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            pv = p * vs
            step = tl.maximum(tl.max(pv, axis=1), 1e-30) * (1.0 / _I16_TOP)
            p_hi, p_lo = _split_i16(pv, 1.0 / step[:, None])
            o_hi = tl.zeros([ROWS, D_PAD], dtype=tl.int32)
            o_lo = tl.zeros([ROWS, D_PAD], dtype=tl.int32)
            for hh in tl.static_range(HEADS):
                v_runs = (
                    blocks[:, None, None] * stride_vcb
                    + (hk0 + hh) * stride_vch
                    + d[None, :, None] * block_size
                    + o[None, None, :]
                )
                v3 = tl.load(v_cache_ptr + v_runs, mask=j_mask[:, None, None] & d_mask[None, :, None], other=0)
                vt = tl.reshape(tl.permute(v3, (1, 0, 2)), (D_PAD, BLOCK_N))
                mine = (row_head == hh)[:, None]
                if SELECT == 1:
                    o_hi = tl.where(mine, tl.dot(p_hi, tl.trans(vt), out_dtype=tl.int32), o_hi)
                    o_lo = tl.where(mine, tl.dot(p_lo, tl.trans(vt), out_dtype=tl.int32), o_lo)
                elif SELECT == 2:  # |.| ≤ 32,512 · 127 · BLOCK_N
                    o_h = tl.dot(p_hi, tl.trans(vt), out_dtype=tl.int32) * 256
                    o_hi = tl.where(mine, tl.dot(p_lo, tl.trans(vt), o_h, out_dtype=tl.int32), o_hi)
                else:
                    o_hi = tl.dot(tl.where(mine, p_hi, 0), tl.trans(vt), o_hi, out_dtype=tl.int32)
                    o_lo = tl.dot(tl.where(mine, p_lo, 0), tl.trans(vt), o_lo, out_dtype=tl.int32)
            if SELECT != 2:
                o_hi = o_hi * 256 + o_lo
            acc = acc * alpha[:, None] + o_hi.to(tl.float32) * step[:, None]
            m_i = m_new

        _finish_rows(
            acc, m_i, l_i, b, split, n_active, n_splits, n_q_heads, heads, hk0 * GROUP, r_mask, d, d_mask,
            cnt_ptr + b * n_programs_h + ph, out_ptr, stride_ob, stride_oh, acc_ws_ptr, ml_ws_ptr, HEADS * GROUP,
            D_PAD, S_PAD, SPLIT,
        )  # fmt: skip


@triton.jit
def _paged_decode_i8_tma_kernel(
    q_ptr,
    k_desc,
    v_desc,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    acc_ws_ptr,
    ml_ws_ptr,
    cnt_ptr,
    k_scale_ptr,
    v_scale_ptr,
    qk_scale,
    n_splits,
    min_slice,
    n_q_heads,
    n_kv_heads,
    stride_qb,
    stride_qh,
    stride_sb,
    stride_so,
    stride_sh,
    stride_bt,
    stride_ob,
    stride_oh,
    block_size: tl.constexpr,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    SPLIT: tl.constexpr,
    S_PAD: tl.constexpr,
    PDL: tl.constexpr = False,
    STACK: tl.constexpr = False,
):
    """The int8 dots (``_attend_tile_i8``) over tiles that are whole KV blocks, each copied by a tensor
    descriptor (TMA on Hopper): K as the ``[block_size, D]`` box of the ``(N·bs, Hk·D)`` matrix at the block's
    rows and the head's columns, V (transposed within its block) as the ``[D, block_size]`` box of the
    ``(N·Hk·D, bs)`` matrix. One bulk copy an operand and a tile, no address arithmetic per element, and the
    compiler's pipeliner keeps ``num_stages`` tiles in flight in shared memory, where the pointer form's gathered
    tile gets one buffer (see "Occupancy of the int8 dots"). Same slices and merge as ``_paged_decode_kernel``.
    ``STACK``: q's and P's 16-bit halves stacked as the rows of one dot a product (``G_PAD`` rows a half, 2·G_PAD in
    the dots), for groups of up to 8 query heads."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    b = tl.program_id(0)
    hk = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + b)
    start, end, n_active = _slice_of(ctx, split, n_splits, min_slice, block_size, SPLIT)
    if split < n_active:
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        g_mask = g < GROUP
        heads = hk * GROUP + g
        q = tl.load(
            q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :],
            mask=g_mask[:, None],
            other=0.0,
        )
        q_hi, q_lo, s_scale = _q16(q, qk_scale)
        if STACK:
            q_hi = _stack_rows(q_hi, q_lo)
        m_i = tl.full([G_PAD], -float("inf"), dtype=tl.float32)
        l_i = tl.zeros([G_PAD], dtype=tl.float32)
        acc = tl.zeros([G_PAD, D], dtype=tl.float32)
        table = block_tables_ptr + b.to(tl.int64) * stride_bt
        o = tl.arange(0, block_size)
        blk = tl.load(table + start // block_size)
        for t0 in range(start, end, block_size):
            # this tile's block id came with the tile before: the copies depend on no load of their own iteration
            nxt = tl.minimum(t0 + block_size, end - 1)
            blk_next = tl.load(table + nxt // block_size)
            k = k_desc.load([blk * block_size, hk * D])
            vt = v_desc.load([(blk * n_kv_heads + hk) * D, 0])
            t_mask = t0 + o < end
            srow = blk.to(tl.int64) * stride_sb + o * stride_so + hk * stride_sh
            ks = tl.load(k_scale_ptr + srow, mask=t_mask, other=0.0)
            vs = tl.load(v_scale_ptr + srow, mask=t_mask, other=0.0)
            m_i, l_i, acc = _attend_tile_i8(q_hi, q_lo, s_scale, k, vt, ks, vs, t_mask, m_i, l_i, acc, STACK)
            blk = blk_next
        _finish_rows(
            acc, m_i, l_i, b, split, n_active, n_splits, n_q_heads, heads, hk * GROUP, g_mask, d, d >= 0,
            cnt_ptr + b * n_kv_heads + hk, out_ptr, stride_ob, stride_oh, acc_ws_ptr, ml_ws_ptr, GROUP, D, S_PAD,
            SPLIT,
        )  # fmt: skip


def tma_ready(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scales: torch.Tensor | None) -> bool:
    """Whether ``_paged_decode_i8_tma_kernel`` can read these caches: int8 with scales, K dense and V transposed
    within its blocks, blocks of 32-128 tokens (a tile is one block, and ``P·V``'s int8 dot reduces over at least
    32), a power-of-two head_dim of 32-256, 16-byte-aligned rows and bases (what a tensor descriptor needs)."""
    if k_cache.dtype != torch.int8 or k_scales is None or not v_transposed(v_cache):
        return False
    _, bs, hk, d = k_cache.shape
    return (
        bs in (32, 64, 128)
        and 32 <= d <= 256
        and d & (d - 1) == 0
        and k_cache.is_contiguous()
        and (hk * d) % 16 == 0
        and k_cache.data_ptr() % 16 == 0
        and v_cache.data_ptr() % 16 == 0
    )


def heads_per_program(kv_heads: int, group: int, most: int = 16, rows: int = 16) -> int:
    """The most KV heads (at most ``most``) whose query rows fit ``rows`` and that divide ``kv_heads`` (1 when a
    group alone fills them): Qwen3-0.6B (8 KV heads of 2) → 8, a Llama-3.2-1B shape (8 of 4) → 4, SmolLM2-135M
    (3 of 3) → 3."""
    for h in range(min(kv_heads, most, max(rows // group, 1)), 0, -1):
        if kv_heads % h == 0:
            return h
    return 1


def num_splits(batch: int, kv_heads: int, max_context: int, block_n: int, device: torch.device) -> int:
    """Slices per sequence: enough programs for ~``PROGRAMS_PER_SM`` per SM, never a slice shorter than one tile."""
    programs = batch * kv_heads
    target = max(1, round(PROGRAMS_PER_SM * num_sms(device)))
    if programs >= target:
        return 1
    return max(1, min(cdiv(target, programs), cdiv(max_context, block_n)))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    max_context_len: int | None = None,
    splits: int | None = None,
    block_n: int | None = None,
    min_slice: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    fp8_widen: str | None = None,
    i8_asm: bool | None = None,
    i8_mma: bool | None = None,
    i8_pack_heads: int | None = None,
    i8_pack_select: int | None = None,
    i8_tma: bool | int | None = None,
) -> torch.Tensor:
    """Decode attention of ``q: (B, Hq, D)`` over the paged caches; returns ``(B, Hq, D)`` in q's dtype.

    ``max_context_len`` (a host int, optional) only sizes the split; it must be ≥ every context length.
    ``min_slice``: the fewest tokens a slice takes (rounded up to whole ``block_n`` tiles; default
    ``MIN_SLICE_TOKENS``), so a short context runs in one program without the merge. An FP8
    cache (``float8_e4m3fn``) comes with ``k_scales, v_scales: (num_blocks, block_size, Hk)`` fp32. Launch
    settings left None come from ``LAUNCH`` (``FP8_LAUNCH`` / ``INT8_LAUNCH`` for an 8-bit cache); ``fp8_widen``:
    the dtype 8-bit tiles widen to for the dots of a bf16 q, ``"bf16"`` or ``"f16"``; ``i8_asm``: an int8
    cache's tiles widen through byte permutes (CUDA only; see ``INT8_LAUNCH``); ``i8_mma``: an int8 cache whose V
    is transposed within its blocks (kv_cache.py) goes into int8 tensor-core dots as stored, without widening
    (``INT8_LAUNCH["mma"]``; needs a power-of-two block size dividing ``block_n``); ``i8_pack_heads``: with the
    int8 dots, up to this many KV heads a program (``heads_per_program``; 0 or 1: one); ``i8_pack_select``: the
    packed form's dots take every row and keep each head's rows of the result, 1 with q's and P's 16-bit halves in
    dots of their own, 2 summed in one dot's accumulator (``INT8_LAUNCH["pack_select"]``; 0: each head's operand
    rows masked instead); ``i8_tma``: with the int8 dots, tiles of one whole KV block copied by tensor descriptors
    (``_paged_decode_i8_tma_kernel``; where ``tma_ready`` holds: blocks of 32-128 tokens), before any packing;
    ``i8_tma=2``: the same with q's and P's 16-bit halves stacked as the rows of one dot a product (groups of up to
    8 query heads; larger groups take two dots as with 1).
    """
    eight_bit = k_scales is not None
    cfg = dict(LAUNCH if not eight_bit else INT8_LAUNCH if k_cache.dtype == torch.int8 else FP8_LAUNCH)
    given = {
        key: value
        for key, value in (
            ("block_n", block_n),
            ("num_warps", num_warps),
            ("num_stages", num_stages),
            ("widen", fp8_widen),
            ("i8_asm", i8_asm),
            ("mma", i8_mma),
            ("pack_heads", i8_pack_heads),
            ("pack_select", i8_pack_select),
            ("tma", i8_tma),
        )
        if value is not None
    }
    cfg.update(given)
    widen = cfg.get("widen", "bf16")
    require(widen in ("bf16", "f16"), "fp8_widen must be 'bf16' or 'f16'")
    bs = k_cache.shape[1]
    mma = (
        bool(cfg.get("mma"))
        and k_cache.dtype == torch.int8
        and v_transposed(v_cache)
        and bs & (bs - 1) == 0
        and cfg["block_n"] % bs == 0
        and q.dtype != torch.float32
    )
    tma = int(cfg.get("tma") or 0) if mma and tma_ready(k_cache, v_cache, k_scales) else 0  # 1, or 2: stacked
    if tma:
        cfg = _own_launch(cfg, "tma_launch", given)  # its own stages
    pack = int(cfg.get("pack_heads") or 0) if mma and not tma and q.shape[0] >= cfg.get("pack_min_rows", 0) else 0
    if pack > 1:
        pack_cfg = _own_launch(cfg, "pack_launch", given)  # its own tiles
        if pack_cfg["block_n"] % bs:  # its tiles hold no whole block (an engine of larger blocks)
            pack = 0  # the one-head form, whose tiles do
        else:
            cfg = pack_cfg
            splits = splits or cfg.get("pack_splits") or None  # a fixed split count of the packed launches
    widen_f16 = widen == "f16" and eight_bit and q.dtype == torch.bfloat16 and not mma
    f16_tiles = widen_f16 or (eight_bit and q.dtype == torch.float16)
    return _decode(
        q, k_cache, v_cache, block_tables, context_lens, scale, out, max_context_len, splits, cfg["block_n"],
        min_slice, cfg["num_warps"], cfg["num_stages"], k_scales, v_scales, None, widen_f16=widen_f16,
        i8_asm=bool(cfg.get("i8_asm")) and k_cache.dtype == torch.int8 and f16_tiles and q.is_cuda and not mma,
        i8_mma=mma, pack_heads=pack, pack_select=int(cfg.get("pack_select") or 0), i8_tma=tma,
    )[0]  # fmt: skip


def _own_launch(cfg: dict, key: str, given: dict) -> dict:
    """A form's launch settings: ``cfg`` updated with its own ``cfg[key]`` (``pack_launch``, ``tma_launch``), and
    the caller's explicit arguments over both."""
    return {**cfg, **(cfg.get(key) or {}), **given}


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
    *,
    out: torch.Tensor | None = None,
    max_context_len: int | None = None,
    splits: int | None = None,
    block_n: int | None = None,
    min_slice: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """A decode step's attention from its raw q/k/v projections (Qwen3): ``qk_norm_rope_store_kv`` at positions
    ``context_lens - 1``, then ``paged_decode_attention``, in one launch (reference
    ``ops.paged_decode_attention_qk_norm_rope``). ``q: (B, Hq, D)``, ``k, v: (B, Hk, D)`` may be strided views
    of the fused QKV row (unit stride along D); the new token's k and v are written at ``slot_mapping`` (slots
    < 0: not written) and attended from registers. bf16/fp16 caches; D a power of two."""
    rope = _rope_args(q, k, v, q_norm_weight, k_norm_weight, eps, cos_sin_cache, k_cache, slot_mapping)
    return _decode(
        q, k_cache, v_cache, block_tables, context_lens, scale, out, max_context_len, splits,
        block_n or LAUNCH["block_n"], min_slice, num_warps or LAUNCH["num_warps"],
        num_stages or LAUNCH["num_stages"], None, None, rope,
    )[0]  # fmt: skip


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
    *,
    max_context_len: int | None = None,
) -> torch.Tensor:
    """``linear(paged_decode_attention_qk_norm_rope(…).reshape(B, Hq·D), o_weight)`` → ``(B, hidden)``: a decode
    step's attention and its output projection (reference ``ops.decode_attention_o_proj``). One sequence (batch-1
    decode): when its context takes 2 to ``gemv.DEFER_MAX_SLICES`` slices the attention publishes them unmerged
    and ends (no semaphore, no re-read), and the projection's GEMV merges them as it loads its x; any other slice
    count is merged (or written) by the attention as usual. The result equals the two ops' bit for bit (both merge
    through ``gemv.merge_slices``: the slices summed in order, each product and sum rounded on its own, as the
    attention compiled without FP fusion rounds them: the default ``ROPE_FP_FUSION``). Other batch sizes: the two
    ops."""
    B, Hq, D = q.shape
    require(o_weight.dim() == 2 and o_weight.shape[1] == Hq * D, "o_weight must be (hidden, Hq·D)")
    if B != 1 or o_weight.dtype != q.dtype or o_weight.stride(1) != 1:
        from .linear import linear

        o = paged_decode_attention_qk_norm_rope(
            q, k, v, q_norm_weight, k_norm_weight, eps, cos_sin_cache, k_cache, v_cache, slot_mapping, block_tables,
            context_lens, scale, max_context_len=max_context_len,
        )  # fmt: skip
        return linear(o.reshape(B, Hq * D), o_weight)
    rope = _rope_args(q, k, v, q_norm_weight, k_norm_weight, eps, cos_sin_cache, k_cache, slot_mapping)
    o, merge = _decode(
        q, k_cache, v_cache, block_tables, context_lens, scale, None, max_context_len, None, LAUNCH["block_n"], None,
        LAUNCH["num_warps"], LAUNCH["num_stages"], None, None, rope, defer=True,
    )  # fmt: skip
    return _gemv(o.reshape(1, Hq * D), o_weight, None, 16, None, None, merge=merge)


def _rope_args(q, k, v, q_norm_weight, k_norm_weight, eps, cos_sin_cache, k_cache, slot_mapping) -> tuple:
    """The fused form's inputs, checked, as ``_decode`` takes them."""
    B, D = q.shape[0], q.shape[2]
    Hk = k_cache.shape[2]
    require(D >= 16 and D & (D - 1) == 0, "head_dim must be a power of two")
    require(k_cache.dtype == q.dtype, "the fused op writes caches of q's dtype (no FP8)")
    for name, t in (("k", k), ("v", v)):
        require(t.shape == (B, Hk, D) and t.stride(2) == 1 and t.dtype == q.dtype, f"{name} must be (B, Hk, D)")
    require(q_norm_weight.shape == (D,) and k_norm_weight.shape == (D,), "norm weights must be (head_dim,)")
    require(cos_sin_cache.shape[-1] == D and cos_sin_cache.stride(-1) == 1, "cos_sin_cache must be (P, head_dim)")
    require(slot_mapping.shape == (B,), "slot_mapping must be (B,)")
    return (k, v, q_norm_weight, k_norm_weight, cos_sin_cache, slot_mapping, eps)


def _decode(
    q, k_cache, v_cache, block_tables, context_lens, scale, out, max_context_len, splits, block_n, min_slice,
    num_warps, num_stages, k_scales, v_scales, rope, widen_f16=False, i8_asm=False, i8_mma=False, pack_heads=0,
    defer=False, pack_select=0, i8_tma=False,
):  # fmt: skip
    """The launch; returns ``(out, merge)``: ``merge`` is None, or with ``defer`` (one sequence, the fused form,
    split) the workspaces and slicing that ``gemv``'s merging x needs (``decode_attention_o_proj``)."""
    B, Hq, D = q.shape
    _, block_size, Hk, Dc = k_cache.shape
    require(Dc == D and v_cache.shape == k_cache.shape, "caches must be (num_blocks, block_size, Hk, D)")
    require(Hq % Hk == 0, "Hq must be a multiple of Hk")
    v_t = check_layout(k_cache, v_cache)
    require(not (v_t and rope is not None), "the fused QK-norm + RoPE form writes V in K's layout")
    require(q.stride(2) == 1, "q needs a unit stride along head_dim")
    scales = check_cache(k_cache, v_cache, q.dtype, k_scales, v_scales)
    require(block_tables.dim() == 2 and block_tables.shape[0] == B, "block_tables must be (B, max_blocks)")
    require(block_tables.stride(1) == 1, "block_tables rows must be contiguous")
    require(context_lens.shape == (B,), "context_lens must be (B,)")
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    require(out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1, "bad out")
    if B == 0:
        return out, None
    group = Hq // Hk
    if i8_tma:
        block_n = block_size  # a tile is one block
    heads = heads_per_program(Hk, group, pack_heads) if pack_heads > 1 else 1  # never with i8_tma (the caller's)
    bound = max_context_len if max_context_len is not None else block_tables.shape[1] * block_size
    bound = max(bound, 1)
    n_split = splits or num_splits(B, Hk // heads, bound, block_n, q.device)
    balance = BALANCE_SLICE_TOKENS_INT8 if k_cache.dtype == torch.int8 else BALANCE_SLICE_TOKENS  # knobs, at launch
    if not splits and n_split == 1 and B > 1 and balance > 0:
        n_split = max(1, min(BALANCE_MAX_SPLITS, cdiv(bound, balance)))
        min_slice = max(MIN_SLICE_TOKENS if min_slice is None else min_slice, balance)
    n_split = cdiv(bound, cdiv(cdiv(bound, n_split), block_n) * block_n)  # no slice of the bound left empty
    d_pad = max(16, next_pow2(D))
    if n_split > 1:  # cached scratch: no allocation on the hot path (see _common.cached_zeros)
        acc_ws = cached_empty("paged.acc", B * Hq * n_split * d_pad, torch.float32, q.device)
        ml_ws = cached_empty("paged.ml", B * Hq * n_split * 2, torch.float32, q.device)
        counters = cached_zeros("paged.counters", B * Hk, torch.int32, q.device)
    else:
        acc_ws = ml_ws = counters = out  # unused (SPLIT=False)
    pdl = use_pdl(q)
    if heads > 1:
        assert scales is not None
        _paged_decode_i8_heads_kernel[(B, Hk // heads, n_split)](
            q, k_cache, v_cache, block_tables, context_lens, out, acc_ws, ml_ws, counters, *scales, scale * _LOG2E,
            n_split, cdiv(MIN_SLICE_TOKENS if min_slice is None else max(min_slice, 1), block_n) * block_n, Hq,
            Hk // heads, D, q.stride(0), q.stride(1), *k_cache.stride()[:3], v_cache.stride(0), v_cache.stride(2),
            *scales[0].stride(), block_tables.stride(0), out.stride(0), out.stride(1), block_size=block_size,
            GROUP=group, HEADS=heads, ROWS=max(16, next_pow2(heads * group)), D_PAD=d_pad, BLOCK_N=block_n,
            SPLIT=n_split > 1, S_PAD=next_pow2(n_split), PDL=pdl, SELECT=pack_select, num_warps=num_warps,
            num_stages=num_stages, launch_pdl=pdl,
        )  # fmt: skip
        return out, None
    min_tokens = cdiv(MIN_SLICE_TOKENS if min_slice is None else max(min_slice, 1), block_n) * block_n
    if i8_tma:
        assert scales is not None and v_t
        N = k_cache.shape[0]
        stack = i8_tma == 2 and group <= 8  # the halves stacked fill at most 16 rows
        _paged_decode_i8_tma_kernel[(B, Hk, n_split)](
            q, TensorDescriptor(k_cache, [N * block_size, Hk * D], [Hk * D, 1], [block_size, D]),
            TensorDescriptor(v_cache, [N * Hk * D, block_size], [block_size, 1], [D, block_size]), block_tables,
            context_lens, out, acc_ws, ml_ws, counters, *scales, scale * _LOG2E, n_split, min_tokens, Hq, Hk,
            q.stride(0), q.stride(1), *scales[0].stride(), block_tables.stride(0), out.stride(0), out.stride(1),
            block_size=block_size, GROUP=group, G_PAD=max(8, next_pow2(group)) if stack else max(16, next_pow2(group)),
            D=D, SPLIT=n_split > 1, S_PAD=next_pow2(n_split), PDL=pdl, STACK=stack, num_warps=num_warps,
            num_stages=num_stages, launch_pdl=pdl,
        )  # fmt: skip
        return out, None
    defer = defer and B == 1 and n_split > 1 and rope is not None
    s_pad = next_pow2(n_split)
    seq_s = min(max(2, SEQ_MERGE_SLICES), s_pad)  # knobs, read at launch
    defer_s = min(_gemv_module.DEFER_MAX_SLICES, seq_s)
    _paged_decode_kernel[(B, Hk, n_split)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        acc_ws,
        ml_ws,
        counters,
        *(scales if scales is not None else (out, out)),  # unused when FP8=False
        *(rope[:6] if rope is not None else (q, q, q, q, q, q)),  # unused when ROPE=False
        rope[6] if rope is not None else 0.0,
        *((rope[0].stride(0), rope[0].stride(1), rope[1].stride(0), rope[1].stride(1)) if rope else (0, 0, 0, 0)),
        rope[4].stride(0) if rope is not None else 0,
        scale * _LOG2E,
        block_size,
        n_split,
        min_tokens,
        Hq,
        Hk,
        D,
        q.stride(0),
        q.stride(1),
        *k_cache.stride()[:3],
        v_cache.stride(0),
        v_cache.stride(2),
        *(scales[0].stride() if scales is not None else (0, 0, 0)),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        G_PAD=max(16, next_pow2(group)),
        D_PAD=d_pad,
        BLOCK_N=block_n,
        SPLIT=n_split > 1,
        S_PAD=next_pow2(n_split),
        IEEE=q.dtype == torch.float32,
        FP8=scales is not None,
        WIDEN_F16=widen_f16,
        ROPE=rope is not None,
        HALF=D // 2,
        PDL=pdl,
        I8_ASM=i8_asm,
        V_T=v_t,
        I8_MMA=i8_mma,
        DEFER=defer_s if defer else 0,
        SEQ_S=seq_s,
        SEQ_CHUNKS=max(1, SEQ_MERGE_CHUNKS) if s_pad > seq_s else 1,
        IDLE_WAIT=IDLE_SLICES_WAIT,
        num_warps=num_warps,
        num_stages=num_stages,
        launch_pdl=pdl,
        enable_fp_fusion=rope is None
        or ROPE_FP_FUSION,  # the fused QK-norm + RoPE keeps every rounding of rope.py (see there)
    )
    if not defer:
        return out, None
    return out, (acc_ws, ml_ws, context_lens, n_split, min_tokens, block_n, D, d_pad, defer_s)
