"""Stopping asyncio tasks that talk to Redis, without hanging.

A cancellation that lands while redis-py (asyncio) is inside a command is not always delivered as
``CancelledError``: it can come out as a ``ConnectionError``/``TimeoutError`` (which a retry loop catches
and then goes on forever), and the command's cleanup can itself wait without bound. Seen here with
redis-py 5.2, 6.4, 7.4 and 8.1 on Python 3.11: a task cancelled at a random point of a pipeline + MGET loop
did not end within a second in 2-6 % of a few hundred to 3,000 tries (some came back as ConnectionError,
some were still waiting after 10 s). So:

- background loops stop cooperatively (a flag or an event they check between commands), and are cancelled
  only as a fallback, with a bounded wait (``finish``);
- a loop that retries on Redis errors calls ``raise_if_cancelling`` in its handler, so a cancellation that
  arrived disguised as a Redis error still ends it.
"""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("kernellab.queue")


def raise_if_cancelling() -> None:
    """Re-raise a cancellation of the current task that arrived as another exception."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def finish(tasks, timeout: float, what: str) -> None:
    """Wait up to ``timeout`` for ``tasks`` (stopping by themselves), then cancel the rest and wait one more
    second; a task still running after that is left behind with a warning, never waited on forever."""
    tasks = {t for t in tasks if t is not None}
    pending = {t for t in tasks if not t.done()}
    if pending and timeout > 0:
        _done, pending = await asyncio.wait(pending, timeout=timeout)
    if pending:
        for t in pending:
            t.cancel()
        _done, pending = await asyncio.wait(pending, timeout=1.0)
    for t in tasks - pending:  # retrieved here, so asyncio does not report it again as "never retrieved"
        if not t.cancelled() and t.exception() is not None:
            log.warning("%s: a task ended with %r", what, t.exception())
    if pending:
        log.warning("%s: %d task(s) did not stop; leaving them", what, len(pending))


def run(coro, *, what: str = "event loop"):
    """``asyncio.run`` for a process that must not hang at the end: tasks still running when ``coro``
    returns are cancelled and given a bounded time (``finish``), where ``asyncio.run`` waits for them
    without bound."""
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        try:
            leftover = asyncio.all_tasks(loop)
            if leftover:
                loop.run_until_complete(finish(leftover, timeout=0.0, what=what))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            loop.close()
