"""Worker metrics with vLLM's names (``kernellab:`` instead of ``vllm:``), labelled with ``model_name``, and the
small HTTP server that exposes them on their own port next to ``/health``.

Counters that the engine keeps cumulatively (tokens, prefix-cache queries/hits, preemptions) are advanced by
the difference since the last snapshot, so a Prometheus ``rate()`` over them is right.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0)

_CUMULATIVE = {
    "prompt_tokens": "prompt_tokens",
    "generation_tokens": "generation_tokens",
    "prefix_cache_queries": "prefix_cache_queries",
    "prefix_cache_hits": "prefix_cache_hits",
    "num_preemptions": "num_preemptions",
}


class WorkerMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self.ttft = Histogram("kernellab:time_to_first_token_seconds", "Time to first token (worker receipt to "
                              "first token)", labels, buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("kernellab:inter_token_latency_seconds", "Time between successive tokens of a request",
                             labels, buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("kernellab:e2e_request_latency_seconds", "Worker receipt to last token", labels,
                             buckets=E2E_BUCKETS, registry=r).labels(model_name)
        self.running = Gauge("kernellab:num_requests_running", "Requests in the engine's running batch", labels,
                             registry=r).labels(model_name)
        self.waiting = Gauge("kernellab:num_requests_waiting", "Requests waiting in the engine", labels,
                             registry=r).labels(model_name)
        self.kv_usage = Gauge("kernellab:kv_cache_usage_perc", "KV-cache usage, 1 = 100 %", labels,
                              registry=r).labels(model_name)
        self.counters = {
            "prompt_tokens": Counter("kernellab:prompt_tokens", "Prefill tokens processed", labels, registry=r),
            "generation_tokens": Counter("kernellab:generation_tokens", "Tokens generated", labels, registry=r),
            "prefix_cache_queries": Counter("kernellab:prefix_cache_queries", "Tokens looked up in the prefix cache",
                                            labels, registry=r),
            "prefix_cache_hits": Counter("kernellab:prefix_cache_hits", "Tokens found in the prefix cache", labels,
                                         registry=r),
            "num_preemptions": Counter("kernellab:num_preemptions", "Preemptions (by recompute)", labels,
                                       registry=r),
        }
        self.counters = {k: c.labels(model_name) for k, c in self.counters.items()}
        self.finished = Counter("kernellab:request_success", "Finished requests by finish reason",
                                ["model_name", "finished_reason"], registry=r)
        self.reclaimed = Counter("kernellab:requests_reclaimed", "Requests resumed from a dead or draining worker",
                                 labels, registry=r).labels(model_name)
        self.dead_lettered = Counter("kernellab:requests_dead_lettered", "Requests sent to the dead-letter stream",
                                     labels, registry=r).labels(model_name)
        self.redis_errors = Counter("kernellab:worker_redis_errors", "Failed Redis operations", labels,
                                    registry=r).labels(model_name)
        self.model_name = model_name
        self._last: dict[str, float] = {}

    def update_from_stats(self, stats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        for name, attr in _CUMULATIVE.items():
            value = float(getattr(stats, attr, 0) or 0)
            delta = value - self._last.get(name, 0.0)
            if delta > 0:
                self.counters[name].inc(delta)
            self._last[name] = value

    def finish(self, reason: str | None) -> None:
        self.finished.labels(self.model_name, reason or "unknown").inc()


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
