"""Fixtures of the services' and the batch unit tests (their conftests import them): a real Redis (the local
one, or a private redis-server), a key prefix per test, so tests never see each other's streams, and the
embedded model's tokenizer."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import uuid

import pytest
import redis


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=0.5).ping())
    except redis.RedisError:
        return False


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    url = "redis://127.0.0.1:6379/0"
    if _answers(url):
        yield url
        return
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("no Redis at 127.0.0.1:6379 and no redis-server binary to start one")
    port = _free_port()
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(tmp_path_factory.mktemp("redis")),
        ],
        stdout=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 10
    while not _answers(url):
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("redis-server did not start")
        time.sleep(0.05)
    yield url
    proc.terminate()
    proc.wait(10)


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
