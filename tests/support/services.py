"""Fixtures of the services' and the batch unit tests (their conftests import them): a real Redis (the local
one, or a private redis-server), a key prefix per test, so tests never see each other's streams, and the
embedded model's tokenizer."""

from __future__ import annotations

import shutil
import uuid

import pytest
import redis

from kernellab.services.processes import Processes, free_port, redis_answers


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    url = "redis://127.0.0.1:6379/0"
    if redis_answers(url, 0.5):
        yield url
        return
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("no Redis at 127.0.0.1:6379 and no redis-server binary to start one")
    processes = Processes(tmp_path_factory.mktemp("redis"))
    try:
        url = processes.start_redis(free_port(), binary)
    except TimeoutError:
        processes.stop_all(grace=10)
        pytest.fail(f"redis-server did not start:\n{processes.log_tail()}")
    yield url
    processes.stop_all(grace=10)


@pytest.fixture
def prefix(redis_url):
    """A fresh key prefix; every key under it is deleted afterwards."""
    p = f"kltest-{uuid.uuid4().hex[:8]}:"
    yield p
    r = redis.Redis.from_url(redis_url)
    keys = list(r.scan_iter(match=f"{p}*", count=1000))
    if keys:
        r.delete(*keys)


@pytest.fixture(scope="session")
def tokenizer():
    from kernellab.runtime.request.tokenizer import load_tokenizer

    return load_tokenizer("smollm2-135m")
