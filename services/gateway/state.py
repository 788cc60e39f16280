"""The gateway's shared state: Redis clients, the output router, backpressure counts, readiness.

Backpressure: ``waiting`` counts admitted requests that have no first token yet (queued in Redis or in an
engine's waiting list); a request beyond ``max_waiting`` is refused with 429 + Retry-After before it touches
Redis. ``/ready`` needs Redis and a heartbeat younger than ``worker_dead_after_s`` from a worker of our model
that is not draining; a poller refreshes that view every half second so requests never pay for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import socket
import time
import uuid

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from kernellab.services.config import GatewaySettings
from kernellab.services.gateway.errors import RateLimited, ServiceUnavailable
from kernellab.services.gateway.generation import ResultStream
from kernellab.services.gateway.metrics import GatewayMetrics
from kernellab.services.gateway.requests import Prepared
from kernellab.services.gateway.responses import TokenText
from kernellab.services.gateway.router import REDIS_DOWN, OutputRouter
from kernellab.services.gateway.trace import RequestTrace
from kernellab.services.queue.aio import finish, raise_if_cancelling
from kernellab.services.queue.keys import GROUP, Keys
from kernellab.services.queue.protocol import (
    CancelMessage,
    Heartbeat,
    ProtocolError,
    RequestMessage,
    decode,
    entry,
)

log = logging.getLogger("kernellab.gateway")

# How often each gateway process reads the live workers (heartbeats) from Redis, and how stale that reading may be
# before a request that found no live worker makes the process read it again instead of answering 503 at once.
POLL_INTERVAL_S = 0.5
REPOLL_AFTER_S = 0.05
REQUEST_STREAM_MAXLEN = 100_000  # approximate trim; backpressure keeps the backlog far below it
FLUSH_SETTLE_S = 0.0005  # a submit pipeline goes out once no request joined it for this long …
FLUSH_MAX_S = 0.005  # … or this long after its first request
FORGET_DELAY_S = 0.05  # finished output streams are unlinked with the next submit pipeline, or this much later


def redis_client(url: str, *, timeout: float = 1.0, blocking_ms: int = 0) -> aioredis.Redis:
    """Fail fast when Redis is away (short connect timeout), but survive its restart: after one, every
    connection left in the pool can pass the pool's check and fail its first command ("Connection closed by
    server") although the new Redis is up, which was one 503 per pooled connection. So a command that fails on
    a broken connection is sent once more on a new one; a refused reconnect fails at once, and a timeout (the
    command may have run) is never retried."""
    return aioredis.Redis.from_url(
        url,
        socket_connect_timeout=timeout,
        socket_timeout=timeout + blocking_ms / 1000,
        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
    )


class Gateway:
    def __init__(
        self,
        settings: GatewaySettings,
        tokenizer,
        served_model: str,
        max_model_len: int,
        metrics: GatewayMetrics | None = None,
    ):
        self.settings = settings
        self.tokenizer = tokenizer
        self.model = served_model
        self._max_model_len = max_model_len  # 0: unknown (a hub id outside the registry) until workers report
        self.keys = Keys(settings.key_prefix, served_model)
        self.id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.metrics = metrics or GatewayMetrics(served_model)
        self.token_text = TokenText(tokenizer)
        self.options = settings.serving_options(tokenizer)  # sampling defaults, template switches, parsers
        self.api_keys = settings.keys_in_use()
        self.redis = redis_client(settings.redis_url)
        self.router = OutputRouter(redis_client(settings.redis_url, blocking_ms=5000), self.keys.wake(self.id))
        self.waiting = 0
        self.in_flight = 0
        self.draining = False
        self.redis_ok = False
        self.live_workers: list[Heartbeat] = []
        self._polled_at = 0.0  # time.monotonic() of the last poll_once
        self._tasks: set[asyncio.Task] = set()
        self._outgoing: list = []  # (entries, meta, future, trace stamps) waiting for the next submit pipeline
        self.trace = RequestTrace(settings.gateway_trace) if settings.gateway_trace else None
        self._forgotten: list[str] = []  # output streams of finished requests, not unlinked yet
        self._forget_timer: asyncio.TimerHandle | None = None
        self._poller: asyncio.Task | None = None
        self._closing = asyncio.Event()

    @property
    def max_model_len(self) -> int:
        """The context requests are checked against: the configured one, lowered to what live workers serve
        (a worker started with a shorter context must reject nothing the gateway let through)."""
        served = [w.max_model_len for w in self.live_workers if w.max_model_len]
        limits = [x for x in (self._max_model_len, min(served, default=0)) if x]
        return min(limits) if limits else 1 << 30  # unknown: the worker checks

    # ----------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        await self.router.start()
        await self.poll_once()
        self._poller = asyncio.create_task(self._poll(), name="readiness-poller")

    async def stop(self) -> None:
        """Background loops end between two Redis commands, never cancelled mid-command (``queue.aio``)."""
        self._closing.set()
        await finish([self._poller], timeout=self.settings.heartbeat_interval_s + 2.0, what="readiness poller")
        await self.router.stop()
        self._unlink_forgotten()
        await finish(list(self._tasks), timeout=2.0, what="cancel/cleanup tasks")
        await self.redis.aclose()
        await self.router.r.aclose()
        if self.trace is not None:
            self.trace.close()

    def _spawn(self, coro) -> None:
        """Fire and forget (cancels, cleanup): never awaited by a request that may itself be cancelled."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ----------------------------------------------------------------- readiness
    async def poll_once(self) -> None:
        self._polled_at = time.monotonic()
        try:
            now = time.time()
            pipe = self.redis.pipeline(transaction=False)
            pipe.zrangebyscore(self.keys.workers, now - self.settings.worker_dead_after_s, "+inf")
            for stream in self.keys.request_streams:
                pipe.xinfo_groups(stream)
            ids, *groups = await pipe.execute(raise_on_error=False)
            workers = []
            if isinstance(ids, list) and ids:
                blobs = await self.redis.mget([self.keys.heartbeat(w.decode()) for w in ids])
                for blob in blobs:
                    try:
                        hb = decode(blob, Heartbeat) if isinstance(blob, bytes) and blob else None
                    except ProtocolError:
                        hb = None
                    if hb is not None and not hb.draining:
                        workers.append(hb)
            self.live_workers = workers
            lag = 0
            for g in groups:
                if isinstance(g, list):
                    lag += sum(int(x.get("lag") or 0) for x in g if x.get("name") in (GROUP, GROUP.encode()))
            self.metrics.redis_lag.set(lag)
            self.redis_ok = True
        except REDIS_DOWN:
            raise_if_cancelling()
            self.redis_ok = False
            self.live_workers = []

    async def _poll(self) -> None:
        while not self._closing.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), POLL_INTERVAL_S)
            if not self._closing.is_set():
                await self.poll_once()

    def ready(self) -> tuple[bool, str]:
        if self.draining:
            return False, "draining"
        if not self.redis_ok or not self.router.healthy:
            return False, "redis unavailable"
        if not self.live_workers:
            return False, f"no live worker for {self.model}"
        return True, "ready"

    # ----------------------------------------------------------------- requests
    async def submit(self, p: Prepared, started: float, owner: str = "") -> ResultStream:
        """``owner``: the tenant (API-key digest) allowed to cancel it by id; "" without keys."""
        if self.draining:
            raise ServiceUnavailable("the gateway is shutting down", code="draining")
        if not self.live_workers and time.monotonic() - self._polled_at > REPOLL_AFTER_S:
            # a worker may have come up since the last poll (each gateway process polls on its own clock): look
            # once more before turning the request away, at most every REPOLL_AFTER_S under an outage
            await self.poll_once()
        if not self.live_workers:
            raise ServiceUnavailable(f"no worker is serving {self.model} right now", code="no_worker")
        if self.waiting >= self.settings.max_waiting:
            self.metrics.rejected.inc()
            raise RateLimited(f"too many requests waiting ({self.waiting}); retry shortly")
        streams = {self.keys.output(f"{p.request_id}-{c.index}"): c.index for c in p.choices}
        sub = self.router.subscribe(streams)
        now = time.time()
        deadline = now + self.settings.request_timeout_s
        stream = self.keys.requests(p.priority)
        entries = [
            (
                stream,
                entry(
                    RequestMessage(
                        p.request_id,
                        c.index,
                        p.model,
                        p.prompts[c.prompt_index],
                        c.params.to_dict(),
                        p.priority,
                        deadline,
                        now,
                    )
                ),
            )
            for c in p.choices
        ]
        self.waiting += 1  # counted before the await, so a burst cannot slip past max_waiting
        self.in_flight += 1
        stamps = {"in": started, "enq": time.perf_counter()} if self.trace is not None else None
        try:
            await self._enqueue(entries, (self.keys.meta(p.request_id), f"{len(p.choices)}:{owner}"), stamps)
        except BaseException as exc:
            self.waiting -= 1
            self.in_flight -= 1
            self.router.unsubscribe(sub)
            if isinstance(exc, REDIS_DOWN):
                raise ServiceUnavailable(f"the request queue is unavailable: {exc}", code="queue_unavailable") from None
            self.cancel(p.request_id, None, "closed")  # cancelled while enqueueing: it may still have gone out
            raise
        self.metrics.queue_depth.set(self.waiting)
        self.metrics.in_flight.set(self.in_flight)
        return ResultStream(self, p, sub, deadline, started, stamps)

    async def _enqueue(self, entries: list, meta: tuple[str, str], stamps: dict | None = None) -> None:
        """Requests submitted in the same event-loop turn share one pipeline, so a burst of clients reaches
        the workers in one read, and so in one engine step, instead of trickling in one round trip apart."""
        future = asyncio.get_running_loop().create_future()
        self._outgoing.append((entries, meta, future, stamps))
        if len(self._outgoing) == 1:
            now = time.perf_counter()
            asyncio.get_running_loop().call_soon(self._flush_when_settled, now, now, 1)
        await future

    def _flush_when_settled(self, start: float, grown_at: float, seen: int) -> None:
        """Flush once the batch has not grown for FLUSH_SETTLE_S (at most FLUSH_MAX_S after it began).
        Requests whose bytes arrive together reach ``submit`` over several loop turns (socket reads, middleware),
        so flushing at the first turn sent the head of a burst alone; checking again every turn costs a lone
        request a fraction of a millisecond."""
        now = time.perf_counter()
        if len(self._outgoing) > seen:
            grown_at, seen = now, len(self._outgoing)
        if now - grown_at < FLUSH_SETTLE_S and now - start < FLUSH_MAX_S:
            asyncio.get_running_loop().call_soon(self._flush_when_settled, start, grown_at, seen)
            return
        batch, self._outgoing = self._outgoing, []
        self._spawn(self._send(batch))

    async def _send(self, batch: list) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for entries, (meta_key, n), _future, _stamps in batch:
            for stream, fields in entries:
                pipe.xadd(stream, fields, maxlen=REQUEST_STREAM_MAXLEN, approximate=True)
            pipe.set(meta_key, n, ex=self.settings.output_ttl_s)
        pipe.xadd(self.router.wake_key, {b"w": b"1"}, maxlen=64, approximate=True)
        forgotten, self._forgotten = self._forgotten, []
        if forgotten:  # rides along: no round trip of its own (lost with the pipeline if Redis fails: they expire)
            pipe.unlink(*forgotten)
        stamped = [st for *_, st in batch if st is not None]
        sent = time.perf_counter()
        try:
            await pipe.execute()
        except Exception as exc:
            for _e, _m, future, _st in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        acked = time.perf_counter()
        for st in stamped:
            st["sent"], st["acked"] = sent, acked
        for _e, _m, future, _st in batch:
            if not future.done():
                future.set_result(None)

    def first_token(self, rs: ResultStream) -> None:
        self.waiting -= 1
        self.metrics.queue_depth.set(self.waiting)
        assert rs.first_token_at is not None  # the stream sets it before calling this
        self.metrics.ttft.observe(rs.first_token_at - rs.started)

    def release(self, rs: ResultStream) -> None:
        self.router.unsubscribe(rs.sub)
        if rs.first_token_at is None:
            self.waiting -= 1
            self.metrics.queue_depth.set(self.waiting)
        self.in_flight -= 1
        self.metrics.in_flight.set(self.in_flight)

    def cancel(self, request_id: str, index: int | None, reason: str) -> None:
        self.metrics.cancels.labels(reason).inc()
        self._spawn(self._send_cancel(CancelMessage(request_id, index, reason)))

    async def _send_cancel(self, msg: CancelMessage) -> None:
        try:
            await self.redis.xadd(self.keys.cancel, entry(msg), maxlen=10_000, approximate=True)
        except REDIS_DOWN as exc:
            log.warning("could not send cancel for %s: %s", msg.request_id, exc)

    async def cancel_by_id(self, request_id: str, owner: str = "") -> bool:
        """POST /v1/requests/{id}/cancel: any gateway can cancel a request it finds in Redis, for its owner only
        (another tenant's request is reported as unknown, so its existence does not leak either)."""
        try:
            meta = await self.redis.get(self.keys.meta(request_id))
        except REDIS_DOWN as exc:
            raise ServiceUnavailable(f"the request queue is unavailable: {exc}", code="queue_unavailable") from None
        if meta is None:
            return False
        _n, _, stored_owner = (meta.decode() if isinstance(meta, bytes) else str(meta)).partition(":")
        if not hmac.compare_digest(stored_owner.encode(), owner.encode()):
            return False
        await self._send_cancel(CancelMessage(request_id, None, "api"))
        self.metrics.cancels.labels("api").inc()
        return True

    def forget_streams(self, engine_ids: list[str]) -> None:
        """Unlink a finished request's output streams (they expire anyway), with the next submit pipeline or
        FORGET_DELAY_S later: one round trip and one task per request fewer under load."""
        self._forgotten += [self.keys.output(e) for e in engine_ids]
        if self._forget_timer is None:
            self._forget_timer = asyncio.get_running_loop().call_later(FORGET_DELAY_S, self._unlink_forgotten)

    def _unlink_forgotten(self) -> None:
        if self._forget_timer is not None:
            self._forget_timer.cancel()
            self._forget_timer = None
        keys, self._forgotten = self._forgotten, []
        if not keys:
            return

        async def unlink():
            with contextlib.suppress(*REDIS_DOWN):  # they expire anyway
                await self.redis.unlink(*keys)

        self._spawn(unlink())
