"""What the gateway and the worker share to be observed: the ``/metrics`` + ``/health`` HTTP server each tier
runs on its own port, and the TTFT histogram buckets both use, so the gateway's client-side TTFT and the
worker's engine-side TTFT fall into the same buckets and can be compared (or subtracted) bucket by bucket.

It lives here, beside ``config.py`` and ``queue/``, because neither service may import the other's package:
the gateway never loads the worker's modules. Importing this module imports no torch and no FastAPI.
"""

from __future__ import annotations

import gc
import json
import logging
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily

log = logging.getLogger("kernellab")

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


class MetricsServer:
    """``/metrics`` (Prometheus text) and ``/health`` (JSON from ``health()``; 503 when it says not ok)."""

    def __init__(self, host: str, port: int, registry: CollectorRegistry, health: Callable[[], dict]):
        registry_ = registry

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    body, ctype, status = generate_latest(registry_), CONTENT_TYPE_LATEST, 200
                elif path in ("/health", "/healthz"):
                    info = health()
                    body, ctype = json.dumps(info).encode(), "application/json"
                    status = 200 if info.get("status") == "ok" else 503
                else:
                    body, ctype, status = b"not found\n", "text/plain", 404
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # quiet: Prometheus scrapes often
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, name="metrics-http", daemon=True)

    def start(self) -> MetricsServer:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class GcPauses:
    """Time this process spends in Python's cyclic garbage collector, by generation (``gc.callbacks``).

    A serving process holds hundreds of thousands of long-lived objects (modules, torch's Python objects, a
    tokenizer's vocabulary: ~675k with the embedded model loaded), and a full (generation 2) collection walks all
    of them: 155 ms on the 2-core CI box, during which the process's threads stand still (a step loop mid-step, a
    gateway's event loop). ``freeze_heap`` takes them out of the collector's reach; this clock shows what is left
    (the worker's step trace ``gc_dt``, its metric ``kernellab:gc_pause_seconds``).

    Each collection is timed twice: on the wall clock and on the collecting thread's CPU clock
    (``time.thread_time``). A collection that took much longer than its thread ran was not the collector's work: the
    thread was off the CPU or handed the GIL to another thread meanwhile (a callback or finalizer running Python
    code checks the interpreter's switch request). ``probe(ms)`` also takes a census of the generations a young
    collection walks (at its start: objects by type, and the references their containers hold, which the collector
    visits one by one) and keeps the census of each collection that took at least ``ms``: which objects a slow
    young collection walked. The census costs time of its own (it lists the young objects), so it is for
    diagnosis, off by default."""

    CENSUS_TYPES = 6  # types named in a census, by count and by references held
    CENSUS_KEEP = 64  # slow collections' censuses held until ``take_census`` reads them

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self.cpu_seconds = [0.0, 0.0, 0.0]
        self.collections = [0, 0, 0]
        self._started = 0.0
        self._cpu_started = 0.0
        self._probe_s: float | None = None
        self._census: dict | None = None
        self._slow: list[dict] = []

    def install(self) -> GcPauses:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)
        return self

    def probe(self, ms: float | None) -> None:
        """Census each young collection's objects, keep those of collections taking ``ms`` or longer (None: off)."""
        self._probe_s = None if ms is None else ms / 1e3
        self._census = None

    def _callback(self, phase: str, info: dict) -> None:
        g = info.get("generation", 2)
        if phase == "start":
            if self._probe_s is not None and g < 2:
                self._census = young_census(g, self.CENSUS_TYPES)
            self._cpu_started = time.thread_time()
            self._started = time.perf_counter()
            return
        wall = time.perf_counter() - self._started
        cpu = time.thread_time() - self._cpu_started
        self.seconds[g] += wall
        self.cpu_seconds[g] += cpu
        self.collections[g] += 1
        census, self._census = self._census, None
        if census is not None and self._probe_s is not None and wall >= self._probe_s:
            census.update(
                generation=g,
                ms=round(wall * 1e3, 3),
                cpu_ms=round(cpu * 1e3, 3),
                collected=info.get("collected"),
                uncollectable=info.get("uncollectable"),
            )
            if len(self._slow) < self.CENSUS_KEEP:
                self._slow.append(census)

    def take_census(self) -> list[dict]:
        """The slow collections' censuses since the last call (``probe``), oldest first."""
        out, self._slow = self._slow, []
        return out

    def total(self) -> float:
        return sum(self.seconds)

    def snapshot(self) -> tuple[float, ...]:
        """(seconds of generations 0, 1, 2, collections of generations 0, 1, 2, the collecting threads' CPU seconds
        of generations 0, 1, 2) so far: two snapshots' difference says which generation an interval's pause came
        from (a full collection walks every unfrozen object) and how much of it the collector ran."""
        return (*self.seconds, *self.collections, *self.cpu_seconds)

    def collect(self):  # a prometheus_client collector
        c = CounterMetricFamily(
            "kernellab:gc_pause_seconds", "Time the process spent in Python's garbage collector", labels=["generation"]
        )
        for g in range(3):
            c.add_metric([str(g)], self.seconds[g])
        yield c


def young_census(generation: int, top: int) -> dict:
    """What a collection of ``generation`` is about to walk: the objects of generations 0..``generation`` (not
    frozen), how many references their containers hold (each one a visit, twice, in the collection), and the
    ``top`` types by count and by references held (name: [objects, references])."""
    counts: dict[str, list[int]] = {}
    objects = refs = 0
    for gen in range(generation + 1):
        for o in gc.get_objects(gen):
            objects += 1
            n = len(o) if isinstance(o, (list, tuple, dict, set, frozenset)) else 0
            if isinstance(o, dict):
                n *= 2  # keys and values
            refs += n
            c = counts.setdefault(type(o).__qualname__, [0, 0])
            c[0] += 1
            c[1] += n
    by_count = sorted(counts.items(), key=lambda kv: -kv[1][0])[:top]
    by_refs = sorted(counts.items(), key=lambda kv: -kv[1][1])[:top]
    return {"objects": objects, "refs": refs, "by_count": dict(by_count), "by_refs": dict(by_refs)}


GC_PAUSES = GcPauses()  # one clock per process (the collector is per process)


def refreeze_heap() -> tuple[int, float]:
    """Collect, then freeze the survivors: ``freeze_heap`` at startup, and again at a moment with nothing in flight
    (the worker gone idle, ``gc_idle_freeze``). Returns (objects frozen in all, seconds taken); logs nothing (it
    runs at every idle transition)."""
    t = time.perf_counter()
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count(), time.perf_counter() - t


def freeze_heap() -> int:
    """Collect once, then move every object alive now into the permanent generation (``gc.freeze``), so later
    collections walk only what the process allocates while serving; call it once startup has built what lives as
    long as the process (the model, CUDA graphs, the tokenizer), as vLLM's engine does after it starts. Returns
    how many objects were frozen."""
    n, seconds = refreeze_heap()
    log.info("froze %d startup objects out of the garbage collector's reach (%.0f ms)", n, seconds * 1e3)
    return n
