"""One batch, run to its end by whichever job holds its lease: validate → in_progress → finalizing → done.

Invariants:
- One owner at a time: a job runs a batch only while it holds the batch's lease (renewed every third of
  its TTL). A redelivered job whose predecessor is alive finds the lease taken and is retried later; one
  whose predecessor died takes the lease once it expires.
- Resumable: the progress is the set of recorded lines (``BatchStore.record``); a new owner skips them,
  cancels the queue requests its predecessor left in flight, and runs the rest. Lines are recorded at most
  once, so the output has no duplicate and, once every line is recorded, no gap.
- Deterministic output: the output and error files list lines in input order, whatever order they finished
  in; their ids derive from the batch id, so a redelivered finalization rewrites the same files.
- Cancel: the API moves the batch to ``cancelling``; the owner notices within ``POLL_S``, submits nothing
  more, aborts what is in flight, and writes what finished. Expiry: lines not finished by ``expires_at``
  are written to the error file as ``batch_expired``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
import uuid
from collections.abc import Callable

from kernellab.services.batch import lines as L
from kernellab.services.batch.files import FileStore
from kernellab.services.batch.runner import LineRunner, Outcome
from kernellab.services.batch.settings import BatchSettings
from kernellab.services.batch.store import RUNNING, TERMINAL, BatchStore
from kernellab.services.gateway.router import REDIS_DOWN
from kernellab.services.queue.aio import raise_if_cancelling

log = logging.getLogger("kernellab.batch")

POLL_S = 0.5  # how often the owner looks for a cancel, its expiry, and renews its lease
_READ_CHUNK = 1000


def output_file_id(batch_id: str, kind: str) -> str:
    return "file-" + hashlib.sha256(f"{batch_id}:{kind}".encode()).hexdigest()[:24]


class BatchJob:
    """``run(batch_id)`` → "done" | "busy" (another owner holds the lease) | "handed_back" (shutdown) |
    "lost" (the lease was taken over) | "missing" (no such batch)."""

    def __init__(
        self,
        settings: BatchSettings,
        store: BatchStore,
        files: FileStore,
        executor_factory: Callable,
        *,
        should_stop: Callable[[], bool] = lambda: False,
    ):
        self.settings = settings
        self.store = store
        self.files = files
        self.executor_factory = executor_factory  # (deadline_s) → async context manager yielding an Executor
        self.should_stop = should_stop  # the worker is shutting down: hand the batch back
        self.token = uuid.uuid4().hex

    async def run(self, batch_id: str) -> str:
        fields = await self.store.fields(batch_id)
        if fields is None:
            log.warning("batch %s does not exist (deleted?); nothing to do", batch_id)
            return "missing"
        if fields["status"] in TERMINAL:
            return "done"
        ttl = self.settings.batch_lease_ttl_s
        if not await self.store.acquire(batch_id, self.token, ttl):
            return "busy"
        try:
            return await self._run(batch_id)
        finally:
            await self.store.release(batch_id, self.token)

    async def _held_fields(self, batch_id: str) -> dict[str, str]:
        """The batch's hash, read while this job holds its lease: only Redis losing its data removes it."""
        fields = await self.store.fields(batch_id)
        if fields is None:
            raise RuntimeError(f"batch {batch_id} vanished while its job held the lease (Redis lost its data?)")
        return fields

    async def _run(self, batch_id: str) -> str:
        fields = await self._held_fields(batch_id)
        status = fields["status"]
        if status == "validating":
            status = await self._validate(batch_id, fields)
            if status in TERMINAL:
                return "done"
            fields = await self._held_fields(batch_id)
        if status == "in_progress":
            reason = await self._run_lines(batch_id, fields)
            if reason in ("handed_back", "lost"):
                return reason
            if reason == "expired":
                await self._expire_unfinished(batch_id, fields)
            ok, status = await self.store.transition(
                batch_id, ("in_progress",), "finalizing", finalizing_at=int(time.time()), final_status=reason
            )
            if ok:
                status = "finalizing"
        fields = await self._held_fields(batch_id)
        if status == "finalizing":
            final = fields.get("final_status") or "completed"
            errors = None
            if final == "failed":
                errors = {
                    "object": "list",
                    "data": [
                        {
                            "code": "invalid_input_file",
                            "line": None,
                            "param": None,
                            "message": "the input file was deleted while the batch ran",
                        }
                    ],
                }
            await self._finalize(batch_id, fields, ("finalizing",), final, errors)
        elif status == "cancelling":
            await self._finalize(batch_id, fields, ("cancelling",), "cancelled")
        return "done"

    # ----------------------------------------------------------------- validating
    async def _validate(self, batch_id: str, fields: dict) -> str:
        """File-level checks; the lines themselves are checked one by one while the batch runs."""
        file_id = fields["input_file_id"]
        meta = self.files.get(file_id)
        path = self.files.content_path(file_id)
        error: dict | None = None
        if meta is None or path is None:
            error = {
                "code": "invalid_input_file",
                "message": f"input file {file_id!r} no longer exists",
                "param": "input_file_id",
                "line": None,
            }
        elif meta.get("purpose") != "batch":
            error = {
                "code": "invalid_input_file",
                "message": f"input file {file_id!r} has purpose {meta.get('purpose')!r}, not 'batch'",
                "param": "input_file_id",
                "line": None,
            }
        else:
            total = await asyncio.to_thread(L.count_lines, path)
            if total == 0:
                error = {"code": "empty_file", "message": "the input file has no requests", "param": None, "line": None}
            elif total > self.settings.batch_max_lines:
                error = {
                    "code": "too_many_requests",
                    "message": f"the input file has {total} requests; the limit is {self.settings.batch_max_lines}",
                    "param": None,
                    "line": None,
                }
        now = int(time.time())
        if error is not None:
            ok, status = await self.store.transition(
                batch_id, ("validating",), "failed", failed_at=now, errors={"object": "list", "data": [error]}
            )
            log.info("batch %s failed validation: %s", batch_id, error["message"])
            return "failed" if ok else status
        ok, status = await self.store.transition(
            batch_id, ("validating",), "in_progress", in_progress_at=now, total=total
        )
        return "in_progress" if ok else status

    # ----------------------------------------------------------------- in_progress
    async def _run_lines(self, batch_id: str, fields: dict) -> str:
        """Runs until every line is recorded ("completed") or a stop: "cancelled", "expired",
        "handed_back" (the worker shuts down) or "lost" (another owner took the lease)."""
        path = self.files.content_path(fields["input_file_id"])
        expires_at = float(fields["expires_at"])
        stop = asyncio.Event()
        reason: dict[str, str | None] = {"why": None}

        def halt(why: str) -> None:
            if reason["why"] is None:
                reason["why"] = why
            stop.set()

        if path is None:  # deleted after validation: nothing more can run; what was recorded is kept
            log.error("batch %s: its input file is gone; finishing with what was recorded", batch_id)
            return "failed"

        async def watch() -> None:
            ttl = self.settings.batch_lease_ttl_s
            renewed = time.monotonic()
            while not stop.is_set():
                try:
                    if time.monotonic() - renewed >= ttl / 3:
                        if not await self.store.renew(batch_id, self.token, ttl):
                            halt("lost")
                        renewed = time.monotonic()
                    status = await self.store.status(batch_id)
                except REDIS_DOWN as exc:  # a blip: the lines wait on Redis too; look again shortly
                    raise_if_cancelling()
                    log.warning("batch %s: cannot reach Redis: %s", batch_id, exc)
                    status = "in_progress"
                if status == "cancelling":
                    halt("cancelled")
                elif status not in RUNNING:
                    halt("lost")
                elif time.time() >= expires_at:
                    halt("expired")
                elif self.should_stop():
                    halt("handed_back")
                await asyncio.sleep(POLL_S)

        async def record(o: Outcome) -> None:
            if await self.store.record(batch_id, o.index, L.dumps(o.line), o.ok, o.request_id) < 0:
                halt("lost")

        async def on_submit(request_id: str, index: int) -> None:
            await self.store.mark_inflight(batch_id, request_id, index)

        watcher = asyncio.create_task(watch())
        try:
            async with self.executor_factory(expires_at - time.time()) as executor:
                for request_id in await self.store.take_inflight(batch_id):
                    await executor.cancel(request_id)
                passes = 0
                while not stop.is_set():
                    done = await self.store.recorded_indices(batch_id)
                    if len(done) >= int(fields["total"]):
                        halt("completed")
                        break
                    if passes:  # lines left unrecorded by the last pass (a deadline): not in a hot loop
                        await asyncio.sleep(POLL_S)
                    elif done:
                        log.info(
                            "batch %s: resuming with %d of %s lines recorded", batch_id, len(done), fields["total"]
                        )
                    passes += 1
                    runner = LineRunner(
                        executor,
                        record,
                        concurrency=self.settings.batch_concurrency,
                        max_n=self.settings.max_n,
                        stop=stop,
                        on_submit=on_submit,
                    )
                    await runner.run(L.iter_input(path), skip=done)
        finally:
            stop.set()
            await watcher
        why = reason["why"]
        assert why is not None, "the loop above ends only through halt(), which sets why"
        return why

    async def _expire_unfinished(self, batch_id: str, fields: dict) -> None:
        path = self.files.content_path(fields["input_file_id"])
        done = await self.store.recorded_indices(batch_id)
        if path is None:
            return
        for line in L.iter_input(path):
            if line.index not in done:
                error = line.error or L.EXPIRED
                await self.store.record(
                    batch_id, line.index, L.dumps(L.envelope_error_line(line.custom_id, error)), False
                )

    # ----------------------------------------------------------------- finalizing
    async def _finalize(
        self, batch_id: str, fields: dict, allowed: tuple[str, ...], final: str, errors: dict | None = None
    ) -> None:
        total = int(fields.get("total") or 0)
        ok_lines: list[str] = []
        error_lines: list[str] = []
        for start in range(0, total, _READ_CHUNK):
            indices = list(range(start, min(total, start + _READ_CHUNK)))
            for result in await self.store.results(batch_id, indices):
                if result is not None:
                    (ok_lines if result[0] else error_lines).append(result[1])
        out_id = err_id = None
        if ok_lines:
            out_id = output_file_id(batch_id, "output")
            await asyncio.to_thread(
                self.files.save_output, out_id, f"{batch_id}_output.jsonl", ok_lines, owner=fields.get("owner", "")
            )
        if error_lines:
            err_id = output_file_id(batch_id, "error")
            await asyncio.to_thread(
                self.files.save_output, err_id, f"{batch_id}_error.jsonl", error_lines, owner=fields.get("owner", "")
            )
        now = int(time.time())
        ok, status = await self.store.transition(
            batch_id,
            allowed,
            final,
            delete_progress=True,
            output_file_id=out_id,
            error_file_id=err_id,
            completed=len(ok_lines),
            failed=len(error_lines),
            usage=_usage(ok_lines),
            **{f"{final}_at": now},
            **({"errors": errors} if errors else {}),
        )
        if ok:
            log.info(
                "batch %s %s: %d completed, %d failed of %d", batch_id, final, len(ok_lines), len(error_lines), total
            )
        else:
            log.warning("batch %s: could not move to %s from %s", batch_id, final, status)


def _usage(ok_lines: list[str]) -> dict:
    """The batch's token usage (OpenAI's batch ``usage``): the sum over its successful lines."""
    prompt = completion = cached = 0
    for line in ok_lines:
        u = json.loads(line)["response"]["body"].get("usage") or {}
        prompt += u.get("prompt_tokens", 0)
        completion += u.get("completion_tokens", 0)
        cached += (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }
