"""The constrained-decoding engine benchmark's own path, small, on this CPU (``benchmarks/structured_engine.py
--profile ci``): every variant runs, every constrained row's tokens replay through a fresh matcher of its
grammar, and the artifact validates. Figures are not checked here; the script must not rot between GPU runs."""

from __future__ import annotations

from tests.support.benchmarks import run_benchmark


def test_structured_engine_benchmark_runs_on_the_cpu(tmp_path):
    art, _ = run_benchmark(
        "structured_engine.py",
        *("--profile", "ci", "--repeats", "1"),
        output=tmp_path / "structured_ci.json",
        schema="kernellab.bench.structured_engine/v1",
    )
    n, tokens = art["workload"]["num_seqs"], art["workload"]["output_tokens"]
    for run in art["runs"]:
        assert run["output_tokens"] == n * tokens, run  # no grammar ended a row early: same work per variant
        assert run["valid"] == run["checked"], run
        assert (
            run["checked"] == {"plain": 0, "plain-1step": 0, "json": n, "regex": n, "half-json": n // 2}[run["variant"]]
        )
    assert set(art["summary"]) == {"plain", "plain-1step", "json", "regex", "half-json"}
