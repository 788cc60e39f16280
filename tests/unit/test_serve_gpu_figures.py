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
