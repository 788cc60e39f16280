"""The worker's step trace (``KERNELLAB_STEP_TRACE=path``): latency forensics without a profiler.

One JSON line per engine step and per request the loop takes in, with ``time.monotonic()`` times (on Linux
CLOCK_MONOTONIC, the clock ``time.perf_counter()`` reads in every process, so a load generator on the same host
can line its own send and receive times up with the worker's):

    {"ev": "add", "t": ..., "rid": "cmpl-…", "i": 0, "prompt": 512, "recv": ...}
    {"ev": "step", "t": ..., "dt": ..., "rows": 32, "tokens": 8192, "first": ["cmpl-…:0", …], "emit_dt": ...,
     "launch_dt": ..., "wait_dt": ..., "gc_dt": ..., "gc_gen": [[s0, n0, c0], [s1, n1, c1], [s2, n2, c2]],
     "gc_census": [...]}

``add``: ``t`` when the step loop took the request in (the engine has it from then on); ``recv`` when the
worker's I/O thread had read it from Redis (it prepares it next, ``Worker.prepare``): ``t - recv`` is the wait
for the loop, behind a step in flight or the take-in of the requests before it. Traces written before ``recv``
existed lack it. ``step``: ``rows`` / ``tokens``: what the engine scheduled (when it says); ``first``: requests
whose first token the step made; ``emit_dt``: handing the step's chunks to the writer thread, including the wait
for first tokens to reach Redis; ``launch_dt`` / ``wait_dt`` (engines with a host gate, runtime/host_gate.py): from
the step's start to its first wait for the device (null: none), and the time in those waits, when the request
reader may run; ``gc_dt``: time the worker's process spent in the garbage collector since the previous step's line
(the step, its emit and the take-in before it; observability.GcPauses), and ``gc_gen`` the same split by generation,
``[seconds, collections, CPU seconds]`` for generations 0, 1 and 2 (a full collection, generation 2, walks every
object not frozen at startup; the CPU seconds are the collecting thread's own, so a pause much longer than them
was spent off the CPU or with the GIL handed to another thread; traces written before lack them);
``gc_census`` (``KERNELLAB_GC_PROBE_MS``): for each young collection since the previous line that took at least
that long, what it walked (observability.young_census). Events are buffered and written (formatted then, not on the loop's time between
steps) whenever the engine goes idle, and at exit.
"""

from __future__ import annotations

import json
import threading


class StepTrace:
    def __init__(self, path: str):
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 — lives as long as the worker
        self._events: list[dict] = []
        self._lock = threading.Lock()

    def add(self, t: float, request_id: str, index: int, prompt_tokens: int, received: float | None = None) -> None:
        ev = {"ev": "add", "t": t, "rid": request_id, "i": index, "prompt": prompt_tokens}
        if received is not None:
            ev["recv"] = received
        self._events.append(ev)

    def step(
        self,
        t: float,
        dt: float,
        shape: tuple[int, int] | None,
        first: list[str],
        emit_dt: float,
        gate: tuple[float | None, float] | None = None,
        gc: list[float] | None = None,
        census: list[dict] | None = None,
    ) -> None:
        rows, tokens = shape if shape is not None else (None, None)
        ev = {"ev": "step", "t": t, "dt": dt, "rows": rows, "tokens": tokens, "first": first, "emit_dt": emit_dt}
        if gate is not None:
            ev["launch_dt"], ev["wait_dt"] = gate
        if gc is not None:  # GcPauses.snapshot's difference: seconds, collections, CPU seconds, by generation
            ev["gc_dt"] = sum(gc[:3])
            ev["gc_gen"] = [[gc[g], int(gc[3 + g]), *gc[6 + g : 7 + g]] for g in range(3)]
        if census:
            ev["gc_census"] = census
        self._events.append(ev)

    def flush(self) -> None:
        with self._lock:
            if self._events:
                events, self._events = self._events, []
                self._file.write("".join(json.dumps(_rounded(ev)) + "\n" for ev in events))
                self._file.flush()

    def close(self) -> None:
        self.flush()
        self._file.close()


def _rounded(ev: dict) -> dict:
    """Times to the microsecond (what the file always held), the collector's split by generation too."""
    out = {k: round(v, 6) if isinstance(v, float) else v for k, v in ev.items()}
    gen: list | None = ev.get("gc_gen")
    if gen is not None:
        out["gc_gen"] = [[round(s, 6), n, *(round(c, 6) for c in rest)] for s, n, *rest in gen]
    return out
