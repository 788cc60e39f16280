"""Integration fixtures: a private redis-server on a free port, and the stack (gateway + workers) as real
processes started through the CLI on 127.0.0.1 free ports. Everything is bounded in time and torn down; the
system Redis at 6379 is never touched."""

from __future__ import annotations

import pytest

from tests.support.stack import MODEL, RedisServer, Stack


@pytest.fixture(scope="session")
def private_redis(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def stack(private_redis, tmp_path_factory):
    """Two workers and a gateway, shared by the stack tests (the failure tests run last: they kill one)."""
    s = Stack(private_redis.url, tmp_path_factory.mktemp("stack"), workers=2).start()
    yield s
    s.stop()


@pytest.fixture(scope="session")
def offline_llm():
    """The engine driven directly, with the workers' settings: the reference for greedy outputs."""
    from kernellab.runtime.engine import LLM

    return LLM(MODEL, device="cpu", dtype="float32", num_kv_blocks=256)
