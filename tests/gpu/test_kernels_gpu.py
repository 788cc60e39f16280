"""Kernel tests on a real GPU at Qwen3-0.6B shapes (bf16). Never in CI: run by tests/gpu/run_kernels.py.

Hidden 1024, 16 query / 8 KV heads, head_dim 128, intermediate 3072, vocabulary 151,936. Every output is
poisoned (NaN) before the kernel runs; kernels whose reference rounds in the same order must agree bit for bit
except for ≤ 1 bf16 ulp in a tiny fraction of elements (fast rsqrt/exp differ from torch's in the last fp32
bit, which flips a bf16 rounding now and then).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
# pytest puts REPO on sys.path (``tests`` is a package), so kernellab/ and tests.support import from a bare
# checkout; on the device machine nothing is installed: map kernels/ and runtime/ under kernellab.
try:
    import kernellab.kernels
except ImportError:
    import kernellab

    kernellab.__path__.append(str(REPO))

from kernellab.kernels import gemm, gemv, quant_gemv  # noqa: E402
from kernellab.kernels.argmax import argmax, topk  # noqa: E402
from kernellab.kernels.attention import causal_attention  # noqa: E402
from kernellab.kernels.gemv import GemvConfig  # noqa: E402
from kernellab.kernels.kv_cache import store_kv  # noqa: E402
from kernellab.kernels.paged_attention import paged_decode_attention  # noqa: E402
from kernellab.kernels.prefetch import l2_prefetch  # noqa: E402
from kernellab.kernels.rms_norm import add_rms_norm, rms_norm  # noqa: E402
from kernellab.kernels.rope import qk_norm_rope, qk_norm_rope_store_kv, rotary_embedding  # noqa: E402
from kernellab.kernels.softmax import softmax  # noqa: E402
from kernellab.kernels.swiglu import silu_and_mul  # noqa: E402
from kernellab.kernels.vector_add import add, add_silu  # noqa: E402
from kernellab.runtime import ops  # noqa: E402
from tests.support.kernels import assert_close, poisoned  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

H, HQ, HK, D, INTER, VOCAB = 1024, 16, 8, 128, 3072, 151936
BF16 = torch.bfloat16
DEV = "cuda"
PROJ = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}


def rnd(*shape, dtype=BF16, scale=1.0):
    return (torch.randn(*shape, device=DEV) * scale).to(dtype)


def assert_bf16_faithful(
    actual: torch.Tensor,
    expected: torch.Tensor,
    what: str,
    max_frac: float = 2e-3,
    max_ulp: float = 1.0,
    floor: float = 0.0,
):
    """Bit-equal except ≤ max_frac of elements, off by ≤ max_ulp bf16 ulps of max(|expected|, floor)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    assert not torch.isnan(actual).any(), f"{what}: NaN (unwritten) elements"
    diff = actual != expected
    frac = diff.float().mean().item()
    mag = expected.float().abs().clamp(min=floor)
    ulp = torch.ldexp(torch.ones_like(mag), torch.frexp(mag)[1] - 8)  # bf16: 8 significant bits
    worst = ((actual.float() - expected.float()).abs() / ulp).max().item()
    assert frac <= max_frac and worst <= max_ulp + 1e-6, f"{what}: {frac:.2e} of elements differ, worst {worst} ulp"


# RMSNorm rounds twice (x·rstd, then ·w) and reduces Σx² in another order than torch: where the fp32 rstd
# differs in its last bit, the first rounding can flip, and the second rounding can carry that to 2 ulps.
NORM_FAITHFUL = {"max_frac": 2e-3, "max_ulp": 2.0}
# After the per-head norm, RoPE's subtraction can cancel, so measure those ulps at the |x| ≈ 1 scale.
NORM_ROPE_FAITHFUL = {"max_frac": 2e-3, "max_ulp": 2.0, "floor": 1.0}


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# ------------------------------------------------------------------------------------------------ elementwise


@pytest.mark.parametrize("n", [4096 * H, 1_000_003, 1])
def test_add_and_add_silu(n):
    a, b = rnd(n), rnd(n)
    assert torch.equal(add(a, b, out=poisoned(n, BF16, DEV)), torch.add(a, b))
    assert_bf16_faithful(add_silu(a, b, out=poisoned(n, BF16, DEV)), ops.add_silu(a, b), "add_silu")


@pytest.mark.parametrize("T", [4096, 64, 1])
def test_silu_and_mul(T):
    x = rnd(T, 2 * INTER, scale=3.0)
    assert_bf16_faithful(silu_and_mul(x, out=poisoned((T, INTER), BF16, DEV)), ops.silu_and_mul(x), "swiglu")


# ------------------------------------------------------------------------------------------------ norms


@pytest.mark.parametrize("T", [4096, 37, 1])
def test_rms_norm_is_qwen_exact(T):
    x, w = rnd(T, H, scale=2.0), 1 + rnd(H, scale=0.1)
    assert_bf16_faithful(
        rms_norm(x, w, 1e-6, out=poisoned((T, H), BF16, DEV)), ops.rms_norm(x, w, 1e-6), "rms", **NORM_FAITHFUL
    )


@pytest.mark.parametrize("T", [4096, 37, 1])
def test_add_rms_norm(T):
    x, res, w = rnd(T, H), rnd(T, H), 1 + rnd(H, scale=0.1)
    y, r = add_rms_norm(x, res, w, 1e-6, out=poisoned((T, H), BF16, DEV), residual_out=poisoned((T, H), BF16, DEV))
    y_ref, r_ref = ops.add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(r, r_ref)
    assert_bf16_faithful(y, y_ref, "add_rms_norm", **NORM_FAITHFUL)


def test_rms_norm_per_head_and_long_rows():
    q, w = rnd(4096, HQ, D), 1 + rnd(D, scale=0.1)  # QK-norm shape: 65,536 rows of 128
    assert_bf16_faithful(rms_norm(q, w, 1e-6), ops.rms_norm(q, w, 1e-6), "per-head", **NORM_FAITHFUL)
    x, w2 = rnd(3, 20000), 1 + rnd(20000, scale=0.1)  # two-pass path
    assert_bf16_faithful(rms_norm(x, w2, 1e-6), ops.rms_norm(x, w2, 1e-6), "long rows", **NORM_FAITHFUL)


# ------------------------------------------------------------------------------------------------ rope + kv


def _qkv(T):
    qkv = rnd(T, (HQ + 2 * HK) * D, scale=2.0)
    return (
        qkv[:, : HQ * D].view(T, HQ, D),
        qkv[:, HQ * D : (HQ + HK) * D].view(T, HK, D),
        qkv[:, (HQ + HK) * D :].view(T, HK, D),
    )


@pytest.mark.parametrize("T", [4096, 64, 1])
def test_rope_family_is_exact(T):
    cache = ops.rope_cos_sin_cache(D, 40960, 1e6, device=DEV)
    q, k, v = _qkv(T)
    pos = torch.randint(0, 40960, (T,), device=DEV)
    qr, kr = rotary_embedding(pos, q, k, cache, q_out=poisoned(q.shape, BF16, DEV), k_out=poisoned(k.shape, BF16, DEV))
    q_ref, k_ref = ops.rotary_embedding(pos, q, k, cache)
    assert_bf16_faithful(qr, q_ref, "rope q")
    assert_bf16_faithful(kr, k_ref, "rope k")
    qw, kw = 1 + rnd(D, scale=0.1), 1 + rnd(D, scale=0.1)
    qn, kn = qk_norm_rope(pos, q, k, qw, kw, 1e-6, cache)
    qn_ref, kn_ref = ops.qk_norm_rope(pos, q, k, qw, kw, 1e-6, cache)
    assert_bf16_faithful(qn, qn_ref, "norm rope q", **NORM_ROPE_FAITHFUL)
    assert_bf16_faithful(kn, kn_ref, "norm rope k", **NORM_ROPE_FAITHFUL)
    for block_size in (16, 32):
        n_blocks = T // block_size + 3
        k_cache, v_cache = (
            poisoned((n_blocks, block_size, HK, D), BF16, DEV),
            poisoned((n_blocks, block_size, HK, D), BF16, DEV),
        )
        k_ref_c, v_ref_c = k_cache.clone(), v_cache.clone()
        slots = torch.randperm(n_blocks * block_size, device=DEV)[:T]
        slots[::7] = -1
        qf, kf = qk_norm_rope_store_kv(pos, q, k, v, qw, kw, 1e-6, cache, k_cache, v_cache, slots)
        ops.store_kv(kn_ref, v, k_ref_c, v_ref_c, slots)
        assert_bf16_faithful(qf, qn_ref, "fused q", **NORM_ROPE_FAITHFUL)
        assert_bf16_faithful(kf, kn_ref, "fused k", **NORM_ROPE_FAITHFUL)
        assert torch.equal(torch.isnan(k_cache), torch.isnan(k_ref_c))
        assert torch.equal(v_cache.nan_to_num(7.0), v_ref_c.nan_to_num(7.0))
        assert_bf16_faithful(k_cache.nan_to_num(7.0), k_ref_c.nan_to_num(7.0), "fused k cache", **NORM_ROPE_FAITHFUL)


@pytest.mark.parametrize("block_size", [16, 32, 5])
def test_store_kv(block_size):
    T = 4096
    _, k, v = _qkv(T)
    n_blocks = T // block_size + 2
    kc, vc = poisoned((n_blocks, block_size, HK, D), BF16, DEV), poisoned((n_blocks, block_size, HK, D), BF16, DEV)
    kr, vr = kc.clone(), vc.clone()
    slots = torch.randperm(n_blocks * block_size, device=DEV)[:T].to(torch.int32)
    slots[5::11] = -1
    store_kv(k, v, kc, vc, slots)
    ops.store_kv(k, v, kr, vr, slots.long())
    assert torch.equal(kc.nan_to_num(7.0), kr.nan_to_num(7.0)) and torch.equal(vc.nan_to_num(7.0), vr.nan_to_num(7.0))


# ------------------------------------------------------------------------------------------------ softmax / sampling


def test_softmax():
    x = rnd(64, VOCAB, dtype=torch.float32, scale=4.0)
    assert_close(softmax(x, out=poisoned(x.shape, torch.float32, DEV)), ops.softmax(x), 1e-7, 1e-4, "vocab")
    y = rnd(4096, H, scale=4.0)
    assert_close(softmax(y, out=poisoned(y.shape, BF16, DEV)), ops.softmax(y), 8e-3, 1.6e-2, "rows")


@pytest.mark.parametrize("B", [1, 64, 200])
def test_argmax_and_topk(B):
    x = rnd(B, VOCAB, dtype=torch.float32)
    assert torch.equal(argmax(x, out=poisoned(B, torch.int64, DEV)), ops.argmax(x))
    xb = x.to(BF16)  # many ties in bf16
    assert torch.equal(argmax(xb), ops.argmax(xb))
    vals, idx = topk(x, 50, values=poisoned((B, 50), torch.float32, DEV), indices=poisoned((B, 50), torch.int64, DEV))
    ref, _ = torch.topk(x, 50, dim=-1)
    assert torch.equal(vals, ref) and torch.equal(torch.gather(x, 1, idx), vals)


# ------------------------------------------------------------------------------------------------ linear


@pytest.mark.parametrize("name", list(PROJ))
@pytest.mark.parametrize("M", [1, 5, 16])
def test_gemv(name, M):
    N, K = PROJ[name]
    w = rnd(N, K, scale=K**-0.5)
    for _ in range(3):  # the split-K semaphores must reset between calls
        x = rnd(M, K)
        y = gemv.linear(x, w, out=poisoned((M, N), BF16, DEV))
        ref = ops.linear(x.float(), w.float())
        assert_close(y, ref.to(BF16), 1e-2, 1.6e-2, f"gemv {name} M={M}")
        assert rel_err(y, ref) < 5e-3


@pytest.mark.parametrize("name", ["qkv", "down"])
@pytest.mark.parametrize(
    "cfg",
    [
        GemvConfig(16, 512, 4, pdl=True),
        GemvConfig(8, 512, 1),
        GemvConfig(32, 256, 3),
        GemvConfig(4, 4096, 1, 8),
        GemvConfig(4, 1024, 2, 8, pdl=True),
    ],
)
def test_gemv_configs(name, cfg):
    N, K = PROJ[name]
    w = rnd(N, K, scale=K**-0.5)
    for _ in range(3):
        x = rnd(1, K)
        y = gemv.linear(x, w, out=poisoned((1, N), BF16, DEV), config=cfg)
        assert_close(y, ops.linear(x.float(), w.float()).to(BF16), 1e-2, 1.6e-2, f"{name} {cfg}")


def test_gemv_lm_head():
    x, w = rnd(1, H), rnd(VOCAB, H, scale=H**-0.5)
    assert_close(gemv.linear(x, w), ops.linear(x.float(), w.float()).to(BF16), 1e-2, 1.6e-2, "lm_head")


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("name", ["gate_up", "down"])
@pytest.mark.parametrize("M", [1, 4])
def test_quantized_gemv(bits, name, M):
    N, K = PROJ[name]
    qw = quant_gemv.quantize_weight(rnd(N, K, scale=K**-0.5), bits)
    assert qw.qweight.nbytes == N * K * bits // 8
    x = rnd(M, K)
    fn = quant_gemv.linear_w8a16 if bits == 8 else quant_gemv.linear_w4a16
    y = fn(x, qw.qweight, qw.scales, out=poisoned((M, N), BF16, DEV))
    ref = ops.linear(x.float(), quant_gemv.dequantize_weight(qw))
    assert_close(y, ref.to(BF16), 1e-2, 1.6e-2, f"w{bits}a16")


@pytest.mark.parametrize("name, M", [("qkv", 4096), ("down", 4096), ("gate_up", 100), ("o", 37)])
def test_gemm(name, M):
    N, K = PROJ[name]
    x, w = rnd(M, K), rnd(N, K, scale=K**-0.5)
    y = gemm.linear(x, w, out=poisoned((M, N), BF16, DEV))
    ref = ops.linear(x.float(), w.float())
    assert_close(y, ref.to(BF16), 1e-2, 1.6e-2, f"gemm {name}")


# ------------------------------------------------------------------------------------------------ attention


@pytest.mark.parametrize("Tq, Tk", [(1024, 1024), (100, 300), (1, 77)])
def test_causal_attention(Tq, Tk):
    q, k, v = rnd(Tq, HQ, D), rnd(Tk, HK, D), rnd(Tk, HK, D)
    y = causal_attention(q, k, v, D**-0.5, HQ // HK, out=poisoned(q.shape, BF16, DEV))
    ref = ops.causal_attention(q.float(), k.float(), v.float(), D**-0.5, HQ // HK)
    assert_close(y, ref.to(BF16), 1.6e-2, 2e-2, "prefill")
    assert rel_err(y, ref) < 1e-2


def _paged(lens, block_size):
    per_seq = [-(-n // block_size) for n in lens]
    n_blocks = sum(per_seq) + 4
    kc, vc = rnd(n_blocks, block_size, HK, D), rnd(n_blocks, block_size, HK, D)
    perm = torch.randperm(n_blocks, device=DEV)
    tables = torch.full((len(lens), max(per_seq) + 2), -1, dtype=torch.int32, device=DEV)
    used = torch.zeros(n_blocks, block_size, dtype=torch.bool, device=DEV)
    i = 0
    for b, n in enumerate(per_seq):
        tables[b, :n] = perm[i : i + n].to(torch.int32)
        for j in range(n):
            used[perm[i + j], : min(block_size, lens[b] - j * block_size)] = True
        i += n
    kc[~used] = float("nan")  # reading outside a context poisons the output
    vc[~used] = float("nan")
    return rnd(len(lens), HQ, D), kc, vc, tables, torch.tensor(lens, dtype=torch.int32, device=DEV)


@pytest.mark.parametrize(
    "lens, block_size",
    [([1024] * 64, 16), ([4096], 16), ([4096], 32), ("mixed", 16), ("mixed", 5)],
    ids=["b64x1024", "b1x4096", "b1x4096-bs32", "mixed", "mixed-bs5"],
)
def test_paged_decode_attention(lens, block_size):
    if lens == "mixed":
        lens = [*torch.randint(1, 3000, (33,)).tolist(), 1]
    q, kc, vc, tables, ctx = _paged(lens, block_size)
    y = paged_decode_attention(q, kc, vc, tables, ctx, D**-0.5, out=poisoned(q.shape, BF16, DEV))
    ref = ops.paged_decode_attention(q.float(), kc.float().nan_to_num(), vc.float().nan_to_num(), tables, ctx, D**-0.5)
    assert_close(y, ref.to(BF16), 1e-2, 2e-2, "paged decode")
    for splits in (1, 7):
        y2 = paged_decode_attention(q, kc, vc, tables, ctx, D**-0.5, splits=splits)
        assert_close(y2, ref.to(BF16), 1e-2, 2e-2, f"paged decode splits={splits}")


# ------------------------------------------------------------------------------------------------ graphs


def test_l2_prefetch_keeps_values_and_the_chain_order():
    """The prefetch changes no byte, and a PDL chain through it keeps its order: a GEMV after the prefetch reads
    what the GEMV before it wrote (the prefetch waits on its predecessor before it ends), eager and in a graph."""
    x = rnd(1, 1024)
    w1, w2, w3 = rnd(3072, 1024, scale=1024**-0.5), rnd(1024, 3072, scale=3072**-0.5), rnd(6144, 1024)
    before = [t.clone() for t in (w1, w2, w3)]
    outs = {}

    def chain():
        outs["y"] = gemv.linear(x, w1)
        l2_prefetch(w2, w3, w1, x)
        outs["z"] = gemv.linear(outs["y"], w2)

    chain()
    torch.cuda.synchronize()
    for t, b in zip((w1, w2, w3), before, strict=True):
        assert torch.equal(t, b)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    for _ in range(3):
        x.copy_(rnd(1, 1024))
        graph.replay()
        torch.cuda.synchronize()
        y = ops.linear(x.float(), w1.float()).to(BF16)
        assert_close(outs["y"], y, 1e-2, 1.6e-2, "gemv before the prefetch")
        assert_close(outs["z"], ops.linear(outs["y"].float(), w2.float()).to(BF16), 1e-2, 1.6e-2, "gemv after it")
    with pytest.raises(ValueError, match="at most 4"):
        l2_prefetch(w1, w2, w3, x, x)
    with pytest.raises(ValueError, match="contiguous"):
        l2_prefetch(w1.t())


def test_cuda_graph_capture_and_replay():
    """The decode hot path (norm → split-K GEMV → paged attention) captures and replays with new inputs."""
    x, w_norm = rnd(8, H), 1 + rnd(H, scale=0.1)
    w = rnd(1024, 3072, scale=3072**-0.5)
    x2 = rnd(8, 3072)
    q, kc, vc, tables, ctx = _paged([300, 1, 77, 1024, 5, 16, 17, 999], 16)
    kc, vc = kc.nan_to_num(), vc.nan_to_num()
    outs = {}

    def step():
        outs["norm"] = rms_norm(x, w_norm, 1e-6)
        outs["gemv"] = gemv.linear(x2[:1], w)
        outs["attn"] = paged_decode_attention(q, kc, vc, tables, ctx, D**-0.5)

    step()  # warm up: compile, allocate cached workspaces outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(2):
        x.copy_(rnd(8, H))
        x2.copy_(rnd(8, 3072))
        q.copy_(rnd(*q.shape))
        graph.replay()
        torch.cuda.synchronize()
        assert_bf16_faithful(outs["norm"], ops.rms_norm(x, w_norm, 1e-6), "graph norm", **NORM_FAITHFUL)
        assert_close(outs["gemv"], ops.linear(x2[:1].float(), w.float()).to(BF16), 1e-2, 1.6e-2, "graph gemv")
        ref = ops.paged_decode_attention(q.float(), kc.float(), vc.float(), tables, ctx, D**-0.5).to(BF16)
        assert_close(outs["attn"], ref, 1e-2, 2e-2, "graph attention")
