"""The GPU serving benchmark's own path, small, on this CPU: ``benchmarks/serve_gpu.py --profile ci`` writes a
checkpoint, runs the engine and the stack (real redis-server, gateway tier, workers, client processes) in
paired runs, adds a second worker, and writes an artifact that validates. Figures are not checked here (CPU,
shared machine); what is checked is that the script does not rot between GPU runs and that no request lost,
duplicated or cut tokens."""

from __future__ import annotations

import pytest

from tests.support.benchmarks import run_benchmark

pytestmark = pytest.mark.integration


def test_serve_gpu_benchmark_runs_end_to_end_on_the_cpu(tmp_path):
    art, proc = run_benchmark(
        "serve_gpu.py",
        *("--profile", "ci", "--gpus", "2", "--phases", "g1-nogather-slowpath,g2", "--interactive-repeats", "1"),
        output=tmp_path / "serve_ci.json",
        schema="kernellab.bench.serve_gpu/v1",
    )
    phases = {r["phase"] for r in art["runs"]}
    assert phases == {"engine", "stack-g1-nogather-slowpath", "stack-g2", "stack-2gpu-g2"}
    for r in art["runs"]:
        assert r["num_bad"] == 0 and r["output_tokens"] == r["expected_tokens"], r["bad_requests"]
    assert art["figures"]["all_requests_exact"] is True
    stack = [r for r in art["runs"] if r["phase"].startswith("stack-")]
    assert all(len(r["clients"]) >= 1 and r["server_cpu_cores"]["gateway"] >= 0 for r in stack)
    # the workers export their Triton compile counters (no JIT on a CPU worker: none while serving)
    assert all(r["worker_jit_compiles"] == {"compiles": 0, "seconds": 0.0} for r in stack), stack[0]
    assert art["jit_while_serving"] == []
    # Every stack run has its engine twin on the same prompts.
    pairs = {r["pair"] for r in art["runs"] if r["phase"] == "engine" and "pair" in r}
    assert {r["pair"] for r in stack if "pair" in r} <= pairs
    assert "exact tokens True" in proc.stdout  # the printed table ends with the checks
    # Interactive runs say where TTFT went: every request joined with the step that made its first token (the
    # worker's KERNELLAB_STEP_TRACE on the one-worker phases), and the four parts add up to the client's TTFT.
    timed = [r for r in art["runs"] if r["workload"] == "interactive" and "2gpu" not in r["phase"]]
    assert timed and all(r["timeline"]["requests_joined"] == r["requests"] for r in timed)
    for r in timed:
        parts = r["timeline"]["median_ms"]
        assert all(parts[k] is not None and parts[k] >= -1.0 for k in parts), parts
        assert r["timeline"]["steps"] and all(len(s) == 5 for s in r["timeline"]["steps"])
    assert "TTFT parts" in proc.stdout
    # The stack's runs also carry the gateway's request trace, joined: read and delivery split at the gateway.
    from kernellab.bench.timeline import GATEWAY_SPLIT

    for r in (r for r in timed if r["phase"].startswith("stack-")):
        parts = r["timeline"]["median_ms"]
        assert all(parts.get(k) is not None and parts[k] >= -1.0 for k in GATEWAY_SPLIT), parts
        began, out = r["timeline"]["arrivals"]["gateway_in_ms"], r["timeline"]["arrivals"]["gateway_sent_ms"]
        assert 0 <= began[0] <= began[1] <= began[2] and began[0] <= out[0] and began[2] <= out[2], (began, out)
        assert sum(n for _ms, n in r["timeline"]["reads"]) == r["timeline"]["requests_joined"]  # each read once
        used, fewest, most = r["timeline"]["gateway_load"]
        assert 1 <= used <= 2 and 1 <= fewest <= most <= r["timeline"]["requests_joined"]  # the g2 tier's processes
    assert "the gateway's share" in proc.stdout


def test_structured_stack_benchmark_gpu_path_runs_on_the_cpu(tmp_path):
    """``benchmarks/structured_overhead.py`` as its GPU profile runs it (a synthetic checkpoint, plain HTTP), small:
    the tiny shape on this CPU, one pair of phases; the artifact validates."""
    art, _ = run_benchmark(
        "structured_overhead.py",
        *("--profile", "tiny", "--concurrency", "4", "--max-tokens", "16"),
        output=tmp_path / "structured_tiny.json",
        schema="kernellab.bench.structured/v1",
    )
    assert [p["kind"] for p in art["phases"]] == ["plain", "json_schema"]
    assert all(p["requests"] == 4 and p["completion_tokens"] > 0 for p in art["phases"])


def test_gateway_burst_benchmark_runs_on_the_cpu(tmp_path):
    """``benchmarks/gateway_burst.py``, small: a burst through a one-process tier and the stand-in worker; every
    request got exactly its tokens, the tier's CPU was metered and the worker's trace joined."""
    art, proc = run_benchmark(
        "gateway_burst.py",
        *("--gateway-processes", "1", "--variants", "base", "--clients", "8", "--rounds", "2"),
        *("--prompt-tokens", "24", "--max-tokens", "3"),
        output=tmp_path / "burst.json",
        schema="kernellab.bench.gateway_burst/v1",
    )
    s = art["summary"]["g1-base"]
    assert s["bad"] == 0 and s["rounds_counted"] == 1
    assert s["gateway_cpu_ms_per_request"] > 0
    assert 0 <= s["received_first_ms"] <= s["received_p50_ms"] <= s["received_last_ms"]
    assert all(r["parts_median_ms"]["to_worker_read"] is not None for r in art["runs"]["g1-base"])
    assert "g1-base" in proc.stdout
