"""The gateway's Redis client across a Redis restart (a private redis-server of this test's own, not the stack's).

A pooled connection to the Redis that went away can still look usable to the pool's check when it is taken
(the socket was reset rather than closed), so the first command sent on it fails with "Connection closed by
server" although the new Redis is up: without a retry, that was one client's 503 (and once a CI run's stuck
stream) right after every restart. While Redis is away, commands must still fail at once."""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from kernellab.services.gateway.state import redis_client
from tests.support.stack import RedisServer

pytestmark = pytest.mark.integration


@pytest.fixture
def own_redis(tmp_path):
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()


async def _fill_pool(r, n: int) -> None:
    """``n`` connections in the pool, each used by a blocking read, as a burst of requests leaves them."""
    await asyncio.gather(*[r.xread({"kl-test:none": "0-0"}, block=100) for _ in range(n)])
    assert len(r.connection_pool._available_connections) == n


def test_commands_after_a_restart_succeed_on_the_pooled_connections(own_redis):
    async def run() -> list[str]:
        r = redis_client(own_redis.url)
        try:
            await _fill_pool(r, 8)
            own_redis.restart()
            failures = []
            for i in range(8):  # sequential pipelines, as the submit path sends them
                pipe = r.pipeline(transaction=False)
                pipe.xadd("kl-test:req", {b"i": i})
                pipe.set("kl-test:meta", i)
                try:
                    await pipe.execute()
                except RedisConnectionError as exc:
                    failures.append(f"pipeline {i}: {exc}")
            results = await asyncio.gather(*[r.xlen("kl-test:req") for _ in range(8)], return_exceptions=True)
            failures += [f"concurrent: {x}" for x in results if isinstance(x, Exception)]
            assert await r.xlen("kl-test:req") == 8 - sum(f.startswith("pipeline") for f in failures)
            return failures
        finally:
            await r.aclose()

    assert asyncio.run(run()) == []


def test_commands_still_fail_fast_while_redis_is_away(own_redis):
    async def run() -> float:
        r = redis_client(own_redis.url)
        try:
            await _fill_pool(r, 4)
            own_redis.stop()
            t0 = time.monotonic()
            for _ in range(4):
                with pytest.raises(RedisConnectionError):
                    await r.ping()
            return time.monotonic() - t0
        finally:
            await r.aclose()

    assert asyncio.run(run()) < 1.0
