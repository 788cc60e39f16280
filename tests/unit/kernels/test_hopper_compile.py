"""Every kernel launch the CPU tests make also compiles for the H200 (sm_90), with the GPU's own compiler.

The interpreter never types a kernel, so a path a constexpr switches off can hold code the GPU compiler rejects
(it happened: the unsplit paged decode kernel kept an atomic on its bf16 output pointer and failed at its first
launch on the H200). Here each launcher runs under the interpreter at the head sizes of the registered models
(128 and 64), in bf16 and fp32, with the FP8 cache, split and unsplit, dense and quantized, while
``compile_check.record_launches`` notes each specialization; a child process without the interpreter then
compiles every one to a cubin (``triton.compile`` for ``GPUTarget("cuda", 90, 32)``).
"""

from __future__ import annotations

import pytest
import torch

from kernellab.kernels import (
    argmax,
    attention,
    compile_check,
    gemm,
    gemv,
    kv_cache,
    linear,
    paged_attention,
    quant_gemv,
    rms_norm,
    rope,
    softmax,
    swiglu,
    vector_add,
)
from kernellab.runtime import ops

BS = 16


def _paged(gen, B, ctx, Hq, Hk, D, dtype, fp8, bs=BS):
    """``fp8``: False, or the 8-bit cache's dtype (True: FP8; "int8-vt": int8 with V transposed within its
    blocks, the engine's int8 layout)."""
    blocks = B * -(-ctx // bs)
    cache = lambda: torch.randn(blocks, bs, Hk, D, generator=gen).to(dtype)  # noqa: E731
    k_cache, v_cache = cache(), cache()
    scales = {}
    if fp8:
        q8 = ops.FP8_DTYPE if fp8 is True else torch.int8 if fp8 == "int8-vt" else fp8
        (k_cache, ks), (v_cache, vs) = ops.quantize_kv(k_cache.float(), q8), ops.quantize_kv(v_cache.float(), q8)
        scales = {"k_scales": ks, "v_scales": vs}
        if fp8 == "int8-vt":  # and the scales head-major within a block (ops.scale_zeros)
            v_cache = v_cache.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
            scales = {n: ops.scale_zeros(tuple(x.shape), q8, x.device).copy_(x) for n, x in scales.items()}
    tables = torch.randperm(blocks, generator=gen).to(torch.int32).view(B, -1)
    lens = torch.full((B,), ctx, dtype=torch.int32)
    q = torch.randn(B, Hq, D, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables, lens, scales


def _exercise(gen: torch.Generator) -> None:
    """One call of each launcher per distinct specialization the engine and the benchmarks use."""
    rnd = lambda *s, dtype=torch.bfloat16: torch.randn(*s, generator=gen).to(dtype)  # noqa: E731
    for dtype in (torch.bfloat16, torch.float32):
        x, w = rnd(5, 64, dtype=dtype), rnd(64, dtype=dtype)
        rms_norm.rms_norm(x, w, 1e-6)
        rms_norm.add_rms_norm(x, rnd(5, 64, dtype=dtype), w, 1e-6)
        swiglu.silu_and_mul(rnd(3, 128, dtype=dtype))
        for vocab in (3000, 20000):  # one chunk; partial maxima and their merge
            argmax.argmax(rnd(3, vocab, dtype=torch.float32))
        for rows in (1, 4):  # warp-reduced GEMV, tensor-core GEMV
            linear.linear(rnd(rows, 128, dtype=dtype), rnd(96, 128, dtype=dtype))
        gemv.linear(rnd(1, 256, dtype=dtype), rnd(8, 256, dtype=dtype), config=gemv.GemvConfig(8, 64, 4))
        gemv.silu_and_mul_linear(rnd(1, 256, dtype=dtype), rnd(64, 128, dtype=dtype))  # SwiGLU in the GEMV
        row, norm_w = rnd(1, 128, dtype=dtype), rnd(128, dtype=dtype)
        gemv.add_rms_norm_linear(row, rnd(1, 128, dtype=dtype), norm_w, 1e-6, rnd(64, 128, dtype=dtype))  # RMSNorm
        logits = torch.empty(1, 64, dtype=torch.float32)  # a first layer's norm (no residual); fp32 logits out
        gemv.add_rms_norm_linear(row, None, norm_w, 1e-6, rnd(64, 128, dtype=dtype), out=logits)
        gemv.gemv(
            row,
            rnd(8, 128, dtype=dtype),
            None,
            16,
            None,
            gemv.GemvConfig(8, 32, 2),
            norm=(row + 1, norm_w, row * 0, 1e-6),
        )
        for D, Hq, Hk in ((128, 4, 2), (64, 3, 1)):
            cos_sin = ops.rope_cos_sin_cache(D, 64, 1e6, device="cpu")
            cos_ctx = ops.rope_cos_sin_cache(D, 300, 1e6, device="cpu")  # positions of the decode contexts below
            pos = torch.randint(0, 64, (6,), generator=gen)
            q, k, v = rnd(6, Hq, D, dtype=dtype), rnd(6, Hk, D, dtype=dtype), rnd(6, Hk, D, dtype=dtype)
            rope.rotary_embedding(pos, q, k, cos_sin)
            nw = rnd(D, dtype=dtype)
            rope.qk_norm_rope(pos, q, k, nw, nw, 1e-6, cos_sin)
            for fp8 in (False, True, torch.int8, "int8-vt"):  # the cache: as the activations, FP8, int8 (2 layouts)
                if fp8 is not False and dtype == torch.float32:
                    continue
                _, kc, vc, _, _, scales = _paged(gen, 2, 32, Hq, Hk, D, dtype, fp8)
                slots = torch.randperm(kc.shape[0] * BS, generator=gen)[:6]
                kv_cache.store_kv(k, v, kc, vc, slots, **scales)
                rope.qk_norm_rope_store_kv(pos, q, k, v, nw, nw, 1e-6, cos_sin, kc, vc, slots, **scales)
                for B, ctx in ((1, 300), (40, 20)):  # split across slices; one slice per sequence
                    qd, kc2, vc2, tables, lens, sc = _paged(gen, B, ctx, Hq, Hk, D, dtype, fp8)
                    paged_attention.paged_decode_attention(qd, kc2, vc2, tables, lens, D**-0.5, **sc)
                    if fp8 == "int8-vt":  # one-block tiles copied by tensor descriptors (64-token blocks)
                        qd, kc2, vc2, tables, lens, sc = _paged(gen, B, ctx, Hq, Hk, D, dtype, fp8, bs=64)
                        for tma in (1, 2):  # 2: q's and P's 16-bit halves stacked as one dot's rows
                            paged_attention.paged_decode_attention(
                                qd, kc2, vc2, tables, lens, D**-0.5, i8_tma=tma, **sc
                            )
                    if not fp8:  # the decode attention with the QK-norm, RoPE and KV write inside
                        kd, vd = rnd(B, Hk, D, dtype=dtype), rnd(B, Hk, D, dtype=dtype)
                        paged_attention.paged_decode_attention_qk_norm_rope(
                            qd, kd, vd, nw, nw, 1e-6, cos_ctx, kc2, vc2, lens.long() - 1, tables, lens, D**-0.5
                        )
                        paged_attention.paged_decode_attention_qk_norm_rope(  # a graph's int64 context lengths
                            qd, kd, vd, nw, nw, 1e-6, cos_ctx, kc2, vc2, lens.long() - 1, tables, lens.long(), D**-0.5
                        )
                        if B == 1:  # more slices than SEQ_MERGE_SLICES, merged in chunks (SEQ_MERGE_CHUNKS)
                            chunks, paged_attention.SEQ_MERGE_CHUNKS = paged_attention.SEQ_MERGE_CHUNKS, 2
                            try:
                                paged_attention.paged_decode_attention_qk_norm_rope(
                                    qd, kd, vd, nw, nw, 1e-6, cos_ctx, kc2, vc2, lens.long() - 1, tables, lens, D**-0.5,
                                    splits=32, block_n=16, min_slice=16,
                                )  # fmt: skip
                            finally:
                                paged_attention.SEQ_MERGE_CHUNKS = chunks
                        if B == 1:  # batch 1: the attention leaves two slices to the output projection's GEMV
                            wide = torch.cat([tables, torch.full((1, 40), -1, dtype=torch.int32)], dim=1)
                            for n in (100, 300):  # two slices (the GEMV merges); five (the attention merges)
                                paged_attention.decode_attention_o_proj(
                                    qd, kd, vd, nw, nw, 1e-6, cos_ctx, kc2, vc2, lens.long() - 1, wide,
                                    torch.tensor([n]), D**-0.5, rnd(48, Hq * D, dtype=dtype),
                                )  # fmt: skip
                if not fp8:  # steps that prefill: v copied dense too
                    v_out = torch.empty_like(v)
                    rope.qk_norm_rope_store_kv(pos, q, k, v, nw, nw, 1e-6, cos_sin, kc, vc, slots, v_out=v_out)
        # the teaching kernels and the standalone ones
        vector_add.add(rnd(100, dtype=dtype), rnd(100, dtype=dtype))
        vector_add.add_silu(rnd(100, dtype=dtype), rnd(100, dtype=dtype))
        softmax.softmax(rnd(3, 100, dtype=dtype))
        softmax.softmax(rnd(2, 300, dtype=dtype), max_single=128, chunk=128)
        argmax.topk(rnd(2, 3000, dtype=torch.float32), 5)
        attention.causal_attention(
            rnd(40, 4, 64, dtype=dtype), rnd(40, 2, 64, dtype=dtype), rnd(40, 2, 64, dtype=dtype), 0.125, 2
        )
        # the descriptor (TMA) form; its warp-specialised key loop compiles for sm_90 with 8 warps (4 fail in
        # Triton 3.6's warp-specialization pass)
        for D in (64, 128):  # several fresh prompts in one launch, the offsets on the device (the engine's tiles)
            attention.packed_causal_attention(
                rnd(40, 4, D, dtype=dtype), rnd(40, 2, D, dtype=dtype), rnd(40, 2, D, dtype=dtype),
                torch.tensor([0, 17, 17, 40], dtype=torch.int32), 40, 0.125,
            )  # fmt: skip
        for D, block_m, block_n, warps, ws in ((64, 64, 32, 4, False), (128, 128, 64, 8, True)):
            attention.causal_attention(
                rnd(40, 4, D, dtype=dtype), rnd(40, 2, D, dtype=dtype), rnd(40, 2, D, dtype=dtype), 0.125, 2,
                block_m=block_m, block_n=block_n, num_warps=warps, tma=True, heavy_first=True, warp_specialize=ws,
            )  # fmt: skip
        gemm.linear(rnd(70, 64, dtype=dtype), rnd(96, 64, dtype=dtype))
        for glu, persistent in ((False, False), (True, True)):  # the descriptor form at its default tiles
            gemm.linear_desc(rnd(130, 64, dtype=dtype), rnd(512, 64, dtype=dtype), glu=glu, persistent=persistent)
        # Qwen3-0.6B's QKV projection with the QK-norm, RoPE and KV write in its epilogue (heads of 128)
        Hq, Hk, D = 4, 2, 128
        kc = torch.zeros(8, BS, Hk, D, dtype=dtype)
        gemm.qkv_proj_norm_rope_store_kv(
            rnd(40, 64, dtype=dtype), rnd((Hq + 2 * Hk) * D, 64, dtype=dtype), torch.arange(40), rnd(D, dtype=dtype),
            rnd(D, dtype=dtype), 1e-6, ops.rope_cos_sin_cache(D, 64, 1e6, device="cpu"), kc, kc.clone(),
            torch.arange(40), Hq, Hk, flatten=dtype == torch.bfloat16,  # the branch-free epilogue, flattened
        )  # fmt: skip
    for bits, fn in ((8, quant_gemv.linear_w8a16), (4, quant_gemv.linear_w4a16)):
        qw = quant_gemv.quantize_weight(rnd(64, 128, dtype=torch.float32), bits=bits)
        for rows in (1, 4):
            fn(rnd(rows, 128), qw.qweight, qw.scales)


def _with_hopper_variants(launches: list[dict]) -> list[dict]:
    """The CPU cannot launch with programmatic dependent launch (a Hopper feature) but the H200 does: every
    launch the GPU would make with PDL (each kernel with a ``PDL`` switch; of the GEMV, the dense M = 1 one) is
    compiled a second time that way."""
    extra = []
    for launch in launches:
        c = launch["constexprs"]
        if "PDL" not in c or c["PDL"]:
            continue
        if launch["kernel"] == "_gemv_kernel" and (c["W_BITS"] != 16 or c["USE_DOT"] or c["SPLIT"]):
            continue
        options = {**launch["options"], "launch_pdl": True}
        if launch["kernel"] == "_gemv_kernel":  # the PDL program order, and its second K step fetched early too
            for early2 in (False, True) if not c["MERGE"] else (False,):
                extra.append(
                    {**launch, "constexprs": {**c, "PDL": True, "EARLY": True, "EARLY2": early2}, "options": options}
                )
            continue
        extra.append({**launch, "constexprs": {**c, "PDL": True}, "options": options})
    for launch in launches + extra:  # the GPU-only forms: the merging GEMV's PTX roundings, int8 byte permutes
        if launch["kernel"] == "_gemv_kernel" and launch["constexprs"].get("MERGE"):
            options = {**launch["options"], **({"maxnreg": gemv.MERGE_MAXNREG} if gemv.MERGE_MAXNREG else {})}
            extra.append({**launch, "constexprs": {**launch["constexprs"], "MERGE_ASM": True}, "options": options})
        if launch["kernel"] != "_paged_decode_kernel":
            continue
        c = launch["constexprs"]
        if c["ROPE"] and c["PDL"]:  # idle slices exiting without waiting (paged_attention.IDLE_SLICES_WAIT)
            extra.append({**launch, "constexprs": {**c, "IDLE_WAIT": not c["IDLE_WAIT"]}})
        if launch["signature"]["k_cache_ptr"] == "*i8" and c["WIDEN_F16"]:  # int8 tiles widened by byte permutes
            extra.append({**launch, "constexprs": {**c, "I8_ASM": True}})
    return launches + extra


# Every recorded launch compiled for sm_90 on two cores: ~12 minutes alone (713 s at a68dd29), more beside the other
# test worker; the suite's 900 s limit left too little room (a CI rehearsal ran past it under extra load).
@pytest.mark.timeout(1800)
def test_every_recorded_launch_compiles_for_sm90():
    gen = torch.Generator().manual_seed(0)
    with compile_check.record_launches() as launches:
        _exercise(gen)
    launches = compile_check.unique(_with_hopper_variants(launches))
    kernels = {launch["kernel"] for launch in launches}
    # every kernel of the package was launched: a new kernel must join _exercise
    assert kernels >= {
        "_rms_norm_kernel",
        "_silu_and_mul_kernel",
        "_argmax_partial_kernel",
        "_argmax_merge_kernel",
        "_gemv_kernel",
        "_qk_rope_kernel",
        "_store_kv_kernel",
        "_paged_decode_kernel",
        "_paged_decode_i8_tma_kernel",
        "_add_kernel",
        "_softmax_row_kernel",
        "_softmax_partial_kernel",
        "_softmax_normalize_kernel",
        "_topk_partial_kernel",
        "_topk_merge_kernel",
        "_causal_attention_kernel",
        "_causal_attention_desc_kernel",
        "_packed_causal_attention_kernel",
        "_gemm_kernel",
        "_gemm_desc_kernel",
        "_gemm_qkv_rope_kernel",
    }, sorted(kernels)
    assert any(launch["constexprs"].get("GLU") for launch in launches)
    norm_gemvs = [launch for launch in launches if launch["kernel"] == "_gemv_kernel" and launch["constexprs"]["NORM"]]
    assert {launch["constexprs"]["SPLIT"] for launch in norm_gemvs} == {False, True}
    assert {launch["constexprs"]["RES"] for launch in norm_gemvs} == {False, True}
    with_pdl = {launch["kernel"] for launch in launches if launch["constexprs"].get("PDL")}
    assert with_pdl >= {
        "_gemv_kernel",
        "_rms_norm_kernel",
        "_silu_and_mul_kernel",
        "_qk_rope_kernel",
        "_store_kv_kernel",
        "_paged_decode_kernel",
        "_paged_decode_i8_tma_kernel",
        "_causal_attention_desc_kernel",  # the prefill attention's descriptor forms (attention.PREFILL_PDL)
        "_packed_causal_attention_kernel",
        "_gemm_desc_kernel",
        "_gemm_qkv_rope_kernel",
    }, sorted(with_pdl)
    splits = {
        (launch["constexprs"]["SPLIT"], launch["constexprs"]["FP8"])
        for launch in launches
        if launch["kernel"] == "_paged_decode_kernel"
    }
    assert splits == {(False, False), (True, False), (False, True), (True, True)}
    decode = [launch["constexprs"] for launch in launches if launch["kernel"] == "_paged_decode_kernel"]
    assert {c["I8_ASM"] for c in decode} == {False, True}
    # batch 1's slices (2 to DEFER) left to the output projection
    assert {c["DEFER"] for c in decode} == {0, gemv.DEFER_MAX_SLICES}
    merging = [launch["constexprs"] for launch in launches if launch["kernel"] == "_gemv_kernel"]
    assert {c["MERGE_ASM"] for c in merging if c["MERGE"]} == {False, True}
    assert any(c["MERGE"] and c["PDL"] and c["MERGE_ASM"] for c in merging)
    capped = [launch["options"] for launch in launches if launch["constexprs"].get("MERGE_ASM")]
    assert gemv.MERGE_MAXNREG is None or all(o.get("maxnreg") == gemv.MERGE_MAXNREG for o in capped)
    # the int8 cache with V transposed within its blocks: int8 tensor-core dots, split and unsplit
    assert {c["SPLIT"] for c in decode if c["I8_MMA"]} == {False, True}
    stores = {launch["constexprs"].get("INT8") for launch in launches if launch["kernel"] == "_store_kv_kernel"}
    assert stores == {False, True}  # FP8 and int8 writes both compiled
    for kernel in ("_store_kv_kernel", "_qk_rope_kernel"):  # and the int8 writes of a transposed V
        assert any(launch["constexprs"].get("V_T") for launch in launches if launch["kernel"] == kernel), kernel
    failures = compile_check.compile_records(launches, timeout=1700)
    assert not failures, "\n\n".join(
        f"{f['launch']['kernel']} {f['launch']['constexprs']}:\n{f['error']}" for f in failures
    )


def test_the_check_catches_a_kernel_the_gpu_compiler_rejects():
    """The check is not vacuous: the paged decode kernel's unsplit specialization with a bf16 counter pointer
    (the H200's compile error before the constexpr guard) is rejected."""
    gen = torch.Generator().manual_seed(1)
    with compile_check.record_launches() as launches:
        q, kc, vc, tables, lens, _ = _paged(gen, 40, 20, 4, 2, 128, torch.bfloat16, False)
        paged_attention.paged_decode_attention(q, kc, vc, tables, lens, 0.1)
    (launch,) = compile_check.unique(launches)
    assert launch["signature"]["cnt_ptr"] == "*bf16" and launch["constexprs"]["SPLIT"] is False
    broken = {**launch, "constexprs": {**launch["constexprs"], "SPLIT": True}}  # the merge path, bf16 counter
    (failure,) = compile_check.compile_records([broken])
    assert "atomic" in failure["error"]
