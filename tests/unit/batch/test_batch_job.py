"""The batch job in-process, against a real Redis and a real worker loop around the fake engine (which echoes
its prompt): lines in order, bad lines in the error file, resume without duplicates, cancel, expiry, the
lease, and that the lines go through the batch-priority stream."""

from __future__ import annotations

import asyncio
import io
import json
import time

import pytest
import redis

from kernellab.runtime.request.registry import DEFAULT_CPU_MODEL as MODEL
from kernellab.services.batch.client import QueueExecutor
from kernellab.services.batch.files import FileStore
from kernellab.services.batch.job import BatchJob
from kernellab.services.batch.settings import BatchSettings
from kernellab.services.batch.store import BatchStore, new_batch_id
from kernellab.services.gateway.state import redis_client
from kernellab.services.queue import aio
from kernellab.services.queue.keys import Keys
from kernellab.services.queue.protocol import CancelMessage, RequestMessage, from_entry


def chat(cid: str, text: str, max_tokens: int = 3, **body) -> dict:
    return {
        "custom_id": cid,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, **body},
    }


def completion(cid: str, text: str, max_tokens: int = 3, **body) -> dict:
    return {
        "custom_id": cid,
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": MODEL, "prompt": text, "max_tokens": max_tokens, **body},
    }


class Harness:
    def __init__(self, redis_url, prefix, tmp_path, tokenizer, **settings):
        self.settings = BatchSettings(
            redis_url=redis_url,
            key_prefix=prefix,
            model=MODEL,
            files_dir=str(tmp_path / "files"),
            batch_concurrency=4,
            batch_lease_ttl_s=2.0,
            **settings,
        )
        self.files = FileStore(self.settings.files_path)
        self.tokenizer = tokenizer
        self.keys = Keys(prefix, MODEL)
        self.r = redis.Redis.from_url(redis_url)
        self.prefix = prefix

    def create(self, lines: list, expires_in_s: int = 3600) -> str:
        data = "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()
        meta = self.files.save_upload(io.BytesIO(data), "in.jsonl", max_bytes=1 << 20, max_lines=1000)
        batch_id = new_batch_id()

        async def body(store):
            await store.create(
                batch_id,
                endpoint="/v1/chat/completions",
                input_file_id=meta["id"],
                completion_window="24h",
                expires_in_s=expires_in_s,
                metadata=None,
                model=MODEL,
            )

        self.call(body)
        return batch_id

    def call(self, body):
        return asyncio.run(self.acall(body))

    async def acall(self, body):
        client = redis_client(self.settings.redis_url)
        try:
            return await body(BatchStore(client, self.prefix))
        finally:
            await client.aclose()

    def completed(self, batch_id: str) -> int:
        return int(self.r.hget(f"{self.prefix}batch:{batch_id}", "completed") or 0)

    async def run_async(self, batch_id: str, should_stop=lambda: False, during=None) -> str:
        client = redis_client(self.settings.redis_url)
        try:
            job = BatchJob(
                self.settings,
                BatchStore(client, self.prefix),
                self.files,
                lambda deadline_s: QueueExecutor(self.settings, self.tokenizer, MODEL, 8192, deadline_s=deadline_s),
                should_stop=should_stop,
            )
            task = asyncio.create_task(job.run(batch_id))
            if during is not None:
                await during()
            return await task
        finally:
            await client.aclose()

    def run(self, batch_id: str, **kw) -> str:
        return aio.run(self.run_async(batch_id, **kw))  # as the Celery task runs a job

    def batch(self, batch_id: str) -> dict:
        return self.call(lambda store: store.get(batch_id))

    def file_lines(self, file_id: str | None) -> list[dict]:
        if file_id is None:
            return []
        return [json.loads(x) for x in self.files.content_path(file_id).read_text().splitlines()]

    def submitted(self, priority: str = "batch") -> list[RequestMessage]:
        return [from_entry(f) for _i, f in self.r.xrange(self.keys.requests(priority))]


@pytest.fixture
def harness(redis_url, prefix, tmp_path, tokenizer):
    return Harness(redis_url, prefix, tmp_path, tokenizer)


def test_mixed_batch_in_order_with_bad_lines_in_the_error_file(harness, engine_worker, tokenizer):
    engine_worker()
    lines = [
        chat("c0", "Hello there"),
        completion("p1", "The quick brown fox", 4),
        "{broken json",
        completion("p1", "duplicate id"),
        {"custom_id": "e", "method": "POST", "url": "/v1/embeddings", "body": {}},
        completion("bad-temp", "x", temperature=-1),
        chat("bad-model", "x", model="gpt-9"),
        completion("bad-type", "x", max_tokens="5"),
        chat("stream", "x", stream=True),
        chat("c9", "Good morning", 2, n=2),
    ]
    batch_id = harness.create(lines)
    assert harness.run(batch_id) == "done"
    b = harness.batch(batch_id)
    assert b["status"] == "completed" and b["request_counts"] == {"total": 10, "completed": 3, "failed": 7}
    assert b["in_progress_at"] and b["finalizing_at"] and b["completed_at"] and b["errors"] is None
    out = harness.file_lines(b["output_file_id"])
    assert [x["custom_id"] for x in out] == ["c0", "p1", "c9"]
    # The fake engine echoes the prompt: the body is what the API answers for that request.
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hello there"}])
    assert out[0]["response"]["body"]["choices"][0]["message"]["content"] == tokenizer.decode(prompt[:3])
    assert out[1]["response"]["body"]["choices"][0]["text"] == "The quick brown fox"
    assert out[1]["response"]["body"]["object"] == "text_completion" and out[1]["response"]["status_code"] == 200
    assert len(out[2]["response"]["body"]["choices"]) == 2
    assert b["usage"]["output_tokens"] == 3 + 4 + 2 * 2
    errors = {x["custom_id"]: x for x in harness.file_lines(b["error_file_id"])}
    assert [x["custom_id"] for x in harness.file_lines(b["error_file_id"])] == [
        None,
        "p1",
        "e",
        "bad-temp",
        "bad-model",
        "bad-type",
        "stream",
    ]
    assert errors[None]["error"]["code"] == "invalid_json_line" and errors[None]["response"] is None
    assert errors["p1"]["error"]["code"] == "duplicate_custom_id"
    assert errors["e"]["error"]["code"] == "invalid_url"
    status = {
        k: (v["response"]["status_code"], v["response"]["body"]["error"]["param"])
        for k, v in errors.items()
        if v["response"]
    }
    assert status == {
        "bad-temp": (400, "temperature"),
        "bad-model": (404, "model"),
        "bad-type": (400, "max_tokens"),
        "stream": (400, "stream"),
    }
    # Only the runnable lines reached the queue, on the batch stream at batch priority (one per choice).
    sent = harness.submitted()
    assert len(sent) == 4 and {m.priority for m in sent} == {"batch"} and harness.submitted("interactive") == []
    # Progress keys are gone, the lease released.
    assert not harness.r.keys(f"{harness.prefix}batch:{batch_id}:*")


def test_a_redelivered_job_resumes_without_duplicates(harness, engine_worker):
    engine_worker()
    lines = [completion(f"r{i}", f"prompt number {i}") for i in range(8)]
    batch_id = harness.create(lines)

    async def earlier_owner(store):  # validated, ran lines 0-2, died with line 3 in flight
        await store.transition(batch_id, ("validating",), "in_progress", total=8, in_progress_at=int(time.time()))
        for i in range(3):
            body = {"usage": {"prompt_tokens": 3, "completion_tokens": 3}}
            await store.record(
                batch_id,
                i,
                json.dumps(
                    {
                        "custom_id": f"r{i}",
                        "from": "earlier owner",
                        "error": None,
                        "response": {"status_code": 200, "body": body},
                    }
                ),
                True,
            )
        await store.mark_inflight(batch_id, "cmpl-orphan", 3)

    harness.call(earlier_owner)
    assert harness.run(batch_id) == "done"
    b = harness.batch(batch_id)
    out = harness.file_lines(b["output_file_id"])
    assert [x["custom_id"] for x in out] == [f"r{i}" for i in range(8)]
    assert [x.get("from") for x in out[:3]] == ["earlier owner"] * 3 and "from" not in out[3]
    assert b["request_counts"] == {"total": 8, "completed": 8, "failed": 0}
    assert len(harness.submitted()) == 5  # only the lines not recorded
    cancels = [from_entry(f) for _i, f in harness.r.xrange(harness.keys.cancel)]
    assert any(isinstance(c, CancelMessage) and c.request_id == "cmpl-orphan" for c in cancels)


def test_cancel_keeps_finished_lines_and_never_submits_the_rest(harness, engine_worker):
    engine_worker(step_s=0.02)
    batch_id = harness.create([completion(f"r{i}", f"prompt number {i}", 10) for i in range(40)])

    async def cancel_after_some():
        while harness.completed(batch_id) < 3:
            await asyncio.sleep(0.02)
        await harness.acall(lambda store: store.transition(batch_id, ("in_progress",), "cancelling", cancelling_at=1))

    assert aio.run(harness.run_async(batch_id, during=cancel_after_some)) == "done"
    b = harness.batch(batch_id)
    out = harness.file_lines(b["output_file_id"])
    assert b["status"] == "cancelled" and b["cancelled_at"] and b["cancelling_at"] == 1
    assert 3 <= len(out) == b["request_counts"]["completed"] < 40 and b["error_file_id"] is None
    assert [x["custom_id"] for x in out] == sorted((x["custom_id"] for x in out), key=lambda c: int(c[1:]))
    submitted = len(harness.submitted())
    assert submitted <= len(out) + harness.settings.batch_concurrency  # what ran, and what was in flight
    time.sleep(0.3)
    assert len(harness.submitted()) == submitted


def test_expiry_writes_unfinished_lines_as_batch_expired(harness, engine_worker):
    engine_worker(step_s=0.05)
    batch_id = harness.create(
        [completion(f"r{i}", f"prompt number {i}", 20) for i in range(12)] + ["{bad"], expires_in_s=1
    )
    assert harness.run(batch_id) == "done"
    b = harness.batch(batch_id)
    assert b["status"] == "expired" and b["expired_at"]
    errors = harness.file_lines(b["error_file_id"])
    codes = [x["error"]["code"] for x in errors]
    assert codes.count("batch_expired") >= 1 and codes[-1] == "invalid_json_line"
    assert b["request_counts"]["completed"] + b["request_counts"]["failed"] == 13


def test_a_held_lease_makes_the_job_busy_and_shutdown_hands_it_back(harness, engine_worker):
    engine_worker(step_s=0.02)
    batch_id = harness.create([completion(f"r{i}", f"prompt number {i}", 10) for i in range(20)])
    harness.call(lambda store: store.acquire(batch_id, "someone-else", 2.0))
    assert harness.run(batch_id) == "busy"
    harness.r.delete(f"{harness.prefix}batch:{batch_id}:lease")
    stopping = {"now": False}

    async def stop_soon():
        await asyncio.sleep(0.3)
        stopping["now"] = True

    assert aio.run(harness.run_async(batch_id, should_stop=lambda: stopping["now"], during=stop_soon)) == "handed_back"
    b = harness.batch(batch_id)
    assert b["status"] == "in_progress" and b["request_counts"]["completed"] < 20
    assert not harness.r.exists(f"{harness.prefix}batch:{batch_id}:lease")
    assert harness.run(batch_id) == "done"  # the next owner finishes it
    out = harness.file_lines(harness.batch(batch_id)["output_file_id"])
    assert [x["custom_id"] for x in out] == [f"r{i}" for i in range(20)]


def test_a_missing_input_file_fails_validation(harness):
    batch_id = harness.create([completion("a", "x")])
    harness.files.delete(harness.batch(batch_id)["input_file_id"])
    assert harness.run(batch_id) == "done"
    b = harness.batch(batch_id)
    assert b["status"] == "failed" and b["failed_at"]
    assert b["errors"]["data"][0]["code"] == "invalid_input_file"


def test_lines_wait_for_a_worker_instead_of_failing(harness, engine_worker):
    batch_id = harness.create([completion("a", "hello world"), completion("b", "good night")])

    async def start_worker_later():
        await asyncio.sleep(1.0)
        engine_worker()

    assert aio.run(harness.run_async(batch_id, during=start_worker_later)) == "done"
    assert harness.batch(batch_id)["request_counts"] == {"total": 2, "completed": 2, "failed": 0}


def test_an_input_file_deleted_while_running_fails_the_batch_and_keeps_what_finished(harness):
    batch_id = harness.create([completion("a", "x"), completion("b", "y")])

    async def ran_one_line(store):
        await store.transition(batch_id, ("validating",), "in_progress", total=2, in_progress_at=int(time.time()))
        body = {"usage": {"prompt_tokens": 1, "completion_tokens": 1}}
        await store.record(
            batch_id,
            0,
            json.dumps({"custom_id": "a", "error": None, "response": {"status_code": 200, "body": body}}),
            True,
        )

    harness.call(ran_one_line)
    harness.files.delete(harness.batch(batch_id)["input_file_id"])
    assert harness.run(batch_id) == "done"
    b = harness.batch(batch_id)
    assert b["status"] == "failed" and b["failed_at"] and b["errors"]["data"][0]["code"] == "invalid_input_file"
    assert [x["custom_id"] for x in harness.file_lines(b["output_file_id"])] == ["a"]
