"""RoPE (Q and K together), Qwen3's QK-norm + RoPE, the fused QK-norm + RoPE + paged KV write, and the KV write.

q, k, v are strided views into one fused QKV projection output, as in the model. Bytes per token:
- rotary / qk_norm_rope: read q and k ((Hq+Hk)·D·2) + the fp32 cos/sin row (D·4) + the position (8),
  write q and k ((Hq+Hk)·D·2);
- fused with the KV write: additionally read v (Hk·D·2) and write the K and V cache rows (2·Hk·D·2);
- store_kv: read k, v and write both cache rows (4·Hk·D·2) + the slot (8).
"""

from __future__ import annotations

import torch

from kernellab.kernels.kv_cache import store_kv
from kernellab.kernels.rope import qk_norm_rope, qk_norm_rope_store_kv, rotary_embedding
from kernellab.runtime import ops

from .harness import EPS, HEAD_DIM, HK, HQ, PREFILL_T, Case, main_for, randn

MAX_POS = 40960
BLOCK = 16


def _views(T, Hq, Hk, D, device):
    qkv = randn(T, (Hq + 2 * Hk) * D, device=device, scale=2.0)
    return (
        qkv[:, : Hq * D].view(T, Hq, D),
        qkv[:, Hq * D : (Hq + Hk) * D].view(T, Hk, D),
        qkv[:, (Hq + Hk) * D :].view(T, Hk, D),
    )


def _check_fused(args):
    ref_args = list(args)
    ref_args[8], ref_args[9] = args[8].clone(), args[9].clone()
    tri_args = list(args)
    tri_args[8], tri_args[9] = args[8].clone(), args[9].clone()
    q, k = qk_norm_rope_store_kv(*tri_args)
    q_ref, k_ref = ops.qk_norm_rope_store_kv(*ref_args)
    errs = [
        (a.double() - b.double()).abs().max().item()
        for a, b in ((q, q_ref), (k, k_ref), (tri_args[8], ref_args[8]), (tri_args[9], ref_args[9]))
    ]
    return max(errs) <= 1.6e-2 * 8, max(errs)


def _check_store(args):
    kc, vc = args[2].clone(), args[3].clone()
    kr, vr = args[2].clone(), args[3].clone()
    store_kv(args[0], args[1], kc, vc, args[4])
    ops.store_kv(args[0], args[1], kr, vr, args[4])
    return bool(torch.equal(kc, kr) and torch.equal(vc, vr)), 0.0


def cases(device: str, real: bool) -> list[Case]:
    Hq, Hk, D = (HQ, HK, HEAD_DIM) if real else (4, 2, 32)
    cos_sin = ops.rope_cos_sin_cache(D, MAX_POS if real else 256, 1e6, device=device)
    max_pos = cos_sin.shape[0]
    token_counts = (PREFILL_T, 64) if real else (9, 1)

    def rope_args(T, norm):
        def make():
            q, k, _ = _views(T, Hq, Hk, D, device)
            pos = torch.randint(0, max_pos, (T,), device=device)
            if not norm:
                return pos, q, k, cos_sin
            return (
                pos,
                q,
                k,
                1 + randn(D, device=device, scale=0.1),
                1 + randn(D, device=device, scale=0.1),
                EPS,
                cos_sin,
            )

        return make

    def fused_args(T):
        def make():
            q, k, v = _views(T, Hq, Hk, D, device)
            pos = torch.randint(0, max_pos, (T,), device=device)
            n_blocks = -(-T // BLOCK) + 1
            k_cache = randn(n_blocks, BLOCK, Hk, D, device=device)
            v_cache = randn(n_blocks, BLOCK, Hk, D, device=device)
            slots = torch.randperm(n_blocks * BLOCK, device=device)[:T]
            return (
                pos,
                q,
                k,
                v,
                1 + randn(D, device=device, scale=0.1),
                1 + randn(D, device=device, scale=0.1),
                EPS,
                cos_sin,
                k_cache,
                v_cache,
                slots,
            )

        return make

    def store_args(T):
        def make():
            _, k, v = _views(T, Hq, Hk, D, device)
            n_blocks = -(-T // BLOCK) + 1
            return (
                k,
                v,
                randn(n_blocks, BLOCK, Hk, D, device=device),
                randn(n_blocks, BLOCK, Hk, D, device=device),
                torch.randperm(n_blocks * BLOCK, device=device)[:T],
            )

        return make

    out = []
    for i, T in enumerate(token_counts):
        rope_bytes = T * ((Hq + Hk) * D * 2 * 2 + D * 4 + 8)
        fused_bytes = rope_bytes + T * (Hk * D * 2 + 2 * Hk * D * 2 + 8)
        first = i == 0
        out.append(
            Case(
                "qk_norm_rope_store_kv",
                f"T={T},Hq={Hq},Hk={Hk},D={D}",
                "bf16",
                fused_args(T),
                qk_norm_rope_store_kv,
                ops.qk_norm_rope_store_kv,
                bytes=fused_bytes,
                check=_check_fused,
                ref_graph=False,
                compile_ref=first,
                group="rope",
                notes="reference ops.qk_norm_rope_store_kv = qk_norm_rope then store_kv (its boolean mask syncs the host)",
            )
        )
        if not first:
            continue
        out.append(
            Case(
                "qk_norm_rope",
                f"T={T},Hq={Hq},Hk={Hk},D={D}",
                "bf16",
                rope_args(T, True),
                qk_norm_rope,
                ops.qk_norm_rope,
                bytes=rope_bytes,
                atol=1.6e-2,
                rtol=1.6e-2,
                group="rope",
            )
        )
        out.append(
            Case(
                "rotary_embedding",
                f"T={T},Hq={Hq},Hk={Hk},D={D}",
                "bf16",
                rope_args(T, False),
                rotary_embedding,
                ops.rotary_embedding,
                bytes=rope_bytes,
                atol=1.6e-2,
                rtol=1.6e-2,
                group="rope",
            )
        )
        out.append(
            Case(
                "store_kv",
                f"T={T},Hk={Hk},D={D},bs={BLOCK}",
                "bf16",
                store_args(T),
                store_kv,
                ops.store_kv,
                bytes=T * (4 * Hk * D * 2 + 8),
                check=_check_store,
                ref_graph=False,
                group="kv_cache",
            )
        )
    return out


if __name__ == "__main__":
    main_for(cases)
