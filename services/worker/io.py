"""The worker's Redis I/O, in threads beside the step loop so the engine never waits on the network.

- ``request reader``: XREADGROUP (interactive first, batch capped to a share of capacity), only as many
  requests as the worker has room for, so that several workers share the load. Each entry read goes through
  ``prepare`` (the step loop's: message to engine request, validated) here, while the loop is in a step, so
  that between steps the loop only enqueues it.
- ``cancel reader``: XREAD of the broadcast cancel stream; remembers recent cancels for requests not yet seen.
- ``writer``: each step's chunks and XACKs in one fenced write (a Lua script that writes and acks only for entries
  still pending under this worker), or in slices of ``write_slice`` messages, first tokens first (a gateway's
  blocked read is answered only once the script holding its entry has run; a retried batch rewrites its slices,
  which readers drop by ``seq``). While Redis is away it keeps the batch and retries; after
  ``outage_grace_s`` it asks the step loop to abort everything in flight (the gateways have failed those
  streams already), and the aborts are written once Redis answers again.
- ``housekeeping``: heartbeat, refresh of held entries, XAUTOCLAIM of dead workers' requests.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import redis

from kernellab.services.queue.broker import Delivery, WorkerQueue, connect, decode_cancel
from kernellab.services.queue.keys import Keys
from kernellab.services.queue.protocol import CancelMessage, ErrorMessage, Heartbeat, OutputChunk, encode

if TYPE_CHECKING:
    from redis.typing import StreamIdT

log = logging.getLogger("kernellab.worker")

_REDIS_DOWN: tuple[type[Exception], ...] = (redis.ConnectionError, redis.TimeoutError, OSError)


def _first_token(m: OutputChunk | ErrorMessage) -> bool:
    return isinstance(m, OutputChunk) and m.seq == 0 and bool(m.token_ids)


@dataclass
class WriteBatch:
    """What one step writes. Every message and XACK is fenced on its request entry: written only while the entry
    is still pending under this worker (a worker stalled past the reclaim timeout must not write for, nor count
    as finished, a request another worker has taken over)."""

    messages: list[OutputChunk | ErrorMessage] = field(default_factory=list)
    owners: list[Delivery] = field(default_factory=list)  # parallel to messages: the entry each belongs to
    acks: list[Delivery] = field(default_factory=list)
    on_acked: list[Callable[[], None] | None] = field(default_factory=list)  # parallel to acks: once XACKed by us
    requeue: list[Delivery] = field(default_factory=list)  # a draining worker hands these back
    written: list[threading.Event] = field(default_factory=list)  # set once the batch is in Redis

    def add(self, message: OutputChunk | ErrorMessage, owner: Delivery) -> None:
        self.messages.append(message)
        self.owners.append(owner)

    def ack(self, d: Delivery, on_acked: Callable[[], None] | None = None) -> None:
        self.acks.append(d)
        self.on_acked.append(on_acked)

    def extend(self, other: WriteBatch) -> None:
        self.messages += other.messages
        self.owners += other.owners
        self.acks += other.acks
        self.on_acked += other.on_acked
        self.requeue += other.requeue
        self.written += other.written


class Holdings:
    """Entries this worker holds (read, not yet XACKed), by engine id. Thread-safe; wakes the reader on release."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._held: dict[str, Delivery] = {}

    def add(self, d: Delivery) -> None:
        with self._lock:
            self._held[d.message.engine_id] = d

    def release(self, deliveries: list[Delivery]) -> None:
        with self._lock:
            for d in deliveries:
                if self._held.get(d.message.engine_id) is d:
                    del self._held[d.message.engine_id]
            self._lock.notify_all()

    def count(self, priority: str | None = None) -> int:
        with self._lock:
            return sum(1 for d in self._held.values() if priority in (None, d.message.priority))

    def by_stream(self) -> dict[str, list[str]]:
        with self._lock:
            out: dict[str, list[str]] = {}
            for d in self._held.values():
                out.setdefault(d.stream, []).append(d.entry_id)
            return out

    def take(self, stream: str, entry_ids: list[str]) -> list[Delivery]:
        """Forget the given entries of ``stream`` (no longer ours); returns their deliveries."""
        wanted, out = set(entry_ids), []
        with self._lock:
            for eid, d in list(self._held.items()):
                if d.stream == stream and d.entry_id in wanted:
                    out.append(self._held.pop(eid))
            self._lock.notify_all()
        return out

    def all(self) -> list[Delivery]:
        with self._lock:
            return list(self._held.values())

    def wait_for_room(self, limit: int, timeout: float) -> None:
        with self._lock:
            if len(self._held) >= limit:
                self._lock.wait(timeout)


class RecentCancels:
    """Cancels seen on the broadcast stream, kept for ``ttl_s`` so a request read later is dropped at once."""

    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[float, set[int] | None]] = {}

    def add(self, c: CancelMessage) -> None:
        with self._lock:
            _t, idx = self._seen.get(c.request_id, (0.0, set()))
            if c.index is None or idx is None:
                idx = None
            else:
                idx = idx | {c.index}
            self._seen[c.request_id] = (time.monotonic(), idx)

    def cancelled(self, request_id: str, index: int) -> bool:
        with self._lock:
            hit = self._seen.get(request_id)
            return hit is not None and (hit[1] is None or index in hit[1])

    def prune(self) -> None:
        cutoff = time.monotonic() - self.ttl_s
        with self._lock:
            for rid in [r for r, (t, _i) in self._seen.items() if t < cutoff]:
                del self._seen[rid]


class RedisIO:
    def __init__(
        self,
        url: str,
        keys: Keys,
        worker_id: str,
        *,
        max_num_seqs: int,
        batch_share: float,
        max_deliveries: int,
        heartbeat_interval_s: float,
        dead_after_s: float,
        output_ttl_s: int,
        request_timeout_s: float,
        inbox: queue.SimpleQueue,
        heartbeat: Callable[[], Heartbeat],
        prepare: Callable[[Delivery, float], Any],
        metrics=None,
        outage_grace_s: float = 2.0,
        admit: Callable[[], None] | None = None,
        write_slice: int = 0,
    ):
        self.url, self.keys, self.worker_id = url, keys, worker_id
        self.max_num_seqs, self.batch_share = max_num_seqs, batch_share
        self.max_deliveries = max_deliveries
        self.hb_interval, self.dead_after_s = heartbeat_interval_s, dead_after_s
        self.output_ttl_ms = output_ttl_s * 1000
        self.inbox, self.make_heartbeat, self.metrics = inbox, heartbeat, metrics
        self.prepare = prepare  # (delivery, time.monotonic() it was read) → the inbox's "add" payload
        self.outage_grace_s = outage_grace_s
        # Called by the request reader before each request's Python (decode, prepare): returns when that costs the
        # step loop nothing (runtime/host_gate.py's admit), or None: run at once.
        self.admit = admit
        # Messages per fenced write (0: a step's whole batch in one). A reader blocked on an output stream is
        # answered only once the Lua script holding its entry has run to the end (~25 µs a message on the CI box),
        # so a step of 64 first tokens delays the first one by the other 63; slices answer the first ones sooner
        # (one more round trip each), and first tokens go before continuing chunks.
        self.write_slice = write_slice
        self.holdings = Holdings()
        self.cancels = RecentCancels(request_timeout_s)
        self.outbox: queue.SimpleQueue[WriteBatch | None] = queue.SimpleQueue()
        self.accepting = threading.Event()  # cleared on drain: read and reclaim nothing new
        self.accepting.set()
        self.stopping = threading.Event()
        self.redis_ok = threading.Event()
        self.refreshes = 0  # completed ownership refreshes (the step loop waits for one after a stall)
        # True unless the request reader is parked in its idle blocking read (or waiting for room, or for Redis):
        # it holds entries not yet in the inbox, or is looking for more right after handing some over. A burst's
        # later reads (decoding and preparing tens of requests) can outlast the loop's first gather gap; while
        # this is set, the loop's gather keeps waiting (WorkerSettings.gather_max_s bounds it).
        self.reading = False
        self._threads: list[threading.Thread] = []

    def _queue(self, blocking_ms: int = 0) -> WorkerQueue:
        return WorkerQueue(
            connect(self.url, blocking_ms=blocking_ms), self.keys, self.worker_id, max_deliveries=self.max_deliveries
        )

    def start(self) -> None:
        for name, target in (
            ("request-reader", self._read_requests),
            ("cancel-reader", self._read_cancels),
            ("writer", self._write),
            ("housekeeping", self._housekeeping),
        ):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop reading, flush the writer (everything queued before this call is written first), leave."""
        self.accepting.clear()
        self.outbox.put(None)
        self.stopping.set()
        for t in self._threads:
            t.join(timeout)
        with contextlib.suppress(*_REDIS_DOWN):
            self._queue().leave(self.keys.heartbeat(self.worker_id))

    def _down(self, where: str, exc: Exception) -> None:
        if self.redis_ok.is_set():
            log.warning("redis unavailable (%s): %s", where, exc)
        self.redis_ok.clear()
        if self.metrics is not None:
            self.metrics.redis_errors.inc()

    def _deliver(self, deliveries: list[Delivery], received: float) -> None:
        """Hold, prepare and hand each to the loop in turn: the loop may take the first in before the last is
        prepared."""
        for d in deliveries:
            self.holdings.add(d)
            if self.admit is not None:
                self.admit()
            self.inbox.put(("add", self.prepare(d, received)))

    # ----------------------------------------------------------------- threads
    def _read_requests(self) -> None:
        q = None
        while not self.stopping.is_set():
            if not self.accepting.is_set():
                self.stopping.wait(0.1)
                continue
            try:
                q = q or self._queue(blocking_ms=1000)
                room = self.max_num_seqs - self.holdings.count()
                if room <= 0:
                    self.reading = False
                    self.holdings.wait_for_room(self.max_num_seqs, 0.5)
                    continue
                batch_room = max(0, min(room, int(self.max_num_seqs * self.batch_share) - self.holdings.count("batch")))
                got = q.read(["interactive"], room, None, self.admit)
                if len(got) < room and batch_room:
                    got += q.read(["batch"], min(batch_room, room - len(got)), None, self.admit)
                if not got:  # idle: wait for the next entry of either stream, then read greedily again
                    self.reading = False
                    got = q.read(["interactive", "batch"] if batch_room else ["interactive"], 1, 1000, self.admit)
                    self.reading = bool(got)  # more of a burst may be right behind it: look before parking
                received = time.monotonic()
                self.redis_ok.set()
                self._deliver(got, received)
            except _REDIS_DOWN as exc:
                self.reading = False
                self._down("read", exc)
                q = None
                self.stopping.wait(0.5)
        self.reading = False

    def _read_cancels(self) -> None:
        q: WorkerQueue | None = None
        last: StreamIdT = "0-0"  # replaced by recent_cancels' last id before the first read
        while not self.stopping.is_set():
            try:
                if q is None:
                    q = self._queue(blocking_ms=1000)
                    recent, last = q.recent_cancels(self.cancels.ttl_s)
                    for c in recent:
                        if c is not None:
                            self.cancels.add(c)
                reply = q.r.xread({self.keys.cancel: last}, count=512, block=1000)
                # RESP2 (the client's protocol): [[stream, [(entry id, fields), ...]]]
                for _stream, entries in cast("list[list[Any]]", reply or []):
                    for eid, fields in entries:
                        last = eid
                        c = decode_cancel(fields)
                        if c is not None:
                            self.cancels.add(c)  # first: a request read after this is dropped at once
                            self.inbox.put(("cancel", c))
            except _REDIS_DOWN as exc:
                self._down("cancels", exc)
                q = None
                self.stopping.wait(0.5)

    def _write(self) -> None:
        q, pending, failing_since, aborted = None, None, None, False
        done = False
        while not (done and pending is None):
            if pending is None:
                item = self.outbox.get()
                if item is None:
                    done = True
                    continue
                pending = item
                while True:  # coalesce: a writer that fell behind sends several steps in one pipeline
                    try:
                        more = self.outbox.get_nowait()
                    except queue.Empty:
                        break
                    if more is None:
                        done = True
                        break
                    pending.extend(more)
            try:
                q = q or self._queue()
                self._execute(q, pending)
                self.holdings.release(pending.acks + pending.requeue)
                for event in pending.written:
                    event.set()
            except _REDIS_DOWN as exc:
                self._down("write", exc)
                q = None
                failing_since = failing_since or time.monotonic()
                if not aborted and time.monotonic() - failing_since > self.outage_grace_s:
                    self.inbox.put(("abort_all", "redis unavailable"))
                    aborted = True
                if done and time.monotonic() - failing_since > self.outage_grace_s:
                    log.error("dropping %d unwritten messages at exit: redis unavailable", len(pending.messages))
                    return
                time.sleep(0.2)
            else:
                pending, failing_since, aborted = None, None, False
                self.redis_ok.set()

    def _execute(self, q: WorkerQueue, batch: WriteBatch) -> None:
        outputs = [
            (self.keys.output(f"{m.request_id}-{m.index}"), encode(m), d)
            for m, d in zip(batch.messages, batch.owners, strict=True)
        ]
        parts = self._slices(batch, outputs)
        skipped = 0
        for part in parts[:-1]:  # every slice but the last: messages only
            skipped += q.write_owned(part, [], self.output_ttl_ms)[1]
        acked, last_skipped = q.write_owned(parts[-1], batch.acks, self.output_ttl_ms)
        skipped += last_skipped
        if skipped:
            log.warning(
                "skipped %d output message(s) of request(s) no longer ours (reclaimed while we stalled)", skipped
            )
        for ours, on_acked in zip(acked, batch.on_acked, strict=True):
            if ours and on_acked is not None:
                on_acked()
        if batch.requeue:
            q.requeue(batch.requeue)

    def _slices(self, batch: WriteBatch, outputs: list) -> list[list]:
        """The batch's outputs as the fenced writes that carry them (the last one also carries the XACKs): one
        write, or with ``write_slice`` the outputs in order of urgency (first tokens, then the rest in their order;
        a stream's chunks keep theirs, as only a stream's first chunk is a first token) cut into that many each."""
        if self.write_slice <= 0 or len(outputs) <= self.write_slice:
            return [outputs]
        order = [i for i, m in enumerate(batch.messages) if _first_token(m)]
        firsts = set(order)
        order += [i for i in range(len(outputs)) if i not in firsts]
        cut = self.write_slice
        return [[outputs[i] for i in order[j : j + cut]] for j in range(0, len(order), cut)]

    def _housekeeping(self) -> None:
        q = None
        while not self.stopping.wait(self.hb_interval):
            try:
                q = q or self._queue()
                if self.accepting.is_set():
                    q.ensure_groups()
                hb = self.make_heartbeat()
                ttl_ms = int(self.dead_after_s * 1000)
                q.heartbeat(self.keys.heartbeat(self.worker_id), encode(hb), ttl_ms, hb.time)
                lost = [
                    d
                    for stream, ids in q.refresh(self.holdings.by_stream()).items()
                    for d in self.holdings.take(stream, ids)
                ]
                if lost:  # we were stalled past the reclaim timeout: another worker runs these now
                    log.warning("dropping %d request(s) another worker reclaimed from us", len(lost))
                    self.inbox.put(("lost", [d.message.engine_id for d in lost]))
                self.refreshes += 1
                room = self.max_num_seqs - self.holdings.count()
                if self.accepting.is_set() and room > 0:
                    dead_before = q.dead_lettered
                    claimed = q.reclaim(ttl_ms, room)
                    if self.metrics is not None:
                        self.metrics.reclaimed.inc(len(claimed))
                        self.metrics.dead_lettered.inc(q.dead_lettered - dead_before)
                    if claimed:
                        log.info("reclaimed %d request(s) from dead workers", len(claimed))
                    self._deliver(claimed, time.monotonic())
                self.cancels.prune()
                self.redis_ok.set()
            except _REDIS_DOWN as exc:
                self._down("heartbeat", exc)
                q = None
