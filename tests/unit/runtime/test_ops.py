"""Reference ops that have more than one formulation must agree with the simplest one."""

from __future__ import annotations

import itertools

import pytest
import torch

from kernellab.runtime import ops


@pytest.mark.parametrize("cu", [[0, 7], [0, 5, 17, 40, 41], [0, 1, 2, 3]])
def test_varlen_attention_equals_per_prompt_attention(cu):
    g = torch.Generator().manual_seed(0)
    T, Hq, Hk, D = cu[-1], 8, 2, 16
    q, k, v = (torch.randn(T, h, D, generator=g) for h in (Hq, Hk, Hk))
    loop = torch.cat([ops.causal_attention(q[s:e], k[s:e], v[s:e], 0.25, Hq // Hk) for s, e in itertools.pairwise(cu)])
    torch.testing.assert_close(ops.varlen_causal_attention(q, k, v, cu, 0.25), loop, atol=1e-5, rtol=1e-5)


def test_decode_attention_matches_naive_softmax():
    g = torch.Generator().manual_seed(1)
    B, Hq, Hk, D, bs = 3, 4, 2, 8, 4
    k_cache, v_cache = torch.randn(10, bs, Hk, D, generator=g), torch.randn(10, bs, Hk, D, generator=g)
    tables = torch.tensor([[3, 1, -1], [0, 5, 7], [9, -1, -1]], dtype=torch.int32)
    lens = torch.tensor([6, 12, 1], dtype=torch.int32)
    q = torch.randn(B, Hq, D, generator=g)
    out = ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.5)
    for b in range(B):
        blocks = [int(x) for x in tables[b] if x >= 0]
        k = k_cache[blocks].flatten(0, 1)[: lens[b]]
        v = v_cache[blocks].flatten(0, 1)[: lens[b]]
        for h in range(Hq):
            p = torch.softmax((k[:, h // 2] @ q[b, h]) * 0.5, dim=0)
            torch.testing.assert_close(out[b, h], p @ v[:, h // 2], atol=1e-5, rtol=1e-5)
