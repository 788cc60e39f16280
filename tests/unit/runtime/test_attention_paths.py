"""A step that mixes decode rows, fresh prompts and chunks continuing a cached context: the fresh prompts take
the batched path over the step's own K/V, only the continuing chunks read the cache, and every row equals
what the all-from-cache reference gives."""

from __future__ import annotations

import os

import torch

from kernellab.kernels.compile_check import record_launches
from kernellab.runtime import ops
from kernellab.runtime.attention import AttentionMetadata, ContextGather, paged_attention
from kernellab.runtime.dispatch import build_ops
from kernellab.runtime.request.block_manager import slot_of

HQ, HK, D, BS = 4, 2, 16, 4


def test_mixed_step_equals_the_all_from_cache_reference():
    gen = torch.Generator().manual_seed(0)
    # (cached context before this step, new tokens in this step): 2 decode rows, 2 fresh prompts, 2 continuing
    rows = [(9, 1), (3, 1), (0, 7), (0, 5), (6, 4), (12, 9)]
    k_cache = torch.zeros(64, BS, HK, D)
    v_cache = torch.zeros(64, BS, HK, D)
    tables, next_block = [], 0
    for cached, new in rows:
        n = -(-(cached + new) // BS)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    # the cached context of every row is already in the cache
    for (cached, _), table in zip(rows, tables, strict=True):
        slots = torch.tensor([slot_of(table, p, BS) for p in range(cached)], dtype=torch.long)
        ops.store_kv(
            torch.randn(cached, HK, D, generator=gen),
            torch.randn(cached, HK, D, generator=gen),
            k_cache,
            v_cache,
            slots,
        )
    total = sum(new for _, new in rows)
    q, k, v = (torch.randn(total, h, D, generator=gen) for h in (HQ, HK, HK))
    slots = torch.tensor(
        [slot_of(t, p, BS) for (c, n), t in zip(rows, tables, strict=True) for p in range(c, c + n)], dtype=torch.long
    )
    ops.store_kv(k, v, k_cache, v_cache, slots)

    def meta(num_fresh: int, gather: bool = False) -> AttentionMetadata:
        pre = rows[2:]
        cu = [0]
        for _, n in pre:
            cu.append(cu[-1] + n)
        width = max(len(t) for t in tables)
        pad = [t + [-1] * (width - len(t)) for t in tables]
        return AttentionMetadata(
            positions=torch.zeros(total, dtype=torch.long),
            slot_mapping=slots,
            num_decode_tokens=2,
            decode_block_tables=torch.tensor(pad[:2], dtype=torch.int32),
            decode_context_lens=torch.tensor([c + n for c, n in rows[:2]], dtype=torch.int32),
            prefill_block_tables=torch.tensor(pad[2:], dtype=torch.int32),
            prefill_cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
            prefill_context_lens=torch.tensor([c + n for c, n in pre], dtype=torch.int32),
            logits_indices=torch.zeros(1, dtype=torch.long),
            prefill_cu_seqlens_host=cu,
            prefill_num_fresh=num_fresh,
            prefill_gather=ContextGather.build(
                tables[2 + num_fresh :], [c + n for c, n in pre[num_fresh:]], [n for _, n in pre[num_fresh:]], BS, "cpu"
            )
            if gather
            else None,
        )

    torch_ops = build_ops("none", torch.device("cpu"))
    reference = paged_attention(torch_ops, q, k, v, k_cache, v_cache, meta(0), D**-0.5)  # every chunk from the cache
    mixed = paged_attention(torch_ops, q, k, v, k_cache, v_cache, meta(2), D**-0.5)
    torch.testing.assert_close(mixed, reference, atol=1e-5, rtol=1e-5)
    # the continuing chunks read through one gather of their contexts (what the runner builds) instead of a
    # gather and an attention call per chunk
    gathered = paged_attention(torch_ops, q, k, v, k_cache, v_cache, meta(2, gather=True), D**-0.5)
    torch.testing.assert_close(gathered, reference, atol=1e-5, rtol=1e-5)
    every_chunk_gathered = paged_attention(torch_ops, q, k, v, k_cache, v_cache, meta(0, gather=True), D**-0.5)
    torch.testing.assert_close(every_chunk_gathered, reference, atol=1e-5, rtol=1e-5)
    # and the fresh rows alone, as a step of only fresh prompts computes them
    fresh_rows = slice(2, 2 + 7 + 5)
    alone = ops.varlen_causal_attention(q[fresh_rows], k[fresh_rows], v[fresh_rows], [0, 7, 12], D**-0.5)
    torch.testing.assert_close(mixed[fresh_rows], alone)
    if os.environ.get("TRITON_INTERPRET"):  # the Triton op: both fresh prompts in one launch, device offsets
        from kernellab.kernels.testing import patch_interpreter

        patch_interpreter()
        triton_ops = build_ops(
            "accepted", torch.device("cpu"), status={"varlen_causal_attention": {"status": "accepted"}}
        )
        assert triton_ops.enabled == ("varlen_causal_attention",)
        with record_launches() as launches:  # inside a whole-step graph (its capture and warm-ups)
            fused = paged_attention(triton_ops, q, k, v, k_cache, v_cache, meta(2, gather=True), D**-0.5, graphed=True)
        assert [x["kernel"] for x in launches] == ["_packed_causal_attention_kernel"]
        torch.testing.assert_close(fused, reference, atol=1e-5, rtol=1e-5)
        with record_launches() as launches:  # eagerly, between piecewise graphs: the torch path (PREFILL_TRITON_EAGER)
            eager = paged_attention(triton_ops, q, k, v, k_cache, v_cache, meta(2, gather=True), D**-0.5)
        assert launches == []
        torch.testing.assert_close(eager, reference, atol=1e-5, rtol=1e-5)


def test_context_gather_reads_an_fp8_cache_as_the_paged_reference_does():
    """The gathered context of continuing chunks equals the paged reference's per-chunk read, FP8 included."""
    from kernellab.runtime.attention import gather_context

    gen = torch.Generator().manual_seed(1)
    blocks = 12
    k_cache, k_scales = ops.quantize_kv(torch.randn(blocks, BS, HK, D, generator=gen))
    tables = [[7, 2, 9], [0, 11]]
    lens = [10, 6]
    g = ContextGather.build(tables, lens, [3, 2], BS, "cpu")
    assert g.cu_q_host == [0, 3, 5] and g.cu_k_host == [0, 10, 16]
    got = gather_context(k_cache, g.slots, k_scales, torch.float32)
    want = torch.cat(
        [
            ops._gather_context(k_cache, torch.tensor(t, dtype=torch.int32), n, k_scales)
            for t, n in zip(tables, lens, strict=True)
        ]
    )
    torch.testing.assert_close(got, want, atol=0, rtol=0)
