"""Tiled causal prefill attention and the split-KV paged decode attention."""

from __future__ import annotations

import itertools

import pytest
import torch

from kernellab.kernels.attention import causal_attention
from kernellab.kernels.compile_check import record_launches
from kernellab.kernels.paged_attention import paged_decode_attention
from kernellab.runtime import ops
from tests.support.kernels import assert_close, poisoned

# bf16 probabilities feed the P·V tensor-core dot (FlashAttention's choice): ~1e-2 absolute on O(1) outputs.
ATTN_DTYPES = [(torch.float32, 1e-5, 1e-5), (torch.float16, 2e-3, 2e-3), (torch.bfloat16, 2e-2, 2e-2)]


@pytest.mark.parametrize("dtype, atol, rtol", ATTN_DTYPES)
@pytest.mark.parametrize(
    "Tq, Tk, Hq, Hk, D", [(1, 1, 2, 1, 32), (37, 37, 4, 2, 32), (5, 40, 2, 2, 16), (20, 33, 3, 1, 24)]
)
def test_causal_attention(Tq, Tk, Hq, Hk, D, dtype, atol, rtol, gen):
    q = torch.randn(Tq, Hq, D, generator=gen).to(dtype)
    k = torch.randn(Tk, Hk, D, generator=gen).to(dtype)
    v = torch.randn(Tk, Hk, D, generator=gen).to(dtype)
    out = poisoned(q.shape, dtype, "cpu")
    y = causal_attention(q, k, v, D**-0.5, Hq // Hk, out=out, block_m=16, block_n=16)
    ref = ops.causal_attention(q.float(), k.float(), v.float(), D**-0.5, Hq // Hk).to(dtype)
    assert_close(y, ref, atol, rtol, "attention")


def _paged_case(lens, Hq, Hk, D, block_size, dtype, gen, extra_blocks=3):
    """Caches with shuffled physical blocks, -1 padded block tables and poisoned unused slots."""
    B = len(lens)
    per_seq = [-(-n // block_size) for n in lens]
    max_blocks = max(per_seq) + 1
    num_blocks = sum(per_seq) + extra_blocks
    k_cache = torch.randn(num_blocks, block_size, Hk, D, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, Hk, D, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((B, max_blocks), -1, dtype=torch.int32)
    used = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    i = 0
    for b, n in enumerate(per_seq):
        tables[b, :n] = perm[i : i + n].to(torch.int32)
        for j in range(n):
            used[perm[i + j], : min(block_size, lens[b] - j * block_size)] = True
        i += n
    k_cache[~used] = float("nan")  # a read past a context or into a foreign block poisons the output
    v_cache[~used] = float("nan")
    q = torch.randn(B, Hq, D, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("dtype, atol, rtol", ATTN_DTYPES)
@pytest.mark.parametrize("block_size", [16, 32, 5])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_paged_decode_attention(block_size, splits, dtype, atol, rtol, gen):
    lens, Hq, Hk, D = [1, 17, 50], 4, 2, 32
    q, kc, vc, tables, ctx = _paged_case(lens, Hq, Hk, D, block_size, dtype, gen)
    out = poisoned(q.shape, dtype, "cpu")
    y = paged_decode_attention(q, kc, vc, tables, ctx, D**-0.5, out=out, splits=splits, block_n=16)
    ref = ops.paged_decode_attention(
        q.float(), kc.float().nan_to_num(), vc.float().nan_to_num(), tables, ctx, D**-0.5
    ).to(dtype)
    assert_close(y, ref, atol, rtol, "paged decode")


@pytest.mark.parametrize("Hq, Hk, D", [(8, 1, 64), (3, 3, 24)])
def test_paged_decode_attention_group_and_odd_head_dim(Hq, Hk, D, gen):
    q, kc, vc, tables, ctx = _paged_case([9, 33], Hq, Hk, D, 16, torch.float32, gen)
    out = poisoned(q.shape, torch.float32, "cpu")
    y = paged_decode_attention(q, kc, vc, tables, ctx, 0.1, out=out, max_context_len=33, block_n=16)
    ref = ops.paged_decode_attention(q, kc.nan_to_num(), vc.nan_to_num(), tables, ctx, 0.1)
    assert_close(y, ref, 1e-5, 1e-5, "paged decode")


@pytest.mark.parametrize("min_slice", [None, 40, 1000])
def test_paged_decode_slices_follow_the_real_context(min_slice, gen):
    """A launch sized for a wide context (a decode graph's bound, many slices) on short real contexts: each
    sequence uses only the slices its length needs, the rest exit, and the merge counters are left at zero for
    the next call (three calls with new lengths each). ``min_slice``: slices of at least that many tokens (40 →
    three 16-token tiles), so short contexts run unsplit and longer ones in fewer, longer slices."""
    Hq, Hk, D = 4, 2, 32
    for lens in ([1, 5, 100, 300], [64, 2, 17, 129], [300, 300, 1, 16]):
        q, kc, vc, tables, ctx = _paged_case(lens, Hq, Hk, D, 16, torch.float32, gen)
        wide = torch.full((len(lens), 256), -1, dtype=torch.int32)  # room for 4,096 tokens, as a graph reserves
        wide[:, : tables.shape[1]] = tables
        out = poisoned(q.shape, torch.float32, "cpu")
        y = paged_decode_attention(q, kc, vc, wide, ctx, D**-0.5, out=out, splits=32, block_n=16, min_slice=min_slice)
        ref = ops.paged_decode_attention(q, kc.nan_to_num(), vc.nan_to_num(), tables, ctx, D**-0.5)
        assert_close(y, ref, 1e-5, 1e-5, f"paged decode {lens}")


def test_many_slices_merge_in_chunks_like_the_tile(gen, monkeypatch):
    """``SEQ_MERGE_CHUNKS = 2``: contexts of 17-32 slices (beyond ``SEQ_MERGE_SLICES``) are merged slice by slice,
    16 at a time, instead of as one tile reduction: the same attention to fp32 rounding; 16 slices or fewer keep
    ``merge_slices`` and more than 32 the tile, bit for bit as before. A graph's bound (4,096 tokens) in 64 slices
    of 16-token tiles: the contexts below take 1, 9, 20, 32 and 40 slices."""
    from kernellab.kernels import paged_attention

    lens = [16, 140, 320, 512, 640]
    Hq, Hk, D = 4, 2, 32
    q, kc, vc, narrow, ctx = _paged_case(lens, Hq, Hk, D, 16, torch.float32, gen)
    tables = torch.full((len(lens), 256), -1, dtype=torch.int32)
    tables[:, : narrow.shape[1]] = narrow
    kw = {"splits": 64, "block_n": 16, "min_slice": 16}
    monkeypatch.setattr(paged_attention, "SEQ_MERGE_SLICES", 16)
    tile = paged_decode_attention(q, kc, vc, tables, ctx, D**-0.5, **kw)
    monkeypatch.setattr(paged_attention, "SEQ_MERGE_CHUNKS", 2)
    with record_launches() as seen:
        chunked = paged_decode_attention(q, kc, vc, tables, ctx, D**-0.5, **kw)
    assert seen[0]["constexprs"]["SEQ_CHUNKS"] == 2 and seen[0]["constexprs"]["SEQ_S"] == 16
    ref = ops.paged_decode_attention(q, kc.nan_to_num(), vc.nan_to_num(), narrow, ctx, D**-0.5)
    assert_close(chunked, ref, 1e-5, 1e-5, "chunked merge")
    assert torch.equal(chunked[[0, 1, 4]], tile[[0, 1, 4]])  # 1, 9 and 40 slices: the merges they had before
    assert_close(chunked[[2, 3]], tile[[2, 3]], 1e-6, 1e-6, "chunked against tile")


@pytest.mark.parametrize(
    "lens, splits, min_slice", [([1, 17, 50, 3], None, None), ([300, 2, 64, 129], 32, None), ([300, 65], 32, 40)]
)
def test_paged_decode_attention_qk_norm_rope(lens, splits, min_slice, gen):
    """The fused decode op against its reference (QK-norm + RoPE + KV write, then paged decode attention): the same
    output, the new token written at its slot (a slot < 0 left alone), every other cache row untouched. q/k/v are
    strided views of one fused projection row, as the model passes them."""
    from kernellab.kernels.paged_attention import paged_decode_attention_qk_norm_rope

    Hq, Hk, D, bs = 4, 2, 32, 16
    B = len(lens)
    _, kc, vc, tables, ctx = _paged_case(lens, Hq, Hk, D, bs, torch.float32, gen)
    kc, vc = kc.nan_to_num(), vc.nan_to_num()
    qkv = torch.randn(B, (Hq + 2 * Hk) * D, generator=gen)
    q, k, v = (x.view(B, -1, D) for x in qkv.split([Hq * D, Hk * D, Hk * D], dim=-1))
    slots = torch.tensor([int(tables[b, (n - 1) // bs]) * bs + (n - 1) % bs for b, n in enumerate(lens)])
    slots[-1] = -1  # a padding row: nothing written, its cache row keeps the old value
    qw = 1 + 0.2 * torch.randn(D, generator=gen)
    kw = 1 + 0.2 * torch.randn(D, generator=gen)
    cos_sin = ops.rope_cos_sin_cache(D, 512, 1e6)
    wide = torch.full((B, 64), -1, dtype=torch.int32)
    wide[:, : tables.shape[1]] = tables
    kc_ref, vc_ref = kc.clone(), vc.clone()
    ref = ops.paged_decode_attention_qk_norm_rope(
        q, k, v, qw, kw, 1e-6, cos_sin, kc_ref, vc_ref, slots, tables, ctx, D**-0.5
    )
    out = poisoned((B, Hq, D), torch.float32, "cpu")
    y = paged_decode_attention_qk_norm_rope(
        q, k, v, qw, kw, 1e-6, cos_sin, kc, vc, slots, wide, ctx, D**-0.5, out=out, splits=splits, block_n=16,
        min_slice=min_slice,
    )  # fmt: skip
    # the padding row attends its new token from registers but the reference reads its (unwritten) cache row
    assert_close(y[:-1], ref[:-1], 1e-5, 1e-5, "fused decode")
    assert_close(kc, kc_ref, 1e-5, 1e-5, "k cache")  # the written rows as rope.py writes them, others untouched
    assert torch.equal(vc, vc_ref)


@pytest.mark.parametrize("dtype, atol, rtol", ATTN_DTYPES)
@pytest.mark.parametrize(
    "Tq, Tk, Hq, Hk, D, block_m, block_n",
    [
        (1, 1, 2, 1, 32, 16, 16),
        (37, 37, 4, 2, 32, 16, 16),
        (5, 40, 2, 2, 16, 16, 16),
        (70, 70, 4, 2, 64, 32, 16),
        (70, 70, 4, 2, 64, 16, 32),  # query tiles narrower than the key tiles (the 64 x 128 setting's kind)
    ],
)
@pytest.mark.parametrize("heavy_first, warp_specialize", [(False, False), (True, True)])
def test_causal_attention_through_tensor_descriptors(
    Tq, Tk, Hq, Hk, D, block_m, block_n, heavy_first, warp_specialize, dtype, atol, rtol, gen
):
    """The Hopper form (TMA tiles, query tiles longest first, the key loop warp-specialised) against the
    reference, on q/k/v as the engine has them: strided views of one fused QKV row per token."""
    qkv = torch.randn(Tk, (Hq + 2 * Hk) * D, generator=gen).to(dtype)
    q, k, v = (x.view(Tk, -1, D) for x in qkv.split([Hq * D, Hk * D, Hk * D], dim=-1))
    q = q[Tk - Tq :]  # the queries at the end of their keys
    out = poisoned(q.shape, dtype, "cpu")
    y = causal_attention(
        q, k, v, D**-0.5, Hq // Hk, out=out, block_m=block_m, block_n=block_n, tma=True,
        heavy_first=heavy_first, warp_specialize=warp_specialize,
    )  # fmt: skip
    ref = ops.causal_attention(q.float(), k.float(), v.float(), D**-0.5, Hq // Hk).to(dtype)
    assert_close(y, ref, atol, rtol, "attention (descriptors)")


def test_the_descriptor_form_refuses_what_tma_cannot_read(gen):
    q, k = torch.randn(8, 2, 24, generator=gen), torch.randn(8, 1, 24, generator=gen)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        causal_attention(q, k, k, 0.2, 2, tma=True)
    q, k = torch.randn(8, 2, 32, generator=gen), torch.randn(8, 1, 32, generator=gen)
    with pytest.raises(ValueError, match="contiguous"):
        causal_attention(q, k, k, 0.2, 2, tma=True, out=torch.empty(2, 8, 32).transpose(0, 1))


@pytest.mark.parametrize("dtype, atol, rtol", ATTN_DTYPES)
@pytest.mark.parametrize("lens", [[37, 5, 70], [16, 0, 33, 1], [1, 1], [50, 0, 0]])
def test_packed_prompts_in_one_launch_from_device_offsets(lens, dtype, atol, rtol, gen):
    """``packed_causal_attention``: several fresh prompts, their offsets on the device and only an upper bound of
    the rows on the host (as a CUDA graph of a bucket has them: zero-length prompts pad the offsets, rows past the
    last prompt belong to none and stay as they were), each prompt equal to its own causal attention."""
    from kernellab.kernels.attention import packed_causal_attention, varlen_causal_attention

    Hq, Hk, D = 4, 2, 32
    n, bucket = sum(lens), sum(lens) + 9  # the bucket's rows: 9 past the last prompt
    qkv = torch.randn(bucket, (Hq + 2 * Hk) * D, generator=gen).to(dtype)
    q, k, v = (x.view(bucket, -1, D) for x in qkv.split([Hq * D, Hk * D, Hk * D], dim=-1))
    cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
    out = torch.full((bucket, Hq, D), 7.0, dtype=dtype)
    y = packed_causal_attention(
        q, k, v, torch.tensor(cu, dtype=torch.int32), bucket, D**-0.5, out=out, block_m=16, block_n=16
    )
    for s, e in itertools.pairwise(cu):
        if e > s:
            ref = ops.causal_attention(q[s:e].float(), k[s:e].float(), v[s:e].float(), D**-0.5, Hq // Hk).to(dtype)
            assert_close(y[s:e], ref, atol, rtol, f"prompt {s}:{e}")
    assert torch.equal(y[n:], torch.full_like(y[n:], 7.0))  # the padding rows: untouched
    # the op: the device offsets with a graph's host bounds ([0, bucket, bucket, …]) give the same rows
    host = [0] + [bucket] * len(lens)
    z = varlen_causal_attention(q, k, v, host, D**-0.5, cu_device=torch.tensor(cu, dtype=torch.int32))
    assert_close(z[:n], y[:n], atol, rtol, "the op (its own tiles)")


@pytest.mark.parametrize("Hq, Hk, D", [(4, 2, 32), (6, 2, 32)])  # o_proj's K a power of two; not (padded heads)
def test_decode_attention_o_proj_merges_deferred_slices_in_the_projection(gen, Hq, Hk, D):
    """Batch-1 decode's attention + output projection: at a context of 2 to ``gemv.DEFER_MAX_SLICES`` slices the
    attention leaves its slices unmerged and the GEMV merges them as it loads x; the result equals the two ops' bit
    for bit at every slice count (1; 2 to 4, deferred; 5 and 7, which the attention merges itself), and the
    reference within bf16's rounding. The contexts run one after another on the same cached workspaces and
    semaphores, as decode steps do."""
    from kernellab.kernels import gemv
    from kernellab.kernels.linear import linear
    from kernellab.kernels.paged_attention import decode_attention_o_proj, paged_decode_attention_qk_norm_rope

    assert gemv.DEFER_MAX_SLICES == 4  # the contexts below cover the deferred range and both sides of it
    bs, hidden = 16, 48
    dt = torch.bfloat16
    cos_sin = ops.rope_cos_sin_cache(D, 1024, 1e6).to(dt)
    qw = (1 + 0.2 * torch.randn(D, generator=gen)).to(dt)
    kw = (1 + 0.2 * torch.randn(D, generator=gen)).to(dt)
    w_o = (0.1 * torch.randn(hidden, Hq * D, generator=gen)).to(dt)
    for ctx_len in (1, 64, 65, 128, 129, 256, 300, 100, 420, 200):  # 64-token slices: 1, 1, 2, 2, 3, 4, 5, 2, 7, 4
        _, kc, vc, tables, ctx = _paged_case([ctx_len], Hq, Hk, D, bs, dt, gen)
        kc, vc = kc.nan_to_num(), vc.nan_to_num()
        wide = torch.full((1, 32), -1, dtype=torch.int32)  # the bound a graph captures: 512 tokens, 8 slices
        wide[:, : tables.shape[1]] = tables
        qkv = torch.randn(1, (Hq + 2 * Hk) * D, generator=gen).to(dt)
        q, k, v = (x.view(1, -1, D) for x in qkv.split([Hq * D, Hk * D, Hk * D], dim=-1))
        slots = torch.tensor([int(tables[0, (ctx_len - 1) // bs]) * bs + (ctx_len - 1) % bs])
        args = (q, k, v, qw, kw, 1e-6, cos_sin)
        kc2, vc2, kc_ref, vc_ref = kc.clone(), vc.clone(), kc.clone(), vc.clone()
        y = decode_attention_o_proj(*args, kc, vc, slots, wide, ctx, D**-0.5, w_o)
        o = paged_decode_attention_qk_norm_rope(*args, kc2, vc2, slots, wide, ctx, D**-0.5)
        two_ops = linear(o.reshape(1, Hq * D), w_o)
        assert torch.equal(y, two_ops), f"context {ctx_len}: not the two ops' bits"
        assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
        ref = ops.decode_attention_o_proj(
            *(t.float() for t in (q, k, v, qw, kw)), 1e-6, cos_sin.float(), kc_ref.float(), vc_ref.float(), slots,
            tables, ctx, D**-0.5, w_o.float(),
        )  # fmt: skip
        assert_close(y, ref.to(dt), 3e-2, 3e-2, f"context {ctx_len}")


def test_decode_attention_o_proj_defer_bound_is_read_at_launch(gen, monkeypatch):
    """``gemv.DEFER_MAX_SLICES`` is a knob read at each launch: at 2 a three-slice context is merged by the
    attention, and the result is the same bits as when the projection merges it."""
    from kernellab.kernels import gemv
    from kernellab.kernels.paged_attention import decode_attention_o_proj

    Hq, Hk, D, bs = 4, 2, 32, 16
    dt = torch.bfloat16
    cos_sin = ops.rope_cos_sin_cache(D, 1024, 1e6).to(dt)
    nw = torch.ones(D).to(dt)
    w_o = (0.1 * torch.randn(24, Hq * D, generator=gen)).to(dt)
    _, kc, vc, tables, ctx = _paged_case([150], Hq, Hk, D, bs, dt, gen)
    kc, vc = kc.nan_to_num(), vc.nan_to_num()
    qkv = torch.randn(1, (Hq + 2 * Hk) * D, generator=gen).to(dt)
    q, k, v = (x.view(1, -1, D) for x in qkv.split([Hq * D, Hk * D, Hk * D], dim=-1))
    slots = torch.tensor([int(tables[0, 149 // bs]) * bs + 149 % bs])
    runs = {}
    for bound in (4, 2):
        monkeypatch.setattr(gemv, "DEFER_MAX_SLICES", bound)
        with record_launches() as launches:
            runs[bound] = decode_attention_o_proj(q, k, v, nw, nw, 1e-6, cos_sin, kc.clone(), vc.clone(), slots,
                                                  tables, ctx, D**-0.5, w_o)  # fmt: skip
        att = [la["constexprs"] for la in launches if la["kernel"] == "_paged_decode_kernel"]
        assert [c["DEFER"] for c in att] == [bound]
    assert torch.equal(runs[4], runs[2])


def test_decode_attention_o_proj_at_several_rows_is_the_two_ops(gen):
    from kernellab.kernels.paged_attention import decode_attention_o_proj

    Hq, Hk, D, bs = 4, 2, 32, 16
    lens = [70, 3, 129]
    _, kc, vc, tables, ctx = _paged_case(lens, Hq, Hk, D, bs, torch.float32, gen)
    kc, vc = kc.nan_to_num(), vc.nan_to_num()
    qkv = torch.randn(3, (Hq + 2 * Hk) * D, generator=gen)
    q, k, v = (x.view(3, -1, D) for x in qkv.split([Hq * D, Hk * D, Hk * D], dim=-1))
    slots = torch.tensor([int(tables[b, (n - 1) // bs]) * bs + (n - 1) % bs for b, n in enumerate(lens)])
    qw, kw = torch.ones(D), torch.ones(D)
    cos_sin = ops.rope_cos_sin_cache(D, 512, 1e6)
    w_o = torch.randn(24, Hq * D, generator=gen)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    y = decode_attention_o_proj(q, k, v, qw, kw, 1e-6, cos_sin, kc, vc, slots, tables, ctx, D**-0.5, w_o)
    ref = ops.decode_attention_o_proj(q, k, v, qw, kw, 1e-6, cos_sin, kc_ref, vc_ref, slots, tables, ctx, D**-0.5, w_o)
    assert y.shape == (3, 24)
    assert_close(y, ref, 1e-4, 1e-4, "three rows")


def test_sequential_merge_bound_changes_only_the_sum_order(gen, monkeypatch):
    """``paged_attention.SEQ_MERGE_SLICES`` picks how the last slice merges (one by one, or one reduction over the
    tile): a five-slice context through either path gives the same attention up to fp32 summation order."""
    from kernellab.kernels import paged_attention as pa

    Hq, Hk, D, bs = 4, 2, 32, 16
    q, kc, vc, tables, ctx = _paged_case([300], Hq, Hk, D, bs, torch.float32, gen)
    wide = torch.full((1, 32), -1, dtype=torch.int32)
    wide[:, : tables.shape[1]] = tables
    outs = {}
    for bound in (4, 8):  # five slices: the tile's reduction, then the slice-by-slice merge
        monkeypatch.setattr(pa, "SEQ_MERGE_SLICES", bound)
        with record_launches() as launches:
            outs[bound] = paged_decode_attention(q, kc.nan_to_num(), vc.nan_to_num(), wide, ctx, D**-0.5)
        assert [la["constexprs"]["SEQ_S"] for la in launches] == [bound]
    assert_close(outs[8], outs[4], 1e-6, 1e-6, "merge order")


def test_idle_slices_wait_is_a_knob_read_at_launch(gen, monkeypatch):
    """``paged_attention.IDLE_SLICES_WAIT`` reaches the fused decode attention's launch, and the output does not
    depend on it (on the interpreter no program waits for anything: the A/B of its effect runs on the GPU)."""
    from kernellab.kernels import paged_attention as pa

    Hq, Hk, D, bs = 4, 2, 32, 16
    dt = torch.bfloat16
    cos_sin = ops.rope_cos_sin_cache(D, 1024, 1e6).to(dt)
    nw = torch.ones(D).to(dt)
    _, kc, vc, tables, ctx = _paged_case([100], Hq, Hk, D, bs, dt, gen)
    wide = torch.full((1, 32), -1, dtype=torch.int32)
    wide[:, : tables.shape[1]] = tables
    qkv = torch.randn(1, (Hq + 2 * Hk) * D, generator=gen).to(dt)
    q, k, v = (x.view(1, -1, D) for x in qkv.split([Hq * D, Hk * D, Hk * D], dim=-1))
    slots = torch.tensor([int(tables[0, 99 // bs]) * bs + 99 % bs])
    outs = {}
    for wait in (True, False):
        monkeypatch.setattr(pa, "IDLE_SLICES_WAIT", wait)
        with record_launches() as launches:
            outs[wait] = pa.paged_decode_attention_qk_norm_rope(
                q, k, v, nw, nw, 1e-6, cos_sin, kc.nan_to_num(), vc.nan_to_num(), slots, wide, ctx, D**-0.5
            )
        assert [la["constexprs"]["IDLE_WAIT"] for la in launches] == [wait]
    assert torch.equal(outs[True], outs[False])
