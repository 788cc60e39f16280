"""The constrained-decoding engine benchmark's own path, small, on this CPU (``benchmarks/structured_engine.py
--profile ci``): every variant runs, every constrained row's tokens replay through a fresh matcher of its
grammar, and the artifact validates. Figures are not checked here; the script must not rot between GPU runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kernellab.results import validate

ROOT = Path(__file__).resolve().parents[3]


def test_structured_engine_benchmark_runs_on_the_cpu(tmp_path):
    out = tmp_path / "structured_ci.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "structured_engine.py"),
            "--profile",
            "ci",
            "--repeats",
            "1",
            "--output",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    art = json.loads(out.read_text())
    assert validate(art) == "kernellab.bench.structured_engine/v1"
    n, tokens = art["workload"]["num_seqs"], art["workload"]["output_tokens"]
    for run in art["runs"]:
        assert run["output_tokens"] == n * tokens, run  # no grammar ended a row early: same work per variant
        assert run["valid"] == run["checked"], run
        assert (
            run["checked"] == {"plain": 0, "plain-1step": 0, "json": n, "regex": n, "half-json": n // 2}[run["variant"]]
        )
    assert set(art["summary"]) == {"plain", "plain-1step", "json", "regex", "half-json"}
