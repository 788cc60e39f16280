"""Cancelling a running batch, and a batch worker killed with -9 in the middle of one."""

from __future__ import annotations

import time

import pytest
import redis

from tests.support.batch import (
    body_text,
    file_lines,
    mixed_lines,
    reference_texts,
    start_batch,
    wait_batch,
    write_jsonl,
)
from tests.support.stack import MODEL, metric, wait_for

pytestmark = pytest.mark.integration

CONCURRENCY = 8  # KERNELLAB_BATCH_CONCURRENCY's default: lines of a batch in the request queue at once


def batch_stream(batch_stack):
    r = redis.Redis.from_url(batch_stack.stack.env["KERNELLAB_REDIS_URL"])
    return r, f"{batch_stack.prefix}req:{MODEL}:batch"


def test_cancel_mid_batch_keeps_finished_lines_and_never_runs_queued_ones(batch_stack, client, offline_llm, tmp_path):
    r, stream = batch_stream(batch_stack)
    before = r.xlen(stream)
    lines = mixed_lines(60, max_tokens=16, tag="cancel")
    created = start_batch(client, write_jsonl(tmp_path / "in.jsonl", lines))
    wait_batch(client, created.id, until=lambda b: b.request_counts.completed >= 3, timeout=180)

    cancelling = client.batches.cancel(created.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at
    b = wait_batch(client, created.id, timeout=60)
    assert b.status == "cancelled" and b.cancelled_at and b.completed_at is None

    out = file_lines(client, b.output_file_id)
    n = len(out)
    assert 3 <= n == b.request_counts.completed < 60 and b.request_counts.failed == 0
    index = {x["custom_id"]: i for i, x in enumerate(lines)}
    positions = [index[x["custom_id"]] for x in out]
    assert positions == sorted(set(positions))  # input order, no duplicate
    finished = [lines[i] for i in positions]
    for line, ref in zip(out, reference_texts(offline_llm, finished), strict=True):
        assert body_text(line) == ref.text

    # Queued lines never reached the request queue; what was in flight was aborted on the worker.
    submitted = r.xlen(stream) - before
    assert submitted <= n + CONCURRENCY and submitted < len(lines)
    wait_for(
        lambda: metric(batch_stack.stack.worker_metrics(0), "kernellab:num_requests_running") == 0,
        10,
        "the worker to drop the cancelled batch's requests",
    )
    time.sleep(1.0)
    assert r.xlen(stream) - before == submitted


def test_batch_worker_killed_with_minus_9_mid_batch_completes_after_redelivery(
    batch_stack, client, offline_llm, tmp_path
):
    lines = mixed_lines(40, max_tokens=12, tag="kill")
    created = start_batch(client, write_jsonl(tmp_path / "in.jsonl", lines))
    wait_batch(client, created.id, until=lambda b: b.request_counts.completed >= 8, timeout=180)
    batch_stack.kill_batch_worker()
    at_kill = client.batches.retrieve(created.id)
    assert at_kill.status == "in_progress" and at_kill.request_counts.completed < 40
    time.sleep(1.0)
    assert client.batches.retrieve(created.id).request_counts.completed == at_kill.request_counts.completed

    batch_stack.start_batch_worker()  # a fresh worker; the message comes back after the visibility timeout
    b = wait_batch(client, created.id, timeout=240)
    assert b.status == "completed"
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (40, 40, 0)
    out = file_lines(client, b.output_file_id)
    assert [x["custom_id"] for x in out] == [x["custom_id"] for x in lines]  # none missing, none twice
    for line, ref in zip(out, reference_texts(offline_llm, lines), strict=True):
        assert body_text(line) == ref.text
    log = (batch_stack.stack.workdir / f"batch-worker-{batch_stack.batch_workers - 1}.log").read_text()
    assert f"batch {created.id}: resuming with" in log
