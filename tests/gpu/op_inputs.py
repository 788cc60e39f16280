"""Random inputs at real model shapes for each replaceable op (the acceptance gate's numerics): Qwen3-0.6B's
by default, or a registered model's (``model=``, e.g. the Llama family's head_dim 64 and 9/3 heads).

``make_inputs(op, seed, model=None)`` returns ``{"a": args}``: the same arguments feed the kernel and the reference
(ops that write into a cache get fresh copies for each side via ``"k"``)."""

from __future__ import annotations

import torch

QWEN3 = (1024, 3072, 16, 8, 128, 151936)  # hidden, intermediate, query heads, KV heads, head_dim, vocabulary
T, BATCH, CTX, BS = 512, 64, 1024, 16


def model_dims(model: str) -> tuple[int, int, int, int, int, int]:
    """(hidden, intermediate, query heads, KV heads, head_dim, vocabulary) of a registered model."""
    from kernellab.runtime.config import ModelConfig
    from kernellab.runtime.request.registry import resolve_model

    c = ModelConfig.from_hf(dict(resolve_model(model).hf_config))
    return c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size


def make_inputs(op: str, seed: int, model: str | None = None) -> dict:
    from kernellab.runtime.ops import rope_cos_sin_cache

    H, INTER, HQ, HK, D, V = model_dims(model) if model else (*QWEN3,)

    g = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape, dtype=torch.bfloat16, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)

    cos_sin = rope_cos_sin_cache(D, 4096, 1e6, device="cuda")
    positions = torch.randint(0, 4096, (T,), generator=g, device="cuda")
    if op == "rms_norm":
        return {"a": (rnd(4096, H), rnd(H, scale=0.1) + 1, 1e-6)}
    if op == "add_rms_norm":
        return {"a": (rnd(4096, H), rnd(4096, H), rnd(H, scale=0.1) + 1, 1e-6)}
    if op == "silu_and_mul":
        return {"a": (rnd(T, 2 * INTER),)}
    if op == "silu_and_mul_linear":  # batch-1 decode: one row
        return {"a": (rnd(1, 2 * INTER), rnd(H, INTER, scale=0.02))}
    if op == "add_rms_norm_linear":  # batch-1 decode: one row, the norm in the projection's GEMV
        return {"a": (rnd(1, H), rnd(1, H), rnd(H, scale=0.1) + 1, 1e-6, rnd(3 * H, H, scale=0.02))}
    if op == "linear":
        return {"a": (rnd(1, H), rnd(3 * H, H, scale=0.02))}
    if op == "gate_up_swiglu":  # a 2,048-token prompt's MLP: the normalised rows, the gate/up weight
        return {"a": (rnd(2048, H), rnd(2 * INTER, H, scale=0.03))}
    if op == "l2_prefetch":  # a batch-1 layer's weights after its QKV projection: o, gate/up, down, next QKV
        return {"a": (rnd(H, HQ * D), rnd(2 * INTER, H), rnd(H, INTER), rnd((HQ + 2 * HK) * D, H))}
    if op == "argmax":
        return {"a": (rnd(BATCH, V, dtype=torch.float32),)}
    if op == "rotary_embedding":
        return {"a": (positions, rnd(T, HQ, D), rnd(T, HK, D), cos_sin)}
    if op == "qk_norm_rope":
        return {
            "a": (positions, rnd(T, HQ, D), rnd(T, HK, D), rnd(D, scale=0.1) + 1, rnd(D, scale=0.1) + 1, 1e-6, cos_sin)
        }
    num_blocks = BATCH * CTX // BS + 8
    cache = lambda: torch.zeros(num_blocks, BS, HK, D, dtype=torch.bfloat16, device="cuda")  # noqa: E731
    if op == "qkv_proj_norm_rope_store_kv":  # a 2,048-token prompt's QKV projection and attention prologue
        n = 2048
        kc, vc = cache(), cache()
        kc2, vc2 = cache(), cache()
        x, w = rnd(n, H), rnd((HQ + 2 * HK) * D, H, scale=0.03)
        pos = torch.randint(0, 4096, (n,), generator=g, device="cuda")
        sl = torch.randperm(num_blocks * BS, generator=g, device="cuda")[:n]
        w1, w2 = rnd(D, scale=0.1) + 1, rnd(D, scale=0.1) + 1
        return {
            "a": (x, w, pos, w1, w2, 1e-6, cos_sin, kc, vc, sl, HQ, HK),
            "k": (x, w, pos, w1, w2, 1e-6, cos_sin, kc2, vc2, sl, HQ, HK),
        }
    slots = torch.randperm(num_blocks * BS, generator=g, device="cuda")[:T]
    if op == "store_kv":
        k, v = rnd(T, HK, D), rnd(T, HK, D)
        kc, vc = cache(), cache()
        kc2, vc2 = cache(), cache()
        return {"a": (k, v, kc, vc, slots), "k": (k, v, kc2, vc2, slots), "outputs": ((kc2, vc2), (kc, vc))}
    if op == "qk_norm_rope_store_kv":
        q, k, v = rnd(T, HQ, D), rnd(T, HK, D), rnd(T, HK, D)
        w1, w2 = rnd(D, scale=0.1) + 1, rnd(D, scale=0.1) + 1
        return {
            "a": (positions, q, k, v, w1, w2, 1e-6, cos_sin, cache(), cache(), slots),
            "k": (positions, q, k, v, w1, w2, 1e-6, cos_sin, cache(), cache(), slots),
        }
    if op == "varlen_causal_attention":  # fresh prompts as the QKV projection leaves them (strided views)
        qkv = rnd(T, (HQ + 2 * HK) * D)
        q, k, v = (x.view(T, -1, D) for x in qkv.split([HQ * D, HK * D, HK * D], dim=-1))
        cu = [0, 200, 201, T]  # three prompts in one launch (device offsets), one of them a single token
        return {"a": (q, k, v, cu, D**-0.5, torch.tensor(cu, dtype=torch.int32, device="cuda"))}
    if op == "paged_decode_attention":
        tables = torch.randperm(num_blocks, generator=g, device="cuda")[: BATCH * CTX // BS].view(BATCH, -1).int()
        lens = torch.randint(1, CTX + 1, (BATCH,), generator=g, device="cuda").int()
        kc, vc = rnd(num_blocks, BS, HK, D), rnd(num_blocks, BS, HK, D)
        return {"a": (rnd(BATCH, HQ, D), kc, vc, tables, lens, D**-0.5)}
    if op in ("paged_decode_attention_qk_norm_rope", "decode_attention_o_proj"):
        # a decode step: raw q/k/v rows of the fused projection; the merge in o_proj at batch 1 and a context of
        # two slices (100 tokens), its output projection's weight last
        o_proj = op == "decode_attention_o_proj"
        rows = 1 if o_proj else BATCH
        tables = torch.randperm(num_blocks, generator=g, device="cuda")[: rows * CTX // BS].view(rows, -1).int()
        if o_proj:
            lens = torch.tensor([100], dtype=torch.int32, device="cuda")
        else:
            lens = torch.randint(1, CTX + 1, (BATCH,), generator=g, device="cuda").int()
        kc, vc = rnd(num_blocks, BS, HK, D), rnd(num_blocks, BS, HK, D)
        new = (lens.long() - 1) // BS
        slots = tables.gather(1, new[:, None])[:, 0].long() * BS + (lens.long() - 1) % BS
        qkv = rnd(rows, (HQ + 2 * HK) * D)
        q, k, v = (x.view(rows, -1, D) for x in qkv.split([HQ * D, HK * D, HK * D], dim=-1))
        w1, w2 = rnd(D, scale=0.1) + 1, rnd(D, scale=0.1) + 1
        common = (q, k, v, w1, w2, 1e-6, cos_sin)
        tail = (slots, tables, lens, D**-0.5, *((rnd(H, HQ * D, scale=0.02),) if o_proj else ()))
        return {"a": (*common, kc.clone(), vc.clone(), *tail), "k": (*common, kc, vc, *tail)}
    raise KeyError(op)
