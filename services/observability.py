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
    (the worker's step trace ``gc_dt``, its metric ``kernellab:gc_pause_seconds``)."""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self.collections = [0, 0, 0]
        self._started = 0.0

    def install(self) -> GcPauses:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)
        return self

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            g = info.get("generation", 2)
            self.seconds[g] += time.perf_counter() - self._started
            self.collections[g] += 1

    def total(self) -> float:
        return sum(self.seconds)

    def snapshot(self) -> tuple[float, ...]:
        """(seconds of generations 0, 1, 2, collections of generations 0, 1, 2) so far: two snapshots' difference
        says which generation an interval's pause came from (a full collection walks every unfrozen object)."""
        return (*self.seconds, *self.collections)

    def collect(self):  # a prometheus_client collector
        c = CounterMetricFamily(
            "kernellab:gc_pause_seconds", "Time the process spent in Python's garbage collector", labels=["generation"]
        )
        for g in range(3):
            c.add_metric([str(g)], self.seconds[g])
        yield c


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
