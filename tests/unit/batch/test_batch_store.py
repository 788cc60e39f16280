"""Batch state in a real Redis: compare-and-set transitions, lines recorded once, the lease, listing."""

from __future__ import annotations

import asyncio
import json

import redis

from kernellab.services.batch.store import BatchStore, new_batch_id
from kernellab.services.gateway.state import redis_client


def run(redis_url, prefix, body):
    async def main():
        client = redis_client(redis_url)
        try:
            return await body(BatchStore(client, prefix))
        finally:
            await client.aclose()

    return asyncio.run(main())


async def make(store, **kw) -> str:
    batch_id = new_batch_id()
    await store.create(
        batch_id,
        endpoint="/v1/chat/completions",
        input_file_id="file-x",
        completion_window="24h",
        expires_in_s=3600,
        metadata=kw.get("metadata"),
        model="m",
    )
    return batch_id


def test_create_and_openai_shape(redis_url, prefix):
    async def body(store):
        batch_id = await make(store, metadata={"k": "v"})
        return await store.get(batch_id)

    b = run(redis_url, prefix, body)
    assert b["object"] == "batch" and b["status"] == "validating" and b["metadata"] == {"k": "v"}
    assert b["request_counts"] == {"total": 0, "completed": 0, "failed": 0}
    assert b["expires_at"] - b["created_at"] == 3600 and b["in_progress_at"] is None and b["output_file_id"] is None
    assert b["errors"] is None and b["usage"] is None


def test_transitions_are_compare_and_set(redis_url, prefix):
    async def body(store):
        batch_id = await make(store)
        steps = [
            await store.transition(batch_id, ("validating",), "in_progress", in_progress_at=5, total=3),
            await store.transition(batch_id, ("validating", "in_progress"), "cancelling", cancelling_at=6),
            await store.transition(batch_id, ("in_progress",), "finalizing"),  # the cancel won
            await store.transition("batch_missing", ("validating",), "cancelling"),
        ]
        return steps, await store.get(batch_id)

    steps, b = run(redis_url, prefix, body)
    assert steps == [(True, "validating"), (True, "in_progress"), (False, "cancelling"), (False, "")]
    assert b["status"] == "cancelling" and b["in_progress_at"] == 5 and b["cancelling_at"] == 6
    assert b["request_counts"]["total"] == 3


def test_lines_are_recorded_once_and_counted_with_them(redis_url, prefix):
    async def body(store):
        batch_id = await make(store)
        before = await store.record(batch_id, 0, "{}", True)  # not running yet: refused
        await store.transition(batch_id, ("validating",), "in_progress", total=3)
        await store.mark_inflight(batch_id, "cmpl-1", 0)
        await store.mark_inflight(batch_id, "cmpl-2", 1)
        got = [
            await store.record(batch_id, 0, '{"n":0}', True, "cmpl-1"),
            await store.record(batch_id, 0, '{"n":"again"}', True),  # a redelivered job's duplicate
            await store.record(batch_id, 2, '{"n":2}', False),
        ]
        results = await store.results(batch_id, [0, 1, 2])
        inflight = await store.take_inflight(batch_id)
        done = await store.recorded_indices(batch_id)
        await store.transition(batch_id, ("in_progress",), "completed", delete_progress=True)
        after = await store.record(batch_id, 1, "{}", True)
        return before, got, results, inflight, done, after, await store.get(batch_id)

    before, got, results, inflight, done, after, b = run(redis_url, prefix, body)
    assert (
        before == after == -1 and got == [1, 0, 1] and b["request_counts"] == {"total": 3, "completed": 1, "failed": 1}
    )
    assert results == [(True, '{"n":0}'), None, (False, '{"n":2}')]
    assert inflight == ["cmpl-2"] and done == {0, 2}
    r = redis.Redis.from_url(redis_url)
    assert not r.exists(f"{prefix}batch:{b['id']}:results") and not r.exists(f"{prefix}batch:{b['id']}:inflight")


def test_lease(redis_url, prefix):
    async def body(store):
        return [
            await store.acquire("b1", "owner-1", 5),
            await store.acquire("b1", "owner-2", 5),
            await store.renew("b1", "owner-2", 5),
            await store.renew("b1", "owner-1", 5),
            await store.release("b1", "owner-2"),
            await store.acquire("b1", "owner-2", 5),
            await store.release("b1", "owner-1"),
            await store.acquire("b1", "owner-2", 5),
        ]

    assert run(redis_url, prefix, body) == [True, False, False, True, None, False, None, True]


def test_list_is_newest_first_with_a_cursor(redis_url, prefix):
    async def body(store):
        ids = [await make(store) for _ in range(5)]
        page1, more1 = await store.list(None, 2)
        page2, more2 = await store.list(page1[-1]["id"], 2)
        page3, more3 = await store.list(page2[-1]["id"], 2)
        unknown = await store.list("batch_unknown", 2)
        return ids, [b["id"] for b in page1 + page2 + page3], (more1, more2, more3), unknown

    ids, listed, more, unknown = run(redis_url, prefix, body)
    assert listed == ids[::-1] and more == (True, True, False) and unknown == ([], False)
    assert json.dumps(listed)
