"""The worker's step trace (KERNELLAB_STEP_TRACE) and the TTFT breakdown built from it (kernellab.bench.timeline):
a real file written by services/worker/trace.py, read back and joined with client times."""

from __future__ import annotations

import json

import pytest

from kernellab.bench.timeline import read_trace, timeline
from kernellab.services.worker.trace import StepTrace


def test_trace_round_trip_and_ttft_parts_add_up(tmp_path):
    path = tmp_path / "trace.jsonl"
    tr = StepTrace(str(path))
    tr.add(10.002, "cmpl-a", 0, 512, received=10.0015)
    tr.add(10.004, "cmpl-b", 0, 512, received=10.0025)
    tr.step(10.005, 0.040, (2, 1024), ["cmpl-a:0"], 0.001)
    assert not path.exists() or path.read_text() == ""  # buffered until the engine goes idle
    tr.step(10.046, 0.030, (2, 513), ["cmpl-b:0"], 0.001)
    tr.flush()
    tr.add(1.0, "cmpl-old", 0, 8)  # before the run: filtered out by `since`
    tr.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["ev"] for x in lines] == ["add", "add", "step", "step", "add"]
    assert lines[0]["recv"] == 10.0015 and "recv" not in lines[4]  # a caller without a receive time writes none

    steps, adds, received = read_trace(path, since=9.0)
    assert len(steps) == 2 and set(adds) == {"cmpl-a:0", "cmpl-b:0"} and set(received) == set(adds)
    records = [
        {"rid": "cmpl-a:0", "sent": 10.000, "first": 10.047},
        {"rid": "cmpl-b:0", "sent": 10.001, "first": 10.079},
        {"rid": "cmpl-x:0", "sent": 10.001, "first": None},
    ]
    tl = timeline(steps, adds, records, t0=10.0, received=received)
    assert tl["requests_joined"] == 2
    m = tl["median_ms"]
    # a: 2 + 3 + 40 + 2 = 47 ms; b: 3 + 42 + 30 + 3 = 78 ms; medians are the pairs' means.
    assert m["to_worker"] == pytest.approx(2.5) and m["queued"] == pytest.approx(22.5)
    assert m["step"] == pytest.approx(35.0) and m["delivery"] == pytest.approx(2.5)
    # to_worker = read + inbox: a 1.5 + 0.5, b 1.5 + 1.5
    assert m["to_worker_read"] == pytest.approx(1.5) and m["inbox"] == pytest.approx(1.0)
    assert tl["arrivals"] == {"received_ms": [1.5, 2.0, 2.5], "taken_ms": [2.0, 3.0, 4.0]}
    assert tl["steps"] == [[5.0, 40.0, 2, 1024, 1], [46.0, 30.0, 2, 513, 1]]

    # A trace from before receive times: the four parts as before, the split unknown.
    old = timeline(steps, adds, records, t0=10.0)
    assert old["median_ms"]["to_worker"] == pytest.approx(2.5) and old["median_ms"]["inbox"] is None


def test_missing_trace_reads_as_empty(tmp_path):
    assert read_trace(tmp_path / "none.jsonl", 0.0) == ([], {}, {})
    tl = timeline([], {}, [{"rid": "x", "sent": 0.0, "first": 1.0}], 0.0)
    assert tl["requests_joined"] == 0 and tl["median_ms"]["step"] is None


def test_gc_pauses_split_by_generation_in_the_trace_and_the_timeline(tmp_path):
    """The step trace carries the collector's time since the last step by generation (GcPauses.snapshot's
    difference: seconds of generations 0-2, then their collection counts); the timeline sums it per generation and
    lists it for the first steps, so a serving run shows whether a pause was a full collection."""
    path = tmp_path / "trace.jsonl"
    tr = StepTrace(str(path))
    tr.add(10.002, "cmpl-a", 0, 512, received=10.001)
    tr.step(10.005, 0.040, (1, 512), ["cmpl-a:0"], 0.001, gc=[0.0002, 0.0, 0.0046, 3, 0, 1])
    tr.step(10.046, 0.030, (1, 1), [], 0.001, gc=[0.0001, 0.0003, 0.0, 1, 1, 0])
    tr.close()
    steps, adds, received = read_trace(path, since=9.0)
    assert steps[0]["gc_dt"] == pytest.approx(0.0048) and steps[0]["gc_gen"] == [[0.0002, 3], [0.0, 0], [0.0046, 1]]
    tl = timeline(steps, adds, [{"rid": "cmpl-a:0", "sent": 10.0, "first": 10.046}], t0=10.0, received=received)
    assert tl["gc_ms"] == [5.2, 4.8]  # total, the largest step
    assert tl["gc_by_generation"] == [[0.3, 4, 0.2], [0.3, 1, 0.3], [4.6, 1, 4.6]]  # ms, collections, largest
    assert tl["step_gc_ms"] == [4.8, 0.4]
    assert tl["step_gc_ms_by_generation"] == [[0.2, 0.0, 4.6], [0.1, 0.3, 0.0]]


def test_the_collectors_cpu_time_and_the_slow_collections_census_reach_the_timeline(tmp_path):
    """Snapshots with the collecting thread's CPU seconds (three more entries) give each generation a third number;
    censuses of slow young collections (KERNELLAB_GC_PROBE_MS) ride on the step line and the timeline keeps the
    slowest first."""
    path = tmp_path / "trace.jsonl"
    tr = StepTrace(str(path))
    tr.add(10.002, "cmpl-a", 0, 512, received=10.001)
    slow = {"objects": 700, "refs": 90_000, "by_count": {"list": [400, 90_000]}, "by_refs": {"list": [400, 90_000]}}
    tr.step(
        10.005,
        0.040,
        (1, 512),
        ["cmpl-a:0"],
        0.001,
        gc=[0.0018, 0.0, 0.0, 2, 0, 0, 0.0004, 0.0, 0.0],
        census=[
            {**slow, "generation": 0, "ms": 1.2, "cpu_ms": 0.3},
            {**slow, "generation": 0, "ms": 0.6, "cpu_ms": 0.5},
        ],
    )
    tr.step(10.046, 0.030, (1, 1), [], 0.001, gc=[0.0009, 0.0, 0.0, 1, 0, 0, 0.0008, 0.0, 0.0], census=[])
    tr.close()
    steps, adds, received = read_trace(path, since=9.0)
    assert steps[0]["gc_gen"][0] == [0.0018, 2, 0.0004] and "gc_census" not in steps[1]
    tl = timeline(steps, adds, [{"rid": "cmpl-a:0", "sent": 10.0, "first": 10.046}], t0=10.0, received=received)
    assert tl["gc_by_generation"][0] == [2.7, 3, 1.8, 1.2]  # ms, collections, largest, the thread's CPU ms
    assert [c["ms"] for c in tl["gc_census"]] == [1.2, 0.6]
    assert tl["gc_census"][0]["by_refs"] == {"list": [400, 90_000]}
