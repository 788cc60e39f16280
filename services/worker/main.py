"""``kernellab worker``: load the engine, serve metrics and /health, run the step loop until SIGTERM drains it."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

from kernellab.services.config import WorkerSettings

log = logging.getLogger("kernellab.worker")


def serve(settings: WorkerSettings) -> None:
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from kernellab.services.observability import MetricsServer, freeze_heap
    from kernellab.services.worker.loop import Worker

    # The I/O threads need the GIL for well under a millisecond per step; by default a thread waiting for it
    # can wait the whole 5 ms switch interval while the step loop runs Python, which a client sees as latency.
    sys.setswitchinterval(settings.switch_interval_s)
    settings.pin_cpus()  # before the engine and the I/O threads exist: they inherit it
    if settings.nice:
        os.nice(settings.nice)
    worker = Worker(settings)
    if settings.gc_freeze:
        freeze_heap()  # the engine, its CUDA graphs and the tokenizer live as long as the process
    server = None
    if settings.worker_metrics_port:
        server = MetricsServer(
            settings.metrics_host, settings.worker_metrics_port, worker.metrics.registry, worker.health
        ).start()
        worker.metrics_url = f"http://{settings.metrics_host}:{server.port}/metrics"

    def on_signal(signum, _frame):
        log.info("signal %d: draining (up to %.0fs)", signum, settings.drain_timeout_s)
        worker.drain()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
    log.info(
        "worker %s serving %s (redis %s, prefix %r, metrics %s)",
        worker.worker_id,
        worker.model_name,
        settings.redis_url,
        settings.key_prefix,
        worker.metrics_url or "off",
    )
    try:
        worker.run()
    finally:
        if server is not None:
            server.stop()
    log.info("worker %s stopped", worker.worker_id)


if __name__ == "__main__":
    serve(WorkerSettings())
