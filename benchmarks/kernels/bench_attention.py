"""Attention: the tiled causal prefill kernel (teaching) and the split-KV paged decode kernel.

Prefill FLOPs: 4·Hq·D·(number of causal query-key pairs), against the bf16 matmul ceiling.
Decode bytes: K and V of every context token for every KV head (2·Σ_b L_b·Hk·D·2) + q and out (2·B·Hq·D·2) +
the block tables (4·B·max_blocks). Targets: ≥ 70 % of the read bandwidth at batch 64 × context 1,024 and
≥ 50 % at batch 1 × context 4,096.
"""

from __future__ import annotations

import functools

import torch

from kernellab.kernels.attention import PREFILL_LAUNCH, causal_attention
from kernellab.kernels.paged_attention import paged_decode_attention, paged_decode_attention_qk_norm_rope
from kernellab.runtime import ops

from .harness import HEAD_DIM, HK, HQ, Case, main_for, randn

BLOCK = 16


def paged_inputs(lens, Hq, Hk, D, block_size, device):
    B = len(lens)
    per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(per_seq)
    k_cache = randn(num_blocks, block_size, Hk, D, device=device)
    v_cache = randn(num_blocks, block_size, Hk, D, device=device)
    perm = torch.randperm(num_blocks, device=device).to(torch.int32)
    tables = torch.full((B, max(per_seq)), -1, dtype=torch.int32, device=device)
    start = 0
    for b, n in enumerate(per_seq):
        tables[b, :n] = perm[start : start + n]
        start += n
    q = randn(B, Hq, D, device=device)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32, device=device), D**-0.5


def flash_reference(q, k, v, scale, group):
    """The fastest PyTorch path for the same causal GQA attention: 4-D SDPA (FlashAttention backend)."""
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        is_causal=True,
        scale=scale,
        enable_gqa=True,
    )
    return o[0].transpose(0, 1)


def fused_decode_inputs(lens, Hq, Hk, D, block_size, device):
    """A decode step's raw q/k/v rows (views of one fused projection row), Qwen3's norm weights and RoPE table,
    and the slots of each sequence's new token: ``paged_decode_attention_qk_norm_rope``'s arguments."""
    _, k_cache, v_cache, tables, ctx, scale = paged_inputs(lens, Hq, Hk, D, block_size, device)
    B = len(lens)
    qkv = randn(B, (Hq + 2 * Hk) * D, device=device)
    q, k, v = (x.view(B, -1, D) for x in qkv.split([Hq * D, Hk * D, Hk * D], dim=-1))
    last = ctx.long() - 1
    slots = tables.gather(1, (last // block_size)[:, None])[:, 0].long() * block_size + last % block_size
    w = 1 + 0.1 * randn(2, D, device=device)
    cos_sin = ops.rope_cos_sin_cache(D, max(lens), 1e6, device=device)
    return q, k, v, w[0], w[1], 1e-6, cos_sin, k_cache, v_cache, slots, tables, ctx, scale


def decode_bytes(lens, Hq, Hk, D, max_blocks):
    return 2 * sum(lens) * Hk * D * 2 + 2 * len(lens) * Hq * D * 2 + 4 * len(lens) * max_blocks


def cases(device: str, real: bool) -> list[Case]:
    Hq, Hk, D = (HQ, HK, HEAD_DIM) if real else (4, 2, 32)
    out = []
    g = torch.Generator().manual_seed(0)
    decode = (
        {
            "B=64,ctx=1024": ([1024] * 64, 70.0),
            "B=1,ctx=4096": ([4096], 50.0),
            "B=64,ctx=1..2048 mixed": (torch.randint(1, 2049, (64,), generator=g).tolist(), None),
        }
        if real
        else {"B=3,ctx=mixed": ([1, 17, 50], None)}
    )
    for i, (label, (lens, target)) in enumerate(decode.items()):
        max_blocks = -(-max(lens) // BLOCK)
        nbytes = decode_bytes(lens, Hq, Hk, D, max_blocks)
        make = functools.partial(paged_inputs, lens, Hq, Hk, D, BLOCK, device)
        out.append(
            Case(
                "paged_decode_attention",
                f"{label},Hq={Hq},Hk={Hk},D={D},bs={BLOCK}",
                "bf16",
                make,
                paged_decode_attention,
                ops.paged_decode_attention,
                bytes=nbytes,
                target_pct=target,
                atol=2e-2,
                rtol=2e-2,
                compile_ref=i < 2,
                ref_graph=False,
                group="paged_attention",
                notes="reference gathers every sequence's blocks (host sync on max length)",
            )
        )
        if not real or target is None:
            continue
        variants = (
            [(2, 64, 4, 2), (4, 64, 4, 2), (None, 128, 8, 2), (None, 64, 8, 3)]
            if len(lens) > 1
            else [(64, 64, 4, 2), (16, 128, 8, 2), (32, 128, 8, 2), (8, 128, 8, 2), (None, 64, 8, 3)]
        )
        for splits, bn, w, st in variants:
            fn = functools.partial(paged_decode_attention, splits=splits, block_n=bn, num_warps=w, num_stages=st)
            out.append(
                Case(
                    "paged_decode_attention",
                    f"{label},Hq={Hq},Hk={Hk},D={D},bs={BLOCK}",
                    "bf16",
                    make,
                    fn,
                    ops.paged_decode_attention,
                    bytes=nbytes,
                    atol=2e-2,
                    rtol=2e-2,
                    variant=f"s{splits or 'auto'}_n{bn}_w{w}_st{st}",
                    group="paged_attention",
                )
            )
    # The decode attention with Qwen3's QK-norm, RoPE and KV write inside (batch-1 decode steps take it); its
    # reference is the two-op form: the norm/RoPE/KV-write kernel's torch reference, then the decode attention's.
    fused = (
        {"B=1,ctx=128": [128], "B=1,ctx=2048": [2048], "B=64,ctx=1024": [1024] * 64} if real else {"B=3": [1, 17, 50]}
    )
    for label, lens in fused.items():
        max_blocks = -(-max(lens) // BLOCK)
        out.append(
            Case(
                "paged_decode_attention_qk_norm_rope",
                f"{label},Hq={Hq},Hk={Hk},D={D},bs={BLOCK}",
                "bf16",
                functools.partial(fused_decode_inputs, lens, Hq, Hk, D, BLOCK, device),
                paged_decode_attention_qk_norm_rope,
                ops.paged_decode_attention_qk_norm_rope,
                bytes=decode_bytes(lens, Hq, Hk, D, max_blocks) + len(lens) * (Hq + 2 * Hk) * D * 2,
                atol=2e-2,
                rtol=2e-2,
                compile_ref=False,
                ref_graph=False,
                group="paged_attention",
                notes="reference: ops.qk_norm_rope_store_kv then ops.paged_decode_attention (a host sync)",
            )
        )
    for i, T in enumerate((2048, 4096) if real else (40,)):
        pairs = T * (T + 1) // 2

        def make(T=T):
            return (
                randn(T, Hq, D, device=device),
                randn(T, Hk, D, device=device),
                randn(T, Hk, D, device=device),
                D**-0.5,
                Hq // Hk,
            )

        # on the GPU the engine's launch (the Hopper form: descriptor tiles, longest query tiles first)
        fn = (
            functools.partial(causal_attention, **PREFILL_LAUNCH)
            if real
            else functools.partial(causal_attention, block_m=16, block_n=16)
        )
        out.append(
            Case(
                "causal_attention",
                f"T={T},Hq={Hq},Hk={Hk},D={D}",
                "bf16",
                make,
                fn,
                ops.causal_attention,
                flops=4 * Hq * D * pairs,
                atol=2e-2,
                rtol=2e-2,
                teaching=True,
                compile_ref=i == 0,
                group="attention",
                notes="reference ops.causal_attention: 4-D SDPA after repeat_interleave of K/V",
            )
        )
        if real:
            out.append(
                Case(
                    "causal_attention",
                    f"T={T},Hq={Hq},Hk={Hk},D={D} vs FlashAttention",
                    "bf16",
                    make,
                    fn,
                    flash_reference,
                    flops=4 * Hq * D * pairs,
                    atol=2e-2,
                    rtol=2e-2,
                    teaching=True,
                    compile_ref=False,
                    group="attention",
                    notes="reference: 4-D SDPA, is_causal, enable_gqa (PyTorch's FlashAttention backend)",
                )
            )
    return out


if __name__ == "__main__":
    main_for(cases)
