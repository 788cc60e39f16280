"""Gateway metrics (their own registry, served on their own port), and the ASGI middleware that counts HTTP
requests by route template and status, timing each until its last byte (streams included).

With several gateway processes (``gateway_processes``) the values live in prometheus-client's multiprocess
files and the supervisor serves their merge; the gauges say how (``livesum``: the tier's total).

Names: ``kernellab_gateway_*`` (what grafana/ dashboards and alerts query); the worker's engine metrics use
vLLM's ``kernellab:`` names.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kernellab.services.observability import TTFT_BUCKETS

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class GatewayMetrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "kernellab_gateway_http_requests",
            "HTTP requests by route and status",
            ["route", "method", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "kernellab_gateway_http_request_duration_seconds",
            "HTTP request duration until the last byte",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge(
            "kernellab_gateway_queue_depth",
            "Admitted requests waiting for their first token",
            ["model_name"],
            registry=r,
            multiprocess_mode="livesum",
        ).labels(model_name)
        self.redis_lag = Gauge(
            "kernellab_gateway_redis_queue_lag",
            "Request entries no worker has read yet",
            ["model_name"],
            registry=r,
            multiprocess_mode="livemax",
        ).labels(model_name)
        self.in_flight = Gauge(
            "kernellab_gateway_requests_in_flight",
            "Requests being served",
            ["model_name"],
            registry=r,
            multiprocess_mode="livesum",
        ).labels(model_name)
        self.rejected = Counter(
            "kernellab_gateway_rejected", "Requests refused by backpressure (429)", ["model_name"], registry=r
        ).labels(model_name)
        self.disconnects = Counter(
            "kernellab_gateway_client_disconnects", "Clients gone before their answer ended", ["model_name"], registry=r
        ).labels(model_name)
        self.ttft = Histogram(
            "kernellab_gateway_time_to_first_token_seconds",
            "Request received to first token sent, as the client sees it",
            ["model_name"],
            buckets=TTFT_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.cancels = Counter(
            "kernellab_gateway_cancels", "Cancel messages sent to workers, by reason", ["reason"], registry=r
        )

    def http(self, route: str, method: str, status: int, seconds: float) -> None:
        """One HTTP request counted by route template and status, timed to its last byte."""
        self.requests.labels(route, method, str(status)).inc()
        self.latency.labels(route).observe(seconds)


class HTTPMetricsMiddleware:
    def __init__(self, app, metrics: GatewayMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = 500

        async def send_wrapper(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            path = getattr(scope.get("route"), "path", None) or "other"
            self.metrics.http(path, scope.get("method", ""), status, time.perf_counter() - start)
