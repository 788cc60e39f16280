"""Worker metrics with vLLM's names (``kernellab:`` instead of ``vllm:``), labelled with ``model_name``; the
small HTTP server that exposes them on their own port next to ``/health`` is ``services/observability.py``'s
``MetricsServer``, shared with the gateway.

Counters that the engine keeps cumulatively (tokens, prefix-cache queries/hits, preemptions) are advanced by
the difference since the last snapshot, so a Prometheus ``rate()`` over them is right.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kernellab.services.observability import TTFT_BUCKETS

ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
)

_CUMULATIVE = {
    "prompt_tokens": "prompt_tokens",
    "generation_tokens": "generation_tokens",
    "prefix_cache_queries": "prefix_cache_queries",
    "prefix_cache_hits": "prefix_cache_hits",
    "num_preemptions": "num_preemptions",
    "jit_compiles": "jit_compiles",
    "jit_compile_seconds": "jit_compile_seconds",
}


class WorkerMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self.ttft = Histogram(
            "kernellab:time_to_first_token_seconds",
            "Time to first token (worker receipt to first token)",
            labels,
            buckets=TTFT_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.itl = Histogram(
            "kernellab:inter_token_latency_seconds",
            "Time between successive tokens of a request",
            labels,
            buckets=ITL_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.e2e = Histogram(
            "kernellab:e2e_request_latency_seconds",
            "Worker receipt to last token",
            labels,
            buckets=E2E_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.running = Gauge(
            "kernellab:num_requests_running", "Requests in the engine's running batch", labels, registry=r
        ).labels(model_name)
        self.waiting = Gauge(
            "kernellab:num_requests_waiting", "Requests waiting in the engine", labels, registry=r
        ).labels(model_name)
        self.kv_usage = Gauge("kernellab:kv_cache_usage_perc", "KV-cache usage, 1 = 100 %", labels, registry=r).labels(
            model_name
        )
        self.counters = {
            "prompt_tokens": Counter("kernellab:prompt_tokens", "Prefill tokens processed", labels, registry=r),
            "generation_tokens": Counter("kernellab:generation_tokens", "Tokens generated", labels, registry=r),
            "prefix_cache_queries": Counter(
                "kernellab:prefix_cache_queries", "Tokens looked up in the prefix cache", labels, registry=r
            ),
            "prefix_cache_hits": Counter(
                "kernellab:prefix_cache_hits", "Tokens found in the prefix cache", labels, registry=r
            ),
            "num_preemptions": Counter("kernellab:num_preemptions", "Preemptions (by recompute)", labels, registry=r),
            # a kernel specialization first met while serving compiles on that step (runtime/jit_watch.py)
            "jit_compiles": Counter(
                "kernellab:triton_jit_compiles",
                "Triton kernel compiles after startup (each stalled a step)",
                labels,
                registry=r,
            ),
            "jit_compile_seconds": Counter(
                "kernellab:triton_jit_compile_seconds", "Seconds of those compiles", labels, registry=r
            ),
        }
        self.counters = {k: c.labels(model_name) for k, c in self.counters.items()}
        self.finished = Counter(
            "kernellab:request_success",
            "Finished requests by finish reason",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.reclaimed = Counter(
            "kernellab:requests_reclaimed", "Requests resumed from a dead or draining worker", labels, registry=r
        ).labels(model_name)
        self.dead_lettered = Counter(
            "kernellab:requests_dead_lettered", "Requests sent to the dead-letter stream", labels, registry=r
        ).labels(model_name)
        self.redis_errors = Counter(
            "kernellab:worker_redis_errors", "Failed Redis operations", labels, registry=r
        ).labels(model_name)
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
