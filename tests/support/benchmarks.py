"""Running a benchmark script as its tests do: a subprocess, small, on this CPU; it must exit 0 and write an
artifact that validates against its schema (the figures are the developer's artifact, not the test's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kernellab.results import validate

ROOT = Path(__file__).resolve().parents[2]


def run_benchmark(
    script: str, *args: str, output: Path, schema: str, timeout: float = 600, cwd: Path | None = None
) -> tuple[dict, subprocess.CompletedProcess]:
    """``python benchmarks/<script> <args> --output <output>``, run in ``cwd`` (default: the output's
    folder); (the artifact, the finished process)."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args, "--output", str(output)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd or output.parent,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    artifact = json.loads(output.read_text())
    assert validate(artifact) == schema
    return artifact, proc
