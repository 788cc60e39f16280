"""The serving benchmark's figures: which phase is the product's, and an artifact's figures recomputed from its
runs (``benchmarks/serve_gpu.py --refigure``) are the committed ones."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.serve_gpu import compute_figures, product_phase, refigure

ROOT = Path(__file__).resolve().parents[2]


def test_the_product_phase_is_the_last_that_runs_the_defaults():
    assert product_phase(["g16", "g16-normtorch", "g16", "g16-normtorch"]) == "g16"
    assert product_phase(["g16-sync", "g16"]) == "g16"
    assert product_phase(["g1-nogather", "g2", "g16-pin"]) == "g2"
    assert product_phase(["g1-nogather", "g16-nogather"]) == "g16-nogather"  # none runs the defaults: the last
    assert product_phase([]) is None


def test_the_committed_serving_artifact_holds_the_figures_its_runs_give(tmp_path):
    committed = json.loads((ROOT / "results/gpu/serve_h200.json").read_text())
    gpus = max(r.get("gpus", 1) for r in committed["runs"])
    assert compute_figures(committed["runs"], gpus) == committed["figures"]
    again = refigure(str(ROOT / "results/gpu/serve_h200.json"), str(tmp_path / "again.json"))
    assert again["figures"] == committed["figures"]
    assert again["refigured"]["product_phase_before"] == committed["figures"]["product_phase"]
    # the product's figures are its phase's medians over the pairs of that phase
    phase = committed["figures"]["product_phase"]
    assert (
        committed["figures"]["interactive_added_ttft_p50_ms"]
        == (committed["figures"]["stack_by_phase"][phase]["interactive_added_ttft_p50_ms"])
    )


def test_the_kv_pools_shrink_only_where_two_do_not_fit_the_card():
    from benchmarks.serve_gpu import KV_POOL_SHARE, fit_kv_blocks
    from kernellab.runtime.request.registry import resolve_model

    QWEN3_0_6B = resolve_model("qwen3-0.6b").hf_config

    per_block = 28 * 2 * 8 * 128 * 16 * 2  # bytes of one 16-token bf16 block over every layer, K and V
    h200, h100 = int(139.8 * 2**30), int(79.6 * 2**30)
    assert fit_kv_blocks(20480, QWEN3_0_6B, h200) == 20480  # the profile's pools, as measured on the H200
    fitted = fit_kv_blocks(20480, QWEN3_0_6B, h100)
    assert fitted == int(KV_POOL_SHARE * h100) // per_block < 20480
    assert 2 * fitted * per_block <= 0.75 * h100  # two pools leave a quarter of the card to everything else
    assert fit_kv_blocks(64, QWEN3_0_6B, h100) == 64


def test_the_added_ttft_median_comes_with_an_order_statistic_interval():
    from benchmarks.serve_gpu import median_interval

    # 8 pairs: (2nd, 7th) covers the median with 1 - 2·9/256 = 93 %; (3rd, 6th) would be 71 %
    diffs = [6.3, -0.79, 10.98, 2.53, 4.73, 3.35, 9.21, 6.74]
    assert median_interval(diffs) == {"lo": 2.53, "hi": 9.21, "coverage": 0.9297}
    assert median_interval(list(range(5))) == {"lo": 0, "hi": 4, "coverage": 0.9375}  # 5: the extremes
    assert median_interval([1.0, 2.0, 3.0, 4.0]) is None  # 4 values reach 87.5 % at most
    assert median_interval(list(range(16)), level=0.95)["coverage"] >= 0.95
