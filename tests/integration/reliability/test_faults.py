"""Fault injection through the real stack, each with its own test and figures (``kernellab stress
--scenario <name>`` at CI scale): under a closed-loop load of 16 clients, one fault (or a repeated one);
then zero lost requests, zero corrupt streams (deterministic requests agree token for token, so a
duplicated or skipped token shows), only clean errors, and every worker idle with zero KV blocks used.
Runs last in this package (conftest.py): it kills and restarts the shared stack's processes."""

from __future__ import annotations

import pytest

from kernellab import results
from kernellab.services.stress import brief, run_scenario

pytestmark = pytest.mark.integration

CAP = 400  # requests at most; a fault scenario stops 2 x concurrency requests after its last fault


def run(rstack, tmp_path, scenario: str, **fault_kwargs) -> dict:
    report = run_scenario(
        rstack,
        scenario,
        requests=CAP,
        concurrency=16,
        seed=2,
        fault_kwargs=fault_kwargs,
        command=f"pytest tests/integration/reliability/test_faults.py -k {scenario}",
    )
    results.write(tmp_path / f"{scenario}.json", report)
    failed = [k for k, ok in report["checks"].items() if not ok]
    assert report["passed"], {"failed_checks": failed, "faults": report["faults"], **brief(report)}
    q = report["requests"]
    assert q["lost"] == 0 and q["corrupt"] == 0 and report["leaked_blocks"] == 0, brief(report)
    assert report["faults"] and all(f["in_flight_at_fault"] > 0 for f in report["faults"]), report["faults"]
    return report


def test_worker_kill_9_repeated(rstack, tmp_path):
    report = run(rstack, tmp_path, "worker-kill", repeats=2)
    assert len(report["faults"]) == 2 and report["requests"]["failed"] == 0, brief(report)
    for f in report["faults"]:  # the survivor took over; the stalled streams resumed after the reclaim
        assert f["recovery_s"] is not None and f["stall_s"] < 30, f


def test_worker_paused_past_the_reclaim_timeout_then_resumed(rstack, tmp_path):
    report = run(rstack, tmp_path, "worker-pause")
    assert report["requests"]["failed"] == 0, brief(report)
    f = report["faults"][0]
    assert f["paused_s"] > rstack.dead_after_s
    # Once resumed, the paused worker must drop what another worker reclaimed instead of running it again.
    assert f["duplicate_finishes"] == 0, f


def test_redis_restarted_empty_during_load(rstack, tmp_path):
    report = run(rstack, tmp_path, "redis-restart")
    f = report["faults"][0]
    assert f["recovery_s"] is not None and f["recovery_s"] < 60, f
    # In-flight streams got an error event, new requests a 503 while it was away: clean, and retried.
    assert set(report["clean_errors"]) <= {"queue_unavailable", "no_worker", "service_unavailable", "refused"}


def test_gateway_restarted_during_load(rstack, tmp_path):
    report = run(rstack, tmp_path, "gateway-restart", repeats=1)
    assert set(report["clean_errors"]) <= {"refused", "draining"}, report["clean_errors"]
    assert report["faults"][0]["recovery_s"] is not None


def test_slow_clients_get_every_token_and_slow_nobody(rstack, tmp_path):
    report = run(rstack, tmp_path, "slow-client", clients=2, read_s=2.0)
    f = report["faults"][0]
    assert f["complete_and_equal"] == 2 and min(f["read_s"]) >= 1.5, f
    assert report["requests"]["failed"] == 0


def test_a_client_that_opens_many_streams_and_vanishes(rstack, tmp_path):
    report = run(rstack, tmp_path, "vanishing-client", streams=12)
    f = report["faults"][0]
    assert f["aborted"] >= 12 and f["all_aborted_s"] < 30, f
    assert report["gateway"] == {"in_flight": 0.0, "queue_depth": 0.0}
