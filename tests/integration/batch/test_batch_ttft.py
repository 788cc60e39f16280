"""Interactive TTFT while a batch runs stays within 2× of the idle figure: measured here, by the benchmark
script (benchmarks/batch_ttft.py), against this package's stack."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kernellab.results import validate
from tests.support.stack import API_KEY, MODEL

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "batch_ttft.py"


def test_interactive_ttft_under_a_batch_is_within_twice_idle(batch_stack, tmp_path, record_property):
    output = tmp_path / "batch_interactive_ttft.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--url",
            batch_stack.url,
            "--api-key",
            API_KEY,
            "--model",
            MODEL,
            "--requests",
            "25",
            "--batch-lines",
            "400",
            "--output",
            str(output),
            "--notes",
            "integration test: 1 engine worker, 2 CPU cores",
        ],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(output.read_text())
    assert validate(result) == "kernellab.bench.batch_ttft/v1"
    idle, busy = result["idle"], result["under_batch"]
    assert idle["n"] == busy["n"] == 25 and result["batch"]["lines_completed_during_busy_phase"] > 0
    for key in ("idle", "under_batch"):
        record_property(f"ttft_p50_ms_{key}", round(result[key]["p50_s"] * 1e3, 1))
    assert busy["p50_s"] <= 2.0 * idle["p50_s"], (
        f"interactive TTFT p50 {busy['p50_s'] * 1e3:.0f} ms under a batch vs {idle['p50_s'] * 1e3:.0f} ms idle"
    )
