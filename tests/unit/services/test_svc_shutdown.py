"""Stopping asyncio code that talks to Redis: nothing left running, nothing waited on forever.

A cancellation that lands inside a redis-py command can come back as a Redis error or stall in the command's
cleanup (see ``kernellab.services.queue.aio``); a batch job's ``asyncio.run`` once hung for 15 minutes in CI
on a task left running. These tests pin down the helpers and that a gateway (the batch job's way into the
queue) stops with no task left behind, however its stop lands."""

from __future__ import annotations

import asyncio
import logging
import random
import time

import redis.exceptions

from kernellab.services.config import GatewaySettings
from kernellab.services.gateway.state import Gateway
from kernellab.services.queue import aio

MODEL = "smollm2-135m"


def test_a_cancel_disguised_as_a_redis_error_still_ends_a_retry_loop():
    rounds = {"n": 0}

    async def command():  # what redis-py can do when cancelled mid-command
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            raise redis.exceptions.ConnectionError("connection closed while reading") from None

    async def retry_loop():
        while True:
            rounds["n"] += 1
            try:
                await command()
            except redis.exceptions.ConnectionError:
                aio.raise_if_cancelling()
                await asyncio.sleep(0.01)

    async def main():
        task = asyncio.create_task(retry_loop())
        await asyncio.sleep(0.05)
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=2.0)
        return task in done and task.cancelled()

    assert asyncio.run(main())
    assert rounds["n"] == 1


def test_finish_waits_then_cancels_then_gives_up_with_a_warning(caplog):
    async def polite(stop: asyncio.Event):
        await stop.wait()
        return "stopped"

    async def stubborn():
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                continue  # swallows every cancel

    async def main():
        stop = asyncio.Event()
        a = asyncio.create_task(polite(stop))
        b = asyncio.create_task(asyncio.sleep(10))
        c = asyncio.create_task(stubborn())
        asyncio.get_running_loop().call_later(0.05, stop.set)
        started = time.monotonic()
        await aio.finish([a, b, c, None], timeout=0.3, what="test tasks")
        took = time.monotonic() - started
        states = (a.result(), b.cancelled(), c.done())
        c.cancel()  # let the loop close: the stubborn one ends when its loop is torn down
        return took, states

    with caplog.at_level(logging.WARNING, logger="kernellab.queue"):
        took, states = aio.run(main())
    assert states == ("stopped", True, False)
    assert 0.3 <= took < 2.5
    assert "test tasks: 1 task(s) did not stop" in caplog.text


def test_run_returns_although_a_task_ignores_cancellation():
    async def stubborn():
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                continue

    left = []

    async def main():
        left.append(asyncio.create_task(stubborn()))
        await asyncio.sleep(0)
        return 42

    started = time.monotonic()
    assert aio.run(main()) == 42
    assert time.monotonic() - started < 3.0
    assert not left[0].done()  # abandoned with a warning, not waited on


def test_gateway_stop_leaves_no_task_running_wherever_it_lands(redis_url, prefix, tokenizer):
    settings = GatewaySettings(
        redis_url=redis_url,
        key_prefix=prefix,
        model=MODEL,
        gateway_metrics_port=0,
        heartbeat_interval_s=0.05,
        worker_dead_after_s=2.0,
    )
    rng = random.Random(7)

    async def once(mid_poll: bool) -> tuple[float, int]:
        gw = Gateway(settings, tokenizer, MODEL, 8192)
        polling = asyncio.Event()
        poll_once = gw.poll_once

        async def watched_poll():
            polling.set()
            await poll_once()

        gw.poll_once = watched_poll
        await gw.start()
        if mid_poll:  # the hard case: the stop lands while the readiness poll is inside a Redis command
            polling.clear()
            await polling.wait()
            await asyncio.sleep(rng.uniform(0.0, 0.002))
        else:
            await asyncio.sleep(rng.uniform(0.0, 0.6))
        started = time.monotonic()
        await gw.stop()
        took = time.monotonic() - started
        left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        return took, len(left)

    results = [asyncio.run(once(mid_poll=i % 4 != 0)) for i in range(12)]
    assert all(left == 0 for _took, left in results), results
    assert max(took for took, _left in results) < 1.5, results
