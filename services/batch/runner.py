"""Running a batch's lines: shared by the Celery job (through the request queue) and ``kernellab batch``
(an engine in this process). Only the ``Executor`` differs, so both write the same lines.

Per line: the envelope was checked by ``lines.parse_line``; the body goes through the gateway's own
``prepare`` (validation, chat template, tokenization), runs at batch priority, and its response body is
built by the gateway's ``collect``. A request the API would refuse becomes an error line; an outage of
the queue or of every worker is not the line's fault: the line waits and is submitted again.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, replace
from typing import Protocol

from kernellab.runtime.request.errors import InvalidRequestError, KernellabError
from kernellab.services.batch import lines as L
from kernellab.services.gateway.errors import DeadlineExceeded, RateLimited, ServiceUnavailable
from kernellab.services.gateway.requests import Prepared, prepare
from kernellab.services.queue.aio import finish, raise_if_cancelling

log = logging.getLogger("kernellab.batch")

RETRY_BACKOFF_S = (0.25, 0.5, 1.0, 2.0, 5.0)  # waits between submissions of a line while the queue is down


class Executor(Protocol):
    """Runs one prepared request to completion and returns its response body."""

    tokenizer: object
    served_model: str
    max_model_len: int

    async def execute(self, p: Prepared) -> dict:
        """Raises ``KernellabError``: ``ServiceUnavailable``/``RateLimited`` when the line should be retried,
        ``DeadlineExceeded`` when its deadline (the batch's expiry) passed, anything else for the line."""
        ...

    async def cancel(self, request_id: str) -> None:
        """Stop a request submitted earlier (by a previous owner of the batch) if it still runs."""
        ...


@dataclass
class Outcome:
    index: int
    line: dict
    ok: bool
    request_id: str = ""  # the queue request id of the last submission ("" if never submitted)


Record = Callable[[Outcome], Awaitable[None]]


def _prepare(line: L.InputLine, executor: Executor, max_n: int) -> Prepared:
    body = line.body
    assert line.kind is not None  # parse_line sets it on every line without an error, the only ones prepared
    if isinstance(body, dict) and body.get("stream"):
        raise InvalidRequestError("stream is not supported in a batch request", param="stream")
    p = prepare(
        line.kind,
        body,
        executor.tokenizer,
        served_model=executor.served_model,
        max_model_len=executor.max_model_len,
        max_n=max_n,
    )
    p.priority, p.stream, p.include_usage = "batch", False, False
    return p


class LineRunner:
    """Feeds lines to an executor with at most ``concurrency`` in flight; ``stop`` ends it early, aborting
    what is in flight (those lines stay unrecorded)."""

    def __init__(
        self,
        executor: Executor,
        record: Record,
        *,
        concurrency: int,
        max_n: int,
        stop: asyncio.Event | None = None,
        on_submit: Callable[[str, int], Awaitable[None]] | None = None,
    ):
        self.executor = executor
        self.record = record
        self.concurrency = concurrency
        self.max_n = max_n
        self.stop = stop or asyncio.Event()
        self.on_submit = on_submit
        self._slots = asyncio.Semaphore(concurrency)
        self._tasks: set[asyncio.Task] = set()
        self.failure: BaseException | None = None  # an unexpected error of a line task: ends the run, re-raised

    async def run(self, lines: Iterable[L.InputLine], skip: set[int] | frozenset = frozenset()) -> None:
        stopper = asyncio.ensure_future(self.stop.wait())
        try:
            for line in lines:
                if self.stop.is_set():
                    break
                if line.index in skip:
                    continue
                if line.error is not None:
                    await self.record(Outcome(line.index, L.envelope_error_line(line.custom_id, line.error), False))
                    continue
                req_id = L.request_id()
                try:
                    p = _prepare(line, self.executor, self.max_n)
                except KernellabError as exc:
                    await self.record(Outcome(line.index, L.http_error_line(line.custom_id, req_id, exc), False))
                    continue
                if self.failure is not None or not await self._slot(stopper):
                    break
                task = asyncio.create_task(self._one(line, p, req_id))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            while self._tasks and not self.stop.is_set() and self.failure is None:
                await asyncio.wait([*self._tasks, stopper], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
            # Lines in flight are aborted; a task stuck in a Redis command is waited on for a bounded time.
            await finish(list(self._tasks), timeout=0.0, what="batch lines in flight")
        if self.failure is not None:
            raise self.failure

    async def _slot(self, stopper: asyncio.Future) -> bool:
        acquire = asyncio.ensure_future(self._slots.acquire())
        await asyncio.wait([acquire, stopper], return_when=asyncio.FIRST_COMPLETED)
        if acquire.done() and not self.stop.is_set() and self.failure is None:
            return True
        if acquire.done():
            self._slots.release()
        else:
            acquire.cancel()
        return False

    async def _one(self, line: L.InputLine, p: Prepared, req_id: str) -> None:
        try:
            attempt = 0
            while True:
                if self.on_submit is not None:
                    await self.on_submit(p.request_id, line.index)
                try:
                    body = await self.executor.execute(p)
                    outcome = Outcome(line.index, L.success_line(line.custom_id, req_id, body), True, p.request_id)
                    break
                except (ServiceUnavailable, RateLimited) as exc:
                    raise_if_cancelling()  # a cancel that reached Redis mid-command comes back as an outage
                    wait = RETRY_BACKOFF_S[min(attempt, len(RETRY_BACKOFF_S) - 1)]
                    log.warning(
                        "line %d (%s): %s; submitting again in %.2fs", line.index, line.custom_id, exc.message, wait
                    )
                    attempt += 1
                    await asyncio.sleep(wait)
                    # A new id: the old submission may still be cancelling on a worker.
                    p = replace(p, request_id=f"{p.request_id.rsplit('-', 1)[0]}-{uuid.uuid4().hex}")
                except DeadlineExceeded:
                    return  # the batch expired: the job writes the expiry lines
                except KernellabError as exc:
                    outcome = Outcome(line.index, L.http_error_line(line.custom_id, req_id, exc), False, p.request_id)
                    break
            await self.record(outcome)
        except Exception as exc:  # not the line's fault (a bug, Redis gone): stop feeding, let run() raise
            raise_if_cancelling()
            if self.failure is None:
                self.failure = exc
        finally:
            self._slots.release()
