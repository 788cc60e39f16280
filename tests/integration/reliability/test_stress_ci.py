"""`kernellab stress` at CI scale: a few hundred mixed requests through the real stack (streaming and not,
chat and completions, ~3 % cancelled mid-stream, ~2 % with deadlines that expire), then every worker must
be idle with zero KV blocks used and a clean engine integrity check. The full-scale figures (5,000
requests) are in results/reliability/load.json and docs/reliability.md."""

from __future__ import annotations

import pytest

from kernellab import results
from kernellab.services.stress import brief, run_scenario

pytestmark = pytest.mark.integration


def test_mixed_load_loses_nothing_and_leaks_nothing(rstack, tmp_path):
    report = run_scenario(
        rstack,
        "load",
        requests=240,
        concurrency=16,
        seed=1,
        command="pytest tests/integration/reliability/test_stress_ci.py",
    )
    results.write(tmp_path / "load.json", report)  # validates against kernellab.reliability/v1
    q = report["requests"]
    assert report["passed"], brief(report)
    assert q["lost"] == 0 and q["corrupt"] == 0 and q["failed"] == 0 and report["leaked_blocks"] == 0
    assert q["cancelled"] >= 1 and q["timed_out"] >= 1, "the mix must cancel some requests and let some expire"
    assert q["completed"] + q["cancelled"] + q["timed_out"] + q["rejected"] == q["total"] == 240
    assert report["ttft_s"]["count"] > 0 and report["e2e_s"]["count"] == q["completed"]
    assert all(w["kv_blocks_used"] == 0 and w["integrity"] == "ok" for w in report["workers"]), report["workers"]
