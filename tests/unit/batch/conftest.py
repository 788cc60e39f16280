"""Fixtures of the batch unit tests: the services' real Redis, key prefix and tokenizer fixtures (shared with
tests/unit/services through tests/support/services.py), and an engine worker thread with the fake engine."""

from __future__ import annotations

import threading

import pytest

from kernellab.runtime.request.registry import DEFAULT_CPU_MODEL as MODEL
from tests.support.services import prefix, redis_url, tokenizer

__all__ = ["engine_worker", "prefix", "redis_url", "tokenizer"]


@pytest.fixture
def engine_worker(redis_url, prefix):
    """Starts a real ``Worker`` loop (Redis I/O threads, step loop) around the fake engine, on this test's
    prefix: ``engine_worker(step_s=…)``. Stopped (drained) at the end of the test."""
    from kernellab.services.config import WorkerSettings
    from kernellab.services.worker.loop import Worker
    from tests.support.fake_engine import FakeEngine

    started = []

    def start(step_s: float = 0.003):
        worker = Worker(
            WorkerSettings(
                redis_url=redis_url,
                key_prefix=prefix,
                model=MODEL,
                heartbeat_interval_s=0.05,
                worker_dead_after_s=2.0,
                worker_metrics_port=0,
                drain_timeout_s=0,
            ),
            engine=FakeEngine(step_s=step_s),
        )
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        started.append((worker, thread))
        return worker

    yield start
    for worker, thread in started:
        worker.drain()
        thread.join(10)
