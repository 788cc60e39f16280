"""The persistent batch-1 MLP (kernels/persistent.py) against the engine's two GEMVs, under the interpreter."""

from __future__ import annotations

import pytest
import torch

from kernellab.kernels import gemv, persistent
from kernellab.kernels._common import cached_zeros


def _inputs(gen, H, F, dtype, residual):
    rnd = lambda *s: (torch.randn(*s, generator=gen) * 0.5).to(dtype)  # noqa: E731
    x, res = rnd(1, H), (rnd(1, H) if residual else None)
    return x, res, 1 + rnd(H) * 0.1, rnd(2 * F, H) * 0.2, rnd(H, F) * 0.2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("H", "F", "residual"), [(64, 96, True), (48, 40, False), (128, 160, True)])
@pytest.mark.parametrize(("fused", "programs"), [(True, 1), (False, 3), (False, 64)])
def test_equals_the_engines_two_gemvs_bit_for_bit(gen, dtype, H, F, residual, fused, programs):
    """Shapes not a multiple of either tile (rows masked at both phases' tails, K padded to a power of two);
    one program walking every tile through its own barrier, or several over the two-launch form."""
    x, res, nw, w_gu, w_down = _inputs(gen, H, F, dtype, residual)
    gu, r_ref = gemv.add_rms_norm_linear(x, res, nw, 1e-6, w_gu)
    y_ref = gemv.silu_and_mul_linear(gu, w_down)
    y, r = persistent.mlp_decode(x, res, nw, 1e-6, w_gu, w_down, programs=programs, fused=fused)
    assert torch.equal(y, y_ref)
    assert torch.equal(r, r_ref)
    if dtype == torch.float32:  # the interpreter truncates fp32 -> bf16 where torch rounds
        assert torch.equal(r, x + res if residual else x)


def test_the_fused_form_leaves_its_counters_at_zero_for_the_next_call(gen):
    x, res, nw, w_gu, w_down = _inputs(gen, 64, 96, torch.float32, True)
    first, _ = persistent.mlp_decode(x, res, nw, 1e-6, w_gu, w_down, programs=1)
    assert cached_zeros("persistent.mlp_sync", 2, torch.int32, x.device)[:2].tolist() == [0, 0]
    again, _ = persistent.mlp_decode(x, res, nw, 1e-6, w_gu, w_down, programs=1)  # would hang if not reset
    assert torch.equal(first, again)


def test_the_reference_formula(gen):
    """Against torch directly (fp32): the RMSNorm of x + residual, the fused gate/up, SwiGLU, the down projection."""
    x, res, nw, w_gu, w_down = _inputs(gen, 64, 96, torch.float32, True)
    y, _ = persistent.mlp_decode(x, res, nw, 1e-6, w_gu, w_down, programs=1)
    h = x + res
    gu = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * nw) @ w_gu.T
    ref = (torch.nn.functional.silu(gu[:, :96]) * gu[:, 96:]) @ w_down.T
    torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)


def test_bad_shapes_are_refused(gen):
    x, res, nw, w_gu, w_down = _inputs(gen, 64, 96, torch.float32, True)
    with pytest.raises(ValueError, match="w_down"):
        persistent.mlp_decode(x, res, nw, 1e-6, w_gu, w_down.T.contiguous())
    with pytest.raises(ValueError, match="one contiguous row"):
        persistent.mlp_decode(x.expand(2, 64), res, nw, 1e-6, w_gu, w_down)


def test_the_gpu_probe_runs_its_path_on_the_cpu(tmp_path):
    """benchmarks/gpu/persistent_mlp_probe.py under the interpreter (two small layers, one program): an artifact
    that validates, every variant equal to the engine's two GEMVs, so the script does not rot between GPU runs."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from kernellab.results import validate

    script = Path(__file__).resolve().parents[3] / "benchmarks" / "gpu" / "persistent_mlp_probe.py"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, str(script), "--out", str(tmp_path), "--device", "cpu"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "persistent_mlp_probe.json").read_text())
    assert validate(data) == "kernellab.bench.persistent_mlp_probe/v1"
    assert set(data["variants"]) == {"engine", "persistent_p1", "persistent_pdl_p1", "two_launch", "two_launch_pdl"}
    for entry in data["variants"].values():
        assert entry["max_abs_diff_vs_engine"] == 0.0 and entry["repeatable"], entry
