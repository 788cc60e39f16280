"""The worker's side of the queue (synchronous redis-py; called from the worker's I/O threads, never its step loop).

At-least-once delivery:
- A request entry stays pending (in the group's PEL) under the worker that read it until that worker XACKs it,
  which it does only after writing the request's final chunk (or error) in the same transaction.
- A live worker refreshes the idle time of the entries it holds on every heartbeat (XCLAIM … JUSTID, which
  does not count as a delivery); so an entry idle for longer than ``worker_dead_after`` belongs to a dead worker,
  and XAUTOCLAIM hands it to a live one, which resumes it from the tokens already in its output stream.
- A refresh only touches entries still pending under this worker (one Lua script: check the owner, then
  XCLAIM). A worker that was stalled past the reclaim timeout (SIGSTOP, a long GC or swap) learns that the
  others now own what it held, and drops those requests instead of taking them back and running them twice.
- An entry delivered more than ``max_deliveries`` times goes to the dead-letter stream, and its client gets an
  ``ErrorMessage``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, cast

import redis

from kernellab.services.queue.keys import GROUP, PRIORITIES, Keys
from kernellab.services.queue.protocol import (
    CancelMessage,
    ErrorMessage,
    OutputChunk,
    ProtocolError,
    RequestMessage,
    entry,
    from_entry,
)

if TYPE_CHECKING:
    from redis.typing import EncodableT, KeyT, StreamIdT

log = logging.getLogger("kernellab.queue")

# KEYS[1] stream; ARGV[1] group, ARGV[2] consumer, ARGV[3..] entry ids. Refreshes the entries still pending
# under the consumer; returns the others (reclaimed by another consumer, or no longer pending).
_REFRESH_OWNED = """
local lost = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
  else
    lost[#lost + 1] = ARGV[i]
  end
end
return lost
"""

# Fenced write of one step's output. KEYS: n output streams, the n request streams their entries are in, then
# the m request streams of the entries to XACK. ARGV: group, consumer, output TTL (ms), n, m, the n entry ids,
# the n payloads, the m entry ids. A message is written and an entry XACKed only while that entry is pending
# under this consumer; returns {1/0 per XACK, number of messages skipped}.
_WRITE_OWNED = """
local group, me, ttl = ARGV[1], ARGV[2], ARGV[3]
local n, m = tonumber(ARGV[4]), tonumber(ARGV[5])
local known = {}
local function ours(stream, id)
  local key = stream .. ' ' .. id
  if known[key] == nil then
    local p = redis.pcall('XPENDING', stream, group, id, id, 1)
    known[key] = type(p) == 'table' and p.err == nil and p[1] ~= nil and p[1][2] == me
  end
  return known[key]
end
local skipped = 0
for i = 1, n do
  if ours(KEYS[n + i], ARGV[5 + i]) then
    redis.call('XADD', KEYS[i], '*', 'm', ARGV[5 + n + i])
    redis.call('PEXPIRE', KEYS[i], ttl)
  else
    skipped = skipped + 1
  end
end
local acked = {}
for j = 1, m do
  local stream, id = KEYS[2 * n + j], ARGV[5 + 2 * n + j]
  if ours(stream, id) then
    redis.call('XACK', stream, group, id)
    acked[j] = 1
  else
    acked[j] = 0
  end
end
return {acked, skipped}
"""


def connect(url: str, *, timeout: float = 2.0, blocking_ms: int = 0) -> redis.Redis:
    """A client that fails fast when Redis is away (no hidden retries), with room for blocking reads."""
    return redis.Redis.from_url(
        url,
        socket_connect_timeout=timeout,
        socket_timeout=timeout + blocking_ms / 1000,
        retry=None,
        health_check_interval=0,
    )


@dataclass
class Delivery:
    """A request entry this worker now holds (pending under its name)."""

    stream: str
    entry_id: str
    message: RequestMessage
    deliveries: int = 1
    emitted: list[int] | None = None  # tokens already in the output stream (resumed requests)
    finished: bool = False  # the output stream already holds a final chunk: only the XACK is missing


def _sid(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class WorkerQueue:
    def __init__(self, client: redis.Redis, keys: Keys, consumer: str, *, max_deliveries: int = 3):
        self.r = client
        self.keys = keys
        self.consumer = consumer
        self.max_deliveries = max_deliveries
        self.dead_lettered = 0  # how many this client sent to the dead-letter stream
        self._refresh_owned = client.register_script(_REFRESH_OWNED)
        self._write_owned = client.register_script(_WRITE_OWNED)

    def ensure_groups(self) -> None:
        """Create the consumer group on every request stream (from id 0: nothing enqueued earlier is lost)."""
        for stream in self.keys.request_streams:
            try:
                self.r.xgroup_create(stream, GROUP, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    def read(
        self,
        priorities: tuple[str, ...] | list[str],
        count: int,
        block_ms: int | None,
        admit: Callable[[], None] | None = None,
    ) -> list[Delivery]:
        """New entries: up to ``count`` from each of the ``priorities``' streams (one XREADGROUP). ``admit`` is
        called before each entry is decoded (a worker's reader waits there while its step loop launches)."""
        streams: dict[KeyT, StreamIdT] = {self.keys.requests(p): ">" for p in PRIORITIES if p in priorities}
        if not streams or count <= 0:
            return []
        try:
            reply = self.r.xreadgroup(GROUP, self.consumer, streams, count=count, block=block_ms)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self.ensure_groups()  # Redis lost its data (restart without persistence)
            return []
        out = []
        # RESP2 (the client's protocol): [[stream, [(entry id, fields), ...]], ...]
        for stream, entries in cast("list[list[Any]]", reply or []):
            for entry_id, fields in entries:
                if admit is not None:
                    admit()
                out.extend(self._deliveries(_sid(stream), [(entry_id, fields)], {}))
        return self._resolve_resumes(out)

    def reclaim(self, min_idle_ms: int, count: int) -> list[Delivery]:
        """Entries of dead workers (idle longer than ``min_idle_ms``), poison ones dead-lettered."""
        out: list[Delivery] = []
        for stream in self.keys.request_streams:
            if count - len(out) <= 0:
                break
            try:
                _next, claimed, _deleted = self.r.xautoclaim(
                    stream, GROUP, self.consumer, min_idle_ms, start_id="0-0", count=count - len(out)
                )
            except redis.ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                self.ensure_groups()
                continue
            claimed = [(eid, f) for eid, f in claimed if f]  # entries trimmed away come back without fields
            if not claimed:
                continue
            counts: dict[str, int] = {}
            for eid, _f in claimed:
                info = self.r.xpending_range(stream, GROUP, min=eid, max=eid, count=1)
                counts[_sid(eid)] = int(info[0]["times_delivered"]) if info else 1
            for d in self._deliveries(stream, claimed, counts):
                d.message = replace(d.message, resume=True)
                if d.deliveries + d.message.attempt > self.max_deliveries:
                    self.dead_letter(
                        d,
                        f"delivered {d.deliveries + d.message.attempt} times (limit "
                        f"{self.max_deliveries}); its workers died while running it",
                    )
                else:
                    out.append(d)
        return self._resolve_resumes(out)

    def _deliveries(self, stream: str, entries, counts: dict[str, int]) -> list[Delivery]:
        out = []
        for entry_id, fields in entries:
            eid = _sid(entry_id)
            try:
                message = from_entry(fields, RequestMessage)
            except ProtocolError as exc:
                log.error("dropping unreadable request %s on %s: %s", eid, stream, exc)
                self.r.xadd(
                    self.keys.dead_letter,
                    {b"stream": stream, b"id": eid, b"reason": str(exc), **{k: v for k, v in fields.items()}},
                )
                self.r.xack(stream, GROUP, eid)
                continue
            out.append(Delivery(stream, eid, message, counts.get(eid, 1)))
        return out

    def _resolve_resumes(self, deliveries: list[Delivery]) -> list[Delivery]:
        for d in deliveries:
            if d.message.resume:
                d.emitted, d.finished = self.emitted_tokens(d.message.engine_id)
        return deliveries

    def emitted_tokens(self, engine_id: str) -> tuple[list[int], bool]:
        """The tokens already in a choice's output stream (deduplicated by seq), and whether it is finished."""
        tokens: list[int] = []
        finished = False
        for _eid, fields in self.r.xrange(self.keys.output(engine_id)) or []:
            try:
                msg = from_entry(fields)
            except ProtocolError:
                continue
            if isinstance(msg, ErrorMessage):
                finished = True
                continue
            if not isinstance(msg, OutputChunk):
                continue
            if msg.seq <= len(tokens):
                tokens.extend(msg.token_ids[len(tokens) - msg.seq :])
            finished = finished or msg.finished
        return tokens, finished

    def dead_letter(self, d: Delivery, reason: str) -> None:
        error = ErrorMessage(
            d.message.request_id,
            d.message.index,
            500,
            f"request failed: {reason}",
            type="server_error",
            code="dead_lettered",
            worker=self.consumer,
        )
        pipe = self.r.pipeline(transaction=True)
        pipe.xadd(
            self.keys.dead_letter,
            {**entry(d.message), b"stream": d.stream, b"id": d.entry_id, b"reason": reason},
            maxlen=10000,
            approximate=True,
        )
        pipe.xadd(self.keys.output(d.message.engine_id), entry(error))
        pipe.pexpire(self.keys.output(d.message.engine_id), 600_000)
        pipe.xack(d.stream, GROUP, d.entry_id)
        pipe.execute()
        self.dead_lettered += 1
        log.warning("dead-lettered %s: %s", d.message.engine_id, reason)

    def refresh(self, held: dict[str, list[str]]) -> dict[str, list[str]]:
        """Reset the idle time of the entries this worker holds, so no live worker's entry looks abandoned.
        Returns, by stream, the held entries that are no longer this worker's (another worker reclaimed them
        while this one was stalled, or they are gone): the caller must drop them, not run them on."""
        pipe = self.r.pipeline(transaction=False)
        streams = [s for s, ids in held.items() if ids]
        for stream in streams:
            self._refresh_owned(keys=[stream], args=[GROUP, self.consumer, *held[stream]], client=pipe)
        lost = {}
        for stream, reply in zip(streams, pipe.execute(raise_on_error=False), strict=True):
            if isinstance(reply, list) and reply:
                lost[stream] = [_sid(x) for x in reply]
        return lost

    def write_owned(
        self, outputs: list[tuple[str, bytes, Delivery]], acks: list[Delivery], ttl_ms: int
    ) -> tuple[list[bool], int]:
        """Append each (output stream, payload) and XACK each entry, atomically and only where the request entry
        is still this worker's. Returns whether each ack was ours, and how many messages were skipped."""
        if not outputs and not acks:
            return [], 0
        keys = [k for k, _, _ in outputs] + [d.stream for _, _, d in outputs] + [d.stream for d in acks]
        args: list[EncodableT] = [
            GROUP,
            self.consumer,
            ttl_ms,
            len(outputs),
            len(acks),
            *(d.entry_id for _, _, d in outputs),
            *(payload for _, payload, _ in outputs),
            *(d.entry_id for d in acks),
        ]
        acked, skipped = self._write_owned(keys=keys, args=args)
        return [bool(a) for a in acked], int(skipped)

    def requeue(self, deliveries: list[Delivery]) -> None:
        """Hand unfinished requests back (a draining worker): re-add each as a resumable copy, then XACK it."""
        if not deliveries:
            return
        pipe = self.r.pipeline(transaction=True)
        for d in deliveries:
            copy = replace(d.message, resume=True, attempt=d.message.attempt + 1)
            pipe.xadd(d.stream, entry(copy))
            pipe.xack(d.stream, GROUP, d.entry_id)
        pipe.execute()

    def heartbeat(self, key: str, payload: bytes, ttl_ms: int, now: float) -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.set(key, payload, px=ttl_ms)
        pipe.zadd(self.keys.workers, {self.consumer: now})
        pipe.zremrangebyscore(self.keys.workers, "-inf", now - 3600)
        pipe.execute()

    def leave(self, key: str) -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.delete(key)
        pipe.zrem(self.keys.workers, self.consumer)
        pipe.execute(raise_on_error=False)

    def recent_cancels(self, since_s: float) -> tuple[list, str]:
        """Cancel messages of the last ``since_s`` seconds (a new worker must know about them), and the last id."""
        start = f"{int((time.time() - since_s) * 1000)}-0"
        entries = self.r.xrange(self.keys.cancel, min=start) or []
        last = _sid(entries[-1][0]) if entries else start
        return [decode_cancel(f) for _e, f in entries], last


def decode_cancel(fields) -> CancelMessage | None:
    try:
        return from_entry(fields, CancelMessage)
    except ProtocolError as exc:
        log.error("ignoring unreadable cancel message: %s", exc)
        return None
