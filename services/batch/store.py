"""Batch state in Redis (redis.asyncio), under the stack's key prefix.

Keys (``P`` = key prefix):
  ``P batch:{id}``            hash: the batch object's fields (status, timestamps, file ids, counts)
  ``P batches``               sorted set: batch ids by creation time (GET /v1/batches)
  ``P batch:{id}:results``    hash: input line index → its finished line (``o``/``e`` + JSON): the progress
  ``P batch:{id}:inflight``   hash: queue request id → line index, for lines submitted and not yet recorded
  ``P batch:{id}:lease``      string: the token of the job that owns the batch now (expires unless renewed)

Invariants:
- Status changes are compare-and-set (a Lua script): a transition names the statuses it may leave, so a
  cancel from the API and the job's own progress never overwrite each other.
- A line's result is recorded at most once (HSETNX) and its count is incremented in the same script; so
  however often a job is redelivered, every line is written once, and the counts match the results.
- Results are recorded only while the batch runs (in_progress or cancelling); the final transition deletes
  the progress keys in the same script, so a late writer cannot resurrect them.
"""

from __future__ import annotations

import builtins
import json
import time
import uuid
from typing import TYPE_CHECKING, cast

import redis.asyncio as aioredis

if TYPE_CHECKING:
    from redis.typing import EncodableT, FieldT

STATUSES = ("validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled")
TERMINAL = frozenset({"failed", "completed", "expired", "cancelled"})
RUNNING = ("in_progress", "cancelling")
_TIMES = (
    "created_at",
    "in_progress_at",
    "expires_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
)

# KEYS[1] batch, KEYS[2..] deleted on success; ARGV[1] allowed statuses "a,b", ARGV[2] new status, then pairs.
_TRANSITION = """
local cur = redis.call('HGET', KEYS[1], 'status')
if not cur then return {0, ''} end
for s in string.gmatch(ARGV[1], '[^,]+') do
  if s == cur then
    redis.call('HSET', KEYS[1], 'status', ARGV[2], unpack(ARGV, 3))
    for i = 2, #KEYS do redis.call('DEL', KEYS[i]) end
    return {1, cur}
  end
end
return {0, cur}
"""
# KEYS results, batch, inflight; ARGV index, value, count field, request id ('' if none).
_RECORD = """
local st = redis.call('HGET', KEYS[2], 'status')
if st ~= 'in_progress' and st ~= 'cancelling' then return -1 end
if ARGV[4] ~= '' then redis.call('HDEL', KEYS[3], ARGV[4]) end
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
  return 1
end
return 0
"""
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex[:24]}"


def _s(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def to_openai(fields: dict) -> dict:
    """The OpenAI batch object from the stored hash."""
    f = {_s(k): _s(v) for k, v in fields.items()}

    def t(name):
        return int(f[name]) if f.get(name) else None

    return {
        "id": f["id"],
        "object": "batch",
        "endpoint": f["endpoint"],
        "model": f.get("model") or None,
        "errors": json.loads(f["errors"]) if f.get("errors") else None,
        "input_file_id": f["input_file_id"],
        "completion_window": f["completion_window"],
        "status": f["status"],
        "output_file_id": f.get("output_file_id") or None,
        "error_file_id": f.get("error_file_id") or None,
        **{name: t(name) for name in _TIMES},
        "request_counts": {
            "total": int(f.get("total") or 0),
            "completed": int(f.get("completed") or 0),
            "failed": int(f.get("failed") or 0),
        },
        "metadata": json.loads(f["metadata"]) if f.get("metadata") else None,
        "usage": json.loads(f["usage"]) if f.get("usage") else None,
    }


class BatchStore:
    def __init__(self, client: aioredis.Redis, prefix: str):
        self.r = client
        self.prefix = prefix
        self._transition = client.register_script(_TRANSITION)
        self._record = client.register_script(_RECORD)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)

    # ----------------------------------------------------------------- keys
    def key(self, batch_id: str) -> str:
        return f"{self.prefix}batch:{batch_id}"

    @property
    def index_key(self) -> str:
        return f"{self.prefix}batches"

    def results_key(self, batch_id: str) -> str:
        return f"{self.key(batch_id)}:results"

    def inflight_key(self, batch_id: str) -> str:
        return f"{self.key(batch_id)}:inflight"

    def lease_key(self, batch_id: str) -> str:
        return f"{self.key(batch_id)}:lease"

    # ----------------------------------------------------------------- objects
    async def create(
        self,
        batch_id: str,
        *,
        endpoint: str,
        input_file_id: str,
        completion_window: str,
        expires_in_s: int,
        metadata: dict | None,
        model: str,
        owner: str = "",
    ) -> dict:
        now = int(time.time())
        fields: dict[FieldT, EncodableT] = {
            "id": batch_id,
            "endpoint": endpoint,
            "input_file_id": input_file_id,
            "model": model,
            "completion_window": completion_window,
            "status": "validating",
            "created_at": now,
            "expires_at": now + expires_in_s,
            "total": 0,
            "completed": 0,
            "failed": 0,
            "owner": owner,
        }
        if metadata:
            fields["metadata"] = json.dumps(metadata)
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(self.key(batch_id), mapping=fields)
        pipe.zadd(self.index_key, {batch_id: time.time()})
        await pipe.execute()
        return to_openai(fields)

    async def discard(self, batch_id: str) -> None:
        """Undo a create whose job could not be enqueued."""
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(self.key(batch_id))
        pipe.zrem(self.index_key, batch_id)
        await pipe.execute()

    async def fields(self, batch_id: str) -> dict[str, str] | None:
        raw = await self.r.hgetall(self.key(batch_id))
        return {_s(k): _s(v) for k, v in raw.items()} if raw else None

    async def get(self, batch_id: str) -> dict | None:
        raw = await self.r.hgetall(self.key(batch_id))
        return to_openai(raw) if raw else None

    async def status(self, batch_id: str) -> str | None:
        value = await self.r.hget(self.key(batch_id), "status")
        return _s(value) if value is not None else None

    # Below this method, ``list`` in an annotation of the class body is this method: they say ``builtins.list``.
    async def list(self, after: str | None, limit: int, owner: str | None = None) -> tuple[list[dict], bool]:
        """Newest first, ``limit`` batches after the one with id ``after`` (only ``owner``'s when given); and
        whether more follow."""
        start = 0
        if after:
            rank = await self.r.zrevrank(self.index_key, after)
            if rank is None:
                return [], False
            start = cast(int, rank) + 1  # an int: a list only with withscore=True
        out: list[dict] = []
        while True:
            ids = await self.r.zrange(self.index_key, start, start + 4 * limit, desc=True)
            if not ids:
                return out, False
            start += len(ids)
            for batch_id in ids:
                fields = await self.fields(_s(batch_id))
                if fields is None or (owner is not None and fields.get("owner", "") != owner):
                    continue
                if len(out) == limit:
                    return out, True
                out.append(to_openai(fields))

    async def transition(
        self,
        batch_id: str,
        allowed: tuple[str, ...] | builtins.list[str],
        new: str,
        *,
        delete_progress: bool = False,
        **fields,
    ) -> tuple[bool, str]:
        """Set ``status=new`` (and ``fields``) if the status is one of ``allowed``: (done, previous status)."""
        keys = [self.key(batch_id)]
        if delete_progress:
            keys += [self.results_key(batch_id), self.inflight_key(batch_id)]
        args = [",".join(allowed), new]
        for k, v in fields.items():
            args += [k, "" if v is None else (json.dumps(v) if isinstance(v, dict) else v)]
        done, previous = await self._transition(keys=keys, args=args)
        return bool(done), _s(previous)

    async def set_fields(self, batch_id: str, **fields: EncodableT) -> None:
        # str keys are FieldT's, but redis-py's Mapping[FieldT, ...] is invariant in its key type
        await self.r.hset(self.key(batch_id), mapping=cast("dict[FieldT, EncodableT]", fields))

    # ----------------------------------------------------------------- progress
    async def record(self, batch_id: str, index: int, line: str, ok: bool, request_id: str = "") -> int:
        """1: recorded now; 0: the line was already recorded; -1: the batch is no longer running."""
        return int(
            await self._record(
                keys=[self.results_key(batch_id), self.key(batch_id), self.inflight_key(batch_id)],
                args=[index, ("o" if ok else "e") + line, "completed" if ok else "failed", request_id],
            )
        )

    async def recorded_indices(self, batch_id: str) -> set[int]:
        return {int(k) for k in await self.r.hkeys(self.results_key(batch_id))}

    async def results(self, batch_id: str, indices: builtins.list[int]) -> builtins.list[tuple[bool, str] | None]:
        """Recorded lines of ``indices`` as (ok, JSON line), None where none is recorded."""
        if not indices:
            return []
        values = await self.r.hmget(self.results_key(batch_id), indices)
        return [None if v is None else (_s(v)[0] == "o", _s(v)[1:]) for v in values]

    async def mark_inflight(self, batch_id: str, request_id: str, index: int) -> None:
        await self.r.hset(self.inflight_key(batch_id), request_id, index)

    async def take_inflight(self, batch_id: str) -> builtins.list[str]:
        """Queue request ids an earlier owner submitted and never recorded (to cancel them), now forgotten."""
        pipe = self.r.pipeline(transaction=True)
        pipe.hkeys(self.inflight_key(batch_id))
        pipe.delete(self.inflight_key(batch_id))
        ids, _ = await pipe.execute()
        return [_s(i) for i in ids]

    # ----------------------------------------------------------------- lease
    async def acquire(self, batch_id: str, token: str, ttl_s: float) -> bool:
        return bool(await self.r.set(self.lease_key(batch_id), token, nx=True, px=int(ttl_s * 1000)))

    async def renew(self, batch_id: str, token: str, ttl_s: float) -> bool:
        return bool(await self._renew(keys=[self.lease_key(batch_id)], args=[token, int(ttl_s * 1000)]))

    async def release(self, batch_id: str, token: str) -> None:
        await self._release(keys=[self.lease_key(batch_id)], args=[token])
