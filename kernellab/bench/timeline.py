"""Where a request's time to first token went, from step traces (the worker's ``KERNELLAB_STEP_TRACE`` file or an
in-process engine's own record of its steps) joined with the client's send and receive times.

All times are on one monotonic clock (CLOCK_MONOTONIC on Linux: ``time.perf_counter()`` in the client,
``time.monotonic()`` in the worker). Per request with a first token:

- ``to_worker``: client send → the worker takes the request in (HTTP, gateway admission, Redis; 0 in-process),
- ``queued``: → the start of the step that makes its first token (the step in flight, gathering, earlier
  prefill steps),
- ``step``: that step's own duration,
- ``delivery``: its end → the client reads the token (the worker's emit, Redis, the gateway, SSE; ~0
  in-process).

The four add up to the TTFT. ``to_worker`` splits in two where the trace has the worker's receive time (the
``recv`` of its ``add`` lines; older traces have none, and then both are None): ``to_worker_read`` (client send →
the worker's I/O thread has read it from Redis) and ``inbox`` (→ the step loop takes it in: behind the step in
flight, or the loop's take-in of the requests before it). ``arrivals`` gives, for the joined requests, the
spread of those two instants after t0 (ms: min, median, max; with a gateway trace also of the instants its routes
began, ``gateway_in_ms``, and its submit pipelines went out, ``gateway_sent_ms``): a burst that reaches the worker together but is
taken in over several steps shows there, one that reaches it late shows in ``received_ms``.

With the gateway's request trace (``KERNELLAB_GATEWAY_TRACE``, ``read_gateway_trace``) the stack's parts split
again (medians, ms): ``to_worker_read`` into ``http_in`` (client send → the gateway's route began), ``admit`` (→ it
joined a submit pipeline: validation, tokenization), ``flush`` (→ that pipeline went out) and ``redis_read`` (→ the
worker's I/O thread read it); ``delivery`` into ``to_gateway`` (the step's end → the gateway's output router read
the first token: the worker's emit and Redis) and ``gateway_out`` (→ the client read it: the gateway's stream and
SSE write, the socket, the client).

``steps`` lists the run's first steps (those ending after t0): start (ms after t0), duration (ms), rows,
tokens, and how many first tokens each made: a stack whose first steps differ from the engine's in size or
timing shows it there. ``step_launch_wait_ms`` (worker traces with a host gate) splits the same steps into their
launch and their device waits, ``step_gc_ms`` gives the worker's garbage-collector time in each, and ``gc_ms`` its
total over the run's steps and the largest in one.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from pathlib import Path

PARTS = ("to_worker", "queued", "step", "delivery")  # add up to the TTFT
SPLIT = ("to_worker_read", "inbox")  # add up to to_worker
GATEWAY_SPLIT = ("http_in", "admit", "flush", "redis_read", "to_gateway", "gateway_out")  # with a gateway trace


def read_trace(path: str | Path, since: float) -> tuple[list[dict], dict[str, float], dict[str, float]]:
    """(steps, {"request_id:index": take-in time}, {"request_id:index": receive time}) from a worker's step
    trace, entries taken in at or after ``since``; the receive times of the ``add`` lines that have one."""
    steps: list[dict] = []
    adds: dict[str, float] = {}
    received: dict[str, float] = {}
    p = Path(path)
    if not p.exists():
        return steps, adds, received
    for line in p.read_text().splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if ev.get("t", 0.0) < since:
            continue
        if ev.get("ev") == "step":
            steps.append(ev)
        elif ev.get("ev") == "add":
            rid = f"{ev['rid']}:{ev['i']}"
            adds[rid] = ev["t"]
            if ev.get("recv") is not None:
                received[rid] = ev["recv"]
    return steps, adds, received


def read_gateway_trace(path: str | Path, since: float) -> dict[str, dict[str, float]]:
    """{request id: its times} from a gateway request trace (every process of the tier), requests that began at
    or after ``since``."""
    out: dict[str, dict[str, float]] = {}
    p = Path(path)
    if not p.exists():
        return out
    for line in p.read_text().splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if ev.get("in", 0.0) >= since and "rid" in ev:
            out[ev["rid"]] = ev
    return out


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def _spread(values: list[float]) -> list[float] | None:
    return [round(min(values), 2), round(statistics.median(values), 2), round(max(values), 2)] if values else None


def timeline(
    steps: list[dict],
    adds: dict[str, float],
    records: list[dict],
    t0: float,
    first_steps: int = 8,
    received: dict[str, float] | None = None,
    gateway: dict[str, dict[str, float]] | None = None,
) -> dict:
    """records: {"rid", "sent", "first"} (perf_counter seconds; rid as in the trace's ``first`` lists).
    ``received``: the worker's receive times (``read_trace``); without them the split parts are None.
    ``gateway``: the gateway's request trace (``read_gateway_trace``); with it ``median_ms`` also holds the
    GATEWAY_SPLIT parts."""
    received = received or {}
    made_first = {rid: s for s in steps for rid in s.get("first", ())}
    parts: dict[str, list[float]] = {k: [] for k in (*PARTS, *SPLIT, *(GATEWAY_SPLIT if gateway is not None else ()))}
    arrivals: dict[str, list[float]] = {"received_ms": [], "taken_ms": []}
    if gateway is not None:  # when the tier's routes began, and when their submit pipelines went out
        arrivals.update(gateway_in_ms=[], gateway_sent_ms=[])
    joined = 0
    per_process: Counter[int] = Counter()  # gateway pid → this run's joined requests it served
    for r in records:
        s, taken = made_first.get(r.get("rid")), adds.get(r.get("rid"))
        if s is None or taken is None or r.get("first") is None:
            continue
        joined += 1
        end = s["t"] + s["dt"]
        for k, v in zip(PARTS, (taken - r["sent"], s["t"] - taken, s["dt"], r["first"] - end), strict=True):
            parts[k].append(v * 1e3)
        arrivals["taken_ms"].append((taken - t0) * 1e3)
        got = received.get(r.get("rid"))
        if got is not None:
            parts["to_worker_read"].append((got - r["sent"]) * 1e3)
            parts["inbox"].append((taken - got) * 1e3)
            arrivals["received_ms"].append((got - t0) * 1e3)
        g = (gateway or {}).get(str(r.get("rid")).rsplit(":", 1)[0])
        if g is not None and all(k in g for k in ("in", "enq", "sent", "routed")):
            parts["http_in"].append((g["in"] - r["sent"]) * 1e3)
            parts["admit"].append((g["enq"] - g["in"]) * 1e3)
            parts["flush"].append((g["sent"] - g["enq"]) * 1e3)
            if got is not None:
                parts["redis_read"].append((got - g["sent"]) * 1e3)
            parts["to_gateway"].append((g["routed"] - end) * 1e3)
            parts["gateway_out"].append((r["first"] - g["routed"]) * 1e3)
            arrivals["gateway_in_ms"].append((g["in"] - t0) * 1e3)
            per_process[g.get("pid", 0)] += 1
            arrivals["gateway_sent_ms"].append((g["sent"] - t0) * 1e3)
    ordered = sorted((s for s in steps if s["t"] + s["dt"] >= t0), key=lambda s: s["t"])  # this run's steps
    out: dict = {}
    if arrivals["received_ms"]:  # the worker's reads: [ms after t0, requests] for each distinct receive instant
        reads = Counter(round(t, 3) for t in arrivals["received_ms"])
        out["reads"] = [[round(t, 2), n] for t, n in sorted(reads.items())]
    if per_process:  # how evenly the tier's processes shared the burst: [processes, fewest, most requests]
        out["gateway_load"] = [len(per_process), min(per_process.values()), max(per_process.values())]
    return (
        out
        | {
            "requests_joined": joined,
            "median_ms": {k: _median(v) for k, v in parts.items()},
            "arrivals": {k: _spread(v) for k, v in arrivals.items()},
            "steps": [
                [
                    round((s["t"] - t0) * 1e3, 2),
                    round(s["dt"] * 1e3, 2),
                    s.get("rows"),
                    s.get("tokens"),
                    len(s.get("first", ())),
                ]
                for s in ordered[:first_steps]
            ],
        }
        | _gate_split(ordered[:first_steps])
        | _gc(ordered)
    )


def _gc(steps: list[dict]) -> dict:
    """``gc_ms``: the worker's garbage-collector time over the run's steps, [total, the largest in one step]
    (traces that record it); ``gc_by_generation``: per generation 0, 1, 2, [ms, collections, the largest ms in
    one step, and where the trace has it the collecting thread's CPU ms] (traces that split it); ``gc_census``:
    the slowest young collections' censuses (traces written with ``KERNELLAB_GC_PROBE_MS``), slowest first."""
    pauses = [s["gc_dt"] for s in steps if s.get("gc_dt") is not None]
    if not pauses:
        return {}
    out: dict = {"gc_ms": [round(sum(pauses) * 1e3, 2), round(max(pauses) * 1e3, 2)]}
    split = [s["gc_gen"] for s in steps if s.get("gc_gen")]
    if split:
        out["gc_by_generation"] = [
            [
                round(sum(g[i][0] for g in split) * 1e3, 2),
                sum(g[i][1] for g in split),
                round(max(g[i][0] for g in split) * 1e3, 2),
                *([round(sum(g[i][2] for g in split) * 1e3, 2)] if all(len(g[i]) > 2 for g in split) else []),
            ]
            for i in range(3)
        ]
    census = [c for s in steps for c in s.get("gc_census") or ()]
    if census:
        out["gc_census"] = sorted(census, key=lambda c: -c["ms"])[:GC_CENSUS_KEEP]
    return out


GC_CENSUS_KEEP = 8


def _gate_split(steps: list[dict]) -> dict:
    """``step_launch_wait_ms``: for the same first steps, [ms from the step's start to its first device wait
    (None: none), ms in device waits]: the part of each step the worker's request reader may run in (worker
    traces with a host gate only). ``step_gc_ms``: the worker's garbage-collector time in each (traces that
    record it)."""

    def ms(v: float | None) -> float | None:
        return None if v is None else round(v * 1e3, 2)

    out = {}
    if any("wait_dt" in s for s in steps):
        out["step_launch_wait_ms"] = [[ms(s.get("launch_dt")), ms(s.get("wait_dt"))] for s in steps]
    if any("gc_dt" in s for s in steps):
        out["step_gc_ms"] = [ms(s.get("gc_dt")) for s in steps]
    if any("gc_gen" in s for s in steps):  # which generation: [ms of generation 0, 1, 2]
        out["step_gc_ms_by_generation"] = [[ms(g[0]) for g in s["gc_gen"]] if s.get("gc_gen") else None for s in steps]
    return out
