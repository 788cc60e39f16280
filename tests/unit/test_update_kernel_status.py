"""benchmarks/update_kernel_status.py: the dispatcher's status table from a gate artifact. A decision changes on
two consecutive settled runs, an unsettled run keeps it, and an op the artifact did not measure keeps its entry."""

from __future__ import annotations

import json
from pathlib import Path

import benchmarks.update_kernel_status as uks


def _row(status: str, itl: tuple[float, float, float], settled: bool = True, rounds: int = 3) -> dict:
    effects = {
        "tok_per_s": {"mean_pct": 0.5, "lo_pct": 0.4, "hi_pct": 0.7, "rounds": rounds},
        "itl_ms": {"mean_pct": itl[0], "lo_pct": itl[1], "hi_pct": itl[2], "rounds": rounds},
    }
    return {
        "status": status,
        "numerics": {"rel_err_max": 1e-5, "tolerance": 0.02, "pass": True},
        "e2e_gain_tok_per_s_pct": 0.5,
        "e2e_gain_itl_pct": itl[0],
        "effects": effects,
        "settled": settled,
        "rounds": [{}] * rounds,
    }


def _gate(tmp_path, name: str, rows: dict) -> str:
    artifact = {
        "model": "qwen3-0.6b",
        "provenance": {"commit": name, "gpu": "NVIDIA H200", "date": "2026-12-05T00:00:00+00:00"},
        "ablation": {"__rule__": {"min_rounds": 3, "max_rounds": 8, "min_effect_pct": 1.0}, **rows},
    }
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(artifact))
    return str(path)


def test_a_decision_changes_on_two_consecutive_settled_runs_and_unmeasured_ops_keep_theirs(tmp_path, monkeypatch):
    status = tmp_path / "kernel_status.json"
    rejected = {"status": "rejected", "reason": "slower in every form", "artifact": "results/x.json"}
    status.write_text(
        json.dumps({"ops": {"rms_norm": {"status": "accepted", "e2e": {"settled": True}}, "l2_prefetch": rejected}})
    )
    monkeypatch.setattr(uks, "STATUS", status)
    monkeypatch.setattr(uks, "ROOT", tmp_path)  # artifacts are recorded relative to the repo root

    def run(name: str, row: dict) -> dict:
        assert uks.main(_gate(tmp_path, name, {"rms_norm": row})) == 0
        return json.loads(status.read_text())["ops"]

    below = _row("experimental", (0.4, 0.2, 0.5))  # settled below the 1 % threshold
    ops = run("a", below)
    assert ops["rms_norm"]["status"] == "accepted" and ops["rms_norm"]["e2e"]["run_status"] == "experimental"
    assert "contested" in ops["rms_norm"]["e2e"]["kept"]
    assert ops["l2_prefetch"] == rejected  # the gate does not ablate it: its own A/B's rejection stands
    ops = run("b", _row("experimental", (1.0, 0.5, 1.5), settled=False, rounds=8))  # unsettled: no verdict
    assert ops["rms_norm"]["status"] == "accepted" and ops["rms_norm"]["e2e"]["run_status"] is None
    ops = run("c", below)  # contested again, after an unsettled run: still kept
    assert ops["rms_norm"]["status"] == "accepted"
    ops = run("d", below)  # the second settled run in a row that says so
    assert ops["rms_norm"]["status"] == "experimental" and "kept" not in ops["rms_norm"]["e2e"]
    ops = run("e", _row("accepted", (1.3, 1.1, 1.5)))  # one run above the threshold only contests that
    assert ops["rms_norm"]["status"] == "experimental" and ops["rms_norm"]["e2e"]["run_status"] == "accepted"


def test_an_ablation_only_run_keeps_what_another_models_path_judged(tmp_path, monkeypatch):
    """A run of the ablation section alone has no path ablation: ops Qwen3 never calls (judged on the Llama
    family's path by the last full gate) keep that judgement instead of falling to "not on the path"."""
    status = tmp_path / "kernel_status.json"
    judged = {"status": "accepted", "path": "smollm2-135m (not on qwen3-0.6b's: ...)", "e2e": {"settled": True}}
    status.write_text(json.dumps({"ops": {"store_kv": judged, "qk_norm_rope": {"status": "experimental"}}}))
    monkeypatch.setattr(uks, "STATUS", status)
    monkeypatch.setattr(uks, "ROOT", tmp_path)
    assert uks.main(_gate(tmp_path, "a", {})) == 0
    ops = json.loads(status.read_text())["ops"]
    assert ops["store_kv"] == judged
    assert (
        ops["qk_norm_rope"]["status"] == "experimental" and "not on qwen3-0.6b's path" in ops["qk_norm_rope"]["reason"]
    )


def test_a_single_threshold_artifact_is_read_with_per_figure_thresholds_from_its_aa_record(tmp_path, monkeypatch):
    """ce2e67b's gate recorded one threshold, 19.3 %, set by the A/A's TTFT interval: its silu_and_mul row
    (+6.3 % [6.0, 6.5] throughput) is judged against throughput's own 1 %."""
    status = tmp_path / "kernel_status.json"
    status.write_text(json.dumps({"ops": {"silu_and_mul": {"status": "accepted", "e2e": {"run_status": "accepted"}}}}))
    monkeypatch.setattr(uks, "STATUS", status)
    monkeypatch.setattr(uks, "ROOT", tmp_path)
    aa = {
        "tok_per_s": {"mean_pct": -0.35, "lo_pct": -0.64, "hi_pct": -0.07, "rounds": 8},
        "itl_ms": {"mean_pct": -0.18, "lo_pct": -0.38, "hi_pct": 0.02, "rounds": 8},
        "ttft_ms": {"mean_pct": -2.13, "lo_pct": -19.26, "hi_pct": 18.63, "rounds": 8},
    }
    row = _row("experimental", (0.0, -0.3, 0.4))
    row["effects"]["tok_per_s"] = {"mean_pct": 6.3, "lo_pct": 6.0, "hi_pct": 6.5, "rounds": 3}
    row["effects"]["ttft_ms"] = {"mean_pct": -2.9, "lo_pct": -14.8, "hi_pct": 10.6, "rounds": 3}
    path = _gate(tmp_path, "ce2e67b", {"silu_and_mul": row})
    data = json.loads(Path(path).read_text())
    data["ablation"]["__rule__"]["min_effect_pct"] = 19.26
    data["ablation"]["__aa__"] = {"effects": aa, "settled": False, "rounds": []}
    Path(path).write_text(json.dumps(data))
    assert uks.main(path) == 0
    e = json.loads(status.read_text())["ops"]["silu_and_mul"]
    assert e["status"] == "accepted" and "kept" not in e["e2e"]
    assert e["e2e"]["run_status"] == "accepted" and e["e2e"]["settled"] is True
    assert e["e2e"]["rule"]["min_effect_pct"] == {"tok_per_s": 1.0, "itl_ms": 1.0, "ttft_ms": 19.26}
