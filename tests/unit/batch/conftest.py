"""Fixtures of the batch unit tests: the services' real Redis, key prefix and tokenizer fixtures (reused from
tests/unit/services/conftest.py), and an engine worker thread with the services' fake engine."""

from __future__ import annotations

import importlib.util
import sys
import threading
from pathlib import Path

import pytest

_SERVICES = Path(__file__).parent.parent / "services"
sys.path.insert(0, str(_SERVICES))  # fake_engine


def _load_services_conftest():
    spec = importlib.util.spec_from_file_location("batch_services_conftest", _SERVICES / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_services = _load_services_conftest()
redis_url = _services.redis_url
prefix = _services.prefix
tokenizer = _services.tokenizer

from kernellab.runtime.registry import DEFAULT_CPU_MODEL as MODEL  # noqa: E402


@pytest.fixture
def engine_worker(redis_url, prefix):
    """Starts a real ``Worker`` loop (Redis I/O threads, step loop) around the fake engine, on this test's
    prefix: ``engine_worker(step_s=…)``. Stopped (drained) at the end of the test."""
    from fake_engine import FakeEngine

    from kernellab.services.config import WorkerSettings
    from kernellab.services.worker.loop import Worker

    started = []

    def start(step_s: float = 0.003):
        worker = Worker(WorkerSettings(redis_url=redis_url, key_prefix=prefix, model=MODEL, heartbeat_interval_s=0.05,
                                       worker_dead_after_s=2.0, worker_metrics_port=0, drain_timeout_s=0),
                        engine=FakeEngine(step_s=step_s))
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        started.append((worker, thread))
        return worker

    yield start
    for worker, thread in started:
        worker.drain()
        thread.join(10)
