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

The four add up to the TTFT. ``steps`` lists the run's first steps (those ending after t0): start (ms after t0), duration (ms), rows,
tokens, and how many first tokens each made: a stack whose first steps differ from the engine's in size or
timing shows it there.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

PARTS = ("to_worker", "queued", "step", "delivery")


def read_trace(path: str | Path, since: float) -> tuple[list[dict], dict[str, float]]:
    """(steps, {"request_id:index": take-in time}) from a worker's step trace, entries at or after ``since``."""
    steps, adds = [], {}
    p = Path(path)
    if not p.exists():
        return steps, adds
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
            adds[f"{ev['rid']}:{ev['i']}"] = ev["t"]
    return steps, adds


def timeline(steps: list[dict], adds: dict[str, float], records: list[dict], t0: float, first_steps: int = 8) -> dict:
    """records: {"rid", "sent", "first"} (perf_counter seconds; rid as in the trace's ``first`` lists)."""
    made_first = {rid: s for s in steps for rid in s.get("first", ())}
    parts: dict[str, list[float]] = {k: [] for k in PARTS}
    joined = 0
    for r in records:
        s, taken = made_first.get(r.get("rid")), adds.get(r.get("rid"))
        if s is None or taken is None or r.get("first") is None:
            continue
        joined += 1
        end = s["t"] + s["dt"]
        for k, v in zip(PARTS, (taken - r["sent"], s["t"] - taken, s["dt"], r["first"] - end), strict=True):
            parts[k].append(v * 1e3)
    ordered = sorted((s for s in steps if s["t"] + s["dt"] >= t0), key=lambda s: s["t"])  # this run's steps
    return {
        "requests_joined": joined,
        "median_ms": {k: round(statistics.median(v), 3) if v else None for k, v in parts.items()},
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
