"""The gateway's request trace (``KERNELLAB_GATEWAY_TRACE=path``): where a request's time went inside the gateway,
to be joined with the worker's step trace (``services/worker/trace.py``) and a load generator's own times.

One JSON line per request, written when it ends, with ``time.perf_counter()`` times (CLOCK_MONOTONIC on Linux,
the clock of the worker's trace and of the benchmark clients on the same host):

    {"rid": "cmpl-…", "pid": 123, "in": ..., "enq": ..., "sent": ..., "acked": ..., "routed": ..., "first": ...}

``in``: the generation route began (the request's headers and body had arrived); ``enq``: it joined the submit
pipeline (validated, tokenized); ``sent`` / ``acked``: that pipeline went to Redis / Redis answered; ``routed``:
the output router read the request's first message from Redis; ``first``: the stream took its first token (its
SSE event is written next). A time the request never reached is absent. Every gateway process of a tier appends
to the same file: one ``os.write`` per line with ``O_APPEND``, so lines never interleave.
"""

from __future__ import annotations

import json
import logging
import os

log = logging.getLogger("kernellab.gateway")


class RequestTrace:
    """A diagnostic: a failed write (disk full, file gone) turns it off with one warning, never fails a request."""

    def __init__(self, path: str):
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._pid = os.getpid()

    def request(self, request_id: str, stamps: dict[str, float]) -> None:
        if self._fd is None:
            return
        line = {"rid": request_id, "pid": self._pid, **{k: round(v, 6) for k, v in stamps.items() if v is not None}}
        try:
            os.write(self._fd, (json.dumps(line) + "\n").encode())
        except OSError as exc:
            log.warning("gateway trace off: %s", exc)
            self.close()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
