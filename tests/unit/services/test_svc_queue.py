"""Queue semantics against a real Redis: capacity-bounded reads, reclaim with resume, the delivery limit."""

import time

import pytest
import redis

from kernellab.services.queue.broker import WorkerQueue
from kernellab.services.queue.keys import GROUP, Keys
from kernellab.services.queue.protocol import (
    ErrorMessage,
    OutputChunk,
    RequestMessage,
    decode,
    entry,
    from_entry,
)


@pytest.fixture
def setup(redis_url, prefix):
    r = redis.Redis.from_url(redis_url)
    keys = Keys(prefix, "m")
    live = WorkerQueue(r, keys, "live", max_deliveries=3)
    live.ensure_groups()
    return r, keys, live


def enqueue(r, keys, rid, priority="interactive", **kw):
    msg = RequestMessage(rid, 0, "m", [1, 2, 3], {"max_tokens": 5}, priority, **kw)
    r.xadd(keys.requests(priority), entry(msg))
    return msg


def test_reads_respect_counts_and_priorities(setup):
    r, keys, live = setup
    for i in range(3):
        enqueue(r, keys, f"i{i}")
        enqueue(r, keys, f"b{i}", "batch")
    got = live.read(["interactive"], 2, None)
    assert [d.message.request_id for d in got] == ["i0", "i1"]
    got = live.read(["interactive", "batch"], 1, None)  # the count applies to each stream
    assert sorted(d.message.request_id for d in got) == ["b0", "i2"]
    assert all(d.deliveries == 1 and d.emitted is None for d in got)
    assert live.read(["interactive"], 5, None) == []
    assert live.read(["interactive"], 0, None) == []


def test_groups_come_back_after_redis_loses_them(setup):
    r, keys, live = setup
    r.delete(*keys.request_streams)
    assert live.read(["interactive"], 1, None) == []  # NOGROUP → recreated
    enqueue(r, keys, "x")
    assert [d.message.request_id for d in live.read(["interactive"], 1, None)] == ["x"]


def write_chunk(r, keys, seq, tokens, finished=False):
    r.xadd(keys.output("a-0"), entry(OutputChunk("a", 0, seq, tokens, finished=finished)))


def test_reclaim_resumes_from_emitted_tokens_deduplicated(setup):
    r, keys, live = setup
    enqueue(r, keys, "a")
    dead = WorkerQueue(r, keys, "dead")
    [held] = dead.read(["interactive"], 1, None)
    write_chunk(r, keys, 0, [11, 12])
    write_chunk(r, keys, 1, [12, 13])  # a racing duplicate of token 1, then token 2
    write_chunk(r, keys, 3, [14])
    assert live.reclaim(min_idle_ms=10_000, count=5) == []  # not idle long enough
    time.sleep(0.06)
    [d] = live.reclaim(min_idle_ms=50, count=5)
    assert d.entry_id == held.entry_id and d.message.resume and d.deliveries == 2
    assert d.emitted == [11, 12, 13, 14] and not d.finished
    pending = r.xpending_range(keys.requests("interactive"), GROUP, "-", "+", 10)
    assert [p["consumer"] for p in pending] == [b"live"]


def test_refresh_keeps_a_live_workers_entries(setup):
    r, keys, live = setup
    enqueue(r, keys, "a")
    other = WorkerQueue(r, keys, "other")
    [held] = other.read(["interactive"], 1, None)
    for _ in range(3):
        time.sleep(0.04)
        other.refresh({held.stream: [held.entry_id]})
    assert live.reclaim(min_idle_ms=60, count=5) == []
    pending = r.xpending_range(held.stream, GROUP, "-", "+", 10)
    assert pending[0]["times_delivered"] == 1  # refreshing is not a delivery


def test_a_stalled_worker_writes_nothing_for_a_request_reclaimed_from_it(setup):
    r, keys, live = setup
    enqueue(r, keys, "a")
    enqueue(r, keys, "b")
    stalled = WorkerQueue(r, keys, "stalled")
    da, db = stalled.read(["interactive"], 2, None)
    time.sleep(0.03)
    [taken] = live.reclaim(min_idle_ms=20, count=1)  # "a": the oldest; "b" stays the stalled worker's
    assert taken.entry_id == da.entry_id
    stalled.refresh({db.stream: [db.entry_id]})
    out = keys.output("a-0"), keys.output("b-0")
    acked, skipped = stalled.write_owned([(out[0], b"late", da), (out[1], b"mine", db)], [da, db], 60_000)
    assert acked == [False, True] and skipped == 1
    assert r.xlen(out[0]) == 0 and [f[b"m"] for _, f in r.xrange(out[1])] == [b"mine"]
    assert 0 < r.pttl(out[1]) <= 60_000
    pending = r.xpending_range(da.stream, GROUP, "-", "+", 10)
    assert [(p["message_id"], p["consumer"]) for p in pending] == [(da.entry_id.encode(), b"live")]
    assert live.write_owned([(out[0], b"owner", taken)], [taken], 60_000) == ([True], 0)
    assert r.xpending(da.stream, GROUP)["pending"] == 0


def test_finished_output_means_only_the_ack_is_missing(setup):
    r, keys, live = setup
    enqueue(r, keys, "a")
    WorkerQueue(r, keys, "dead").read(["interactive"], 1, None)
    write_chunk(r, keys, 0, [5, 6], finished=True)
    time.sleep(0.03)
    [d] = live.reclaim(min_idle_ms=20, count=1)
    assert d.finished and d.emitted == [5, 6]


def test_poison_request_goes_to_dead_letter_with_a_clean_error(setup):
    r, keys, _ = setup
    live = WorkerQueue(r, keys, "live", max_deliveries=2)
    enqueue(r, keys, "a")
    WorkerQueue(r, keys, "dead1").read(["interactive"], 1, None)
    time.sleep(0.03)
    assert len(WorkerQueue(r, keys, "dead2", max_deliveries=2).reclaim(20, 1)) == 1  # second delivery: allowed
    time.sleep(0.03)
    assert live.reclaim(20, 1) == []  # third: poison
    assert live.dead_lettered == 1
    [(_, fields)] = r.xrange(keys.dead_letter)
    assert from_entry(fields).request_id == "a" and b"reason" in fields
    [(_, out)] = r.xrange(keys.output("a-0"))
    err = from_entry(out)
    assert isinstance(err, ErrorMessage) and err.status == 500 and err.code == "dead_lettered"
    assert r.xpending(keys.requests("interactive"), GROUP)["pending"] == 0


def test_requeue_hands_back_a_resumable_copy(setup):
    r, keys, live = setup
    enqueue(r, keys, "a")
    [d] = live.read(["interactive"], 1, None)
    live.requeue([d])
    assert r.xpending(d.stream, GROUP)["pending"] == 0
    [d2] = WorkerQueue(r, keys, "next").read(["interactive"], 1, None)
    assert d2.message.resume and d2.message.attempt == 1 and d2.emitted == []


def test_heartbeat_and_leave(setup):
    r, keys, live = setup
    from kernellab.services.queue.protocol import Heartbeat, encode

    hb = Heartbeat("live", "m", time.time())
    live.heartbeat(keys.heartbeat("live"), encode(hb), 1000, hb.time)
    assert decode(r.get(keys.heartbeat("live"))) == hb
    assert r.zscore(keys.workers, "live") == pytest.approx(hb.time)
    live.leave(keys.heartbeat("live"))
    assert r.get(keys.heartbeat("live")) is None and r.zscore(keys.workers, "live") is None
