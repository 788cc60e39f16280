"""One reader for every output stream this gateway waits on: a single blocking XREAD over all of them.

Invariants:
- A subscription reads its streams from the beginning ("0-0"), so nothing a worker wrote before the
  subscription's first XREAD is missed, whatever the timing.
- Registering a subscription is followed (in the caller's submit pipeline) by an entry on this gateway's wake
  stream, which ends a blocked XREAD so the next one includes the new streams. The wake stream is read from
  an explicit id, never "$", so a wake that lands before the XREAD is still seen.
- While Redis is unreachable every subscription gets a ``RouterFailure`` at once: no client hangs on a
  stream that cannot arrive.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any, cast

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kernellab.services.queue.aio import finish, raise_if_cancelling
from kernellab.services.queue.protocol import ProtocolError, from_entry

if TYPE_CHECKING:
    from redis.typing import KeyT, StreamIdT

log = logging.getLogger("kernellab.gateway")

REDIS_DOWN: tuple[type[Exception], ...] = (RedisConnectionError, RedisTimeoutError, OSError)


class RouterFailure(Exception):
    pass


class Subscription:
    """The streams of one HTTP request; ``queue`` yields (choice index, message) or (None, RouterFailure)."""

    def __init__(self, streams: dict[str, int]):
        self.streams = streams  # stream key → choice index
        self.queue: asyncio.Queue = asyncio.Queue()
        self.first_read: float | None = None  # perf_counter() of the read that brought its first message


class OutputRouter:
    def __init__(self, client: aioredis.Redis, wake_key: str, block_ms: int = 5000):
        self.r = client
        self.wake_key = wake_key
        self.block_ms = block_ms
        self._subs: dict[str, Subscription] = {}
        self._last: dict[KeyT, StreamIdT] = {}  # stream key → the last entry id read
        self._wake_last: str | bytes = "0-0"
        self.healthy = True
        self._task: asyncio.Task | None = None
        self._closing = False

    def subscribe(self, streams: dict[str, int]) -> Subscription:
        sub = Subscription(streams)
        for key in streams:
            self._subs[key] = sub
            self._last[key] = "0-0"
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        for key in sub.streams:
            if self._subs.get(key) is sub:
                del self._subs[key]
                self._last.pop(key, None)

    @property
    def num_streams(self) -> int:
        return len(self._subs)

    async def start(self) -> None:
        try:
            await self.r.delete(self.wake_key)
        except REDIS_DOWN as exc:
            log.warning("redis unavailable at start: %s", exc)
        self._task = asyncio.create_task(self._run(), name="output-router")

    async def stop(self) -> None:
        """Ends the reader between two reads (a wake entry ends the blocked one), not by cancelling it
        mid-command (see ``queue.aio``)."""
        self._closing = True
        if self._task is not None:
            with contextlib.suppress(*REDIS_DOWN):
                await self.r.xadd(self.wake_key, {b"w": b"stop"}, maxlen=64, approximate=True)
            await finish([self._task], timeout=self.block_ms / 1000 + 1.0, what="output router")
        with contextlib.suppress(*REDIS_DOWN):
            await self.r.delete(self.wake_key)

    def _fail_all(self, why: str) -> None:
        failed = {id(s): s for s in self._subs.values()}
        self._subs.clear()
        self._last.clear()
        for sub in failed.values():
            sub.queue.put_nowait((None, RouterFailure(why)))

    async def _run(self) -> None:
        backoff = 0.05
        while not self._closing:
            streams: dict[KeyT, StreamIdT] = {self.wake_key: self._wake_last, **self._last}
            try:
                reply = await self.r.xread(streams, block=self.block_ms)
            except REDIS_DOWN as exc:
                raise_if_cancelling()
                if self._closing:
                    return
                if self.healthy:
                    log.warning("redis unavailable: failing %d stream(s): %s", len(self._subs), exc)
                self.healthy = False
                self._fail_all(f"redis unavailable: {exc}")
                await asyncio.sleep(backoff)
                backoff = min(1.0, backoff * 2)
                continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug must not stop every stream forever
                raise_if_cancelling()
                log.exception("output router error")
                self._fail_all(f"output router error: {exc}")
                await asyncio.sleep(0.1)
                continue
            self.healthy, backoff = True, 0.05
            now = time.perf_counter()
            # RESP2 (the client's protocol): [[stream, [(entry id, fields), ...]], ...]
            for key, entries in cast("list[list[Any]]", reply or []):
                key = key.decode() if isinstance(key, bytes) else key
                if key == self.wake_key:
                    self._wake_last = entries[-1][0]
                    continue
                sub = self._subs.get(key)
                if sub is None:
                    continue
                self._last[key] = entries[-1][0]
                index = sub.streams[key]
                if sub.first_read is None:
                    sub.first_read = now
                for _eid, fields in entries:
                    try:
                        sub.queue.put_nowait((index, from_entry(fields)))
                    except ProtocolError as exc:
                        sub.queue.put_nowait((None, RouterFailure(f"unreadable worker message: {exc}")))
