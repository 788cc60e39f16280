"""The worker's request reader in a process of its own (``WorkerSettings.reader_process``).

Why a process: the step loop launches a step's kernels from Python, and every launch lets the GIL go. A request
reader thread in the same process, busy with a burst (the XREADGROUP reply, msgpack, token ids, parameters,
validation: ~35 µs a 512-token request on the CI box, several ms for a burst of 64), takes the GIL at each of those
moments and keeps it up to a switch interval, so the step launching beside it stretched: on the H200 an 8 × 512
first step took 17-23 ms in the worker against ~10.5 ms in the engine alone (docs/deploy.md, "Where the added TTFT
goes"). vLLM's and SGLang's front ends keep such work out of the scheduler's process for the same reason.

Division of work:
- The child (``_child_main``) does all of a request's Redis and Python work that needs no engine: XREADGROUP
  (interactive first, batch capped to its share; no more entries than the worker has room for), decoding, the
  parameters (``SamplingParams.from_dict``) and the engine's checks (``engine.request_limits.check``: token ids,
  context, ``max_tokens``). It hands the results over in small batches through a pipe, token ids packed.
- The parent's pipe thread (``ReaderProcess._receive``) unpacks each (~10 µs a 512-token request on the CI box),
  has the worker build what passed (``engine.prepare_checked``: the sequence, and a grammar or stop-string state
  where the request asks for one) and puts it in the loop's inbox, as the reader thread did.
- Shared counters tell the child how many entries the worker holds (so it reads only what fits) and tell the loop's
  gather whether the child is in the middle of a burst (``reading``).

Faults:
- The child dies with its parent (``PR_SET_PDEATHSIG``, and it checks its parent's pid between reads): a worker
  killed with ``kill -9`` leaves no reader holding entries. What either had read but not finished stays pending
  under the worker's name, and a live worker reclaims it after ``worker_dead_after_s``, as before.
- A child that dies while its parent lives is started again; the entries it had read but not handed over are
  reclaimed the same way (the worker does not refresh entries it never received).
- While Redis is away the child retries every 0.5 s and reports the outage to the parent (metrics, ``/health``).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from kernellab.runtime.request.sampling import SamplingParams
from kernellab.runtime.request.token_ids import pack_token_ids, unpack_token_ids
from kernellab.services.queue.broker import Delivery, WorkerQueue, connect
from kernellab.services.queue.keys import Keys
from kernellab.services.queue.protocol import RequestMessage

log = logging.getLogger("kernellab.worker")

_REDIS_DOWN: tuple[type[Exception], ...] = (redis.ConnectionError, redis.TimeoutError, OSError)
_CONTEXT = multiprocessing.get_context("spawn")  # the parent holds CUDA and threads: never fork it
HANDOVER_BATCH = 16  # records per message to the parent: a burst's first ones reach the loop before the last are read
# Shared counters (int64, one writer each): what the parent holds (all, batch), how many of this child's records it
# has received, whether the child is in the middle of a read.
_HELD, _HELD_BATCH, _RECEIVED, _READING = range(4)


@dataclass(frozen=True)
class ReaderSpec:
    """What the child needs (pickled to it at start)."""

    url: str
    keys: Keys
    worker_id: str
    max_num_seqs: int
    batch_share: float
    max_deliveries: int
    limits: Any  # engine.request_limits: .check(request_id, prompt_token_ids, params, output_token_ids) -> max_tokens
    log_level: str = "INFO"


# A record, as the child packs one delivery: (stream, entry id, deliveries, emitted, finished, received, request_id,
# index, model, prompt bytes, their maximum, params dict, priority, deadline, created, attempt, resume, params or None, max_tokens,
# error or None). The params object is pickled as built (no second validation); the prompt travels as uint32 bytes.


def pack(d: Delivery, received: float, limits) -> tuple:
    m = d.message
    params = max_tokens = error = None
    if not d.finished:
        try:
            params = SamplingParams.from_dict(m.params)
            max_tokens = limits.check(m.engine_id, m.prompt_token_ids, params, d.emitted or ())
        except Exception as exc:  # answered by the loop (worker/loop.py: _add), as the reader thread's were
            params, error = None, exc
    prompt = pack_token_ids(m.prompt_token_ids)
    return (
        d.stream,
        d.entry_id,
        d.deliveries,
        d.emitted,
        d.finished,
        received,
        m.request_id,
        m.index,
        m.model,
        prompt if prompt is not None else list(m.prompt_token_ids),
        getattr(m.prompt_token_ids, "max_id", None),
        m.params,
        m.priority,
        m.deadline,
        m.created,
        m.attempt,
        m.resume,
        params,
        max_tokens,
        error,
    )


def unpack(record: tuple) -> tuple[Delivery, float, SamplingParams | None, int | None, Exception | None]:
    """(delivery, received, params, max_tokens, error): the request as the child read and checked it."""
    (stream, eid, n, emitted, finished, received, rid, index, model, prompt, max_id, pdict, prio, deadline) = record[
        :14
    ]
    created, attempt, resume, params, max_tokens, error = record[14:]
    tokens = unpack_token_ids(prompt, max_id) if isinstance(prompt, bytes) else prompt
    msg = RequestMessage(rid, index, model, tokens, pdict, prio, deadline, created, attempt, resume)
    return Delivery(stream, eid, msg, n, emitted, finished), received, params, max_tokens, error


class ReaderProcess:
    """The parent's handle: starts the child, receives its records (a thread), restarts it if it dies."""

    def __init__(
        self,
        spec: ReaderSpec,
        *,
        hold: Callable[[Delivery], None],
        deliver: Callable[[Delivery, float, SamplingParams | None, int | None, Exception | None], None],
        redis_down: Callable[[str, Exception], None],
        redis_up: Callable[[], None],
    ):
        self.spec = spec
        self.hold, self.deliver, self.redis_down, self.redis_up = hold, deliver, redis_down, redis_up
        self.shared = _CONTEXT.Array("q", 4, lock=False)
        self.accepting = _CONTEXT.Event()
        self.accepting.set()
        self.stopping = _CONTEXT.Event()
        self.busy = False  # the pipe thread is handing records over
        self.starts = 0
        self._proc: Any = None
        self._conn: Any = None
        self._thread: threading.Thread | None = None

    # --------------------------------------------------------------- parent side
    def start(self) -> None:
        self._spawn()
        self._thread = threading.Thread(target=self._receive, name="request-reader-pipe", daemon=True)
        self._thread.start()

    def _spawn(self) -> None:
        recv, send = _CONTEXT.Pipe(duplex=False)
        self.shared[_RECEIVED] = 0
        self._proc = _CONTEXT.Process(
            target=_child_main,
            args=(self.spec, send, self.shared, self.accepting, self.stopping, os.getpid()),
            name=f"kernellab-reader-{self.spec.worker_id}",
            daemon=True,
        )
        self._proc.start()
        send.close()  # the child holds the only write end: EOF here once it is gone
        self._conn = recv
        self.starts += 1

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def reading(self) -> bool:
        return self.busy or bool(self.shared[_READING])

    def publish(self, held: int, held_batch: int) -> None:
        """Holdings changed (called under its lock): the child reads only what the worker has room for."""
        self.shared[_HELD] = held
        self.shared[_HELD_BATCH] = held_batch

    def _receive(self) -> None:
        while True:
            try:
                message = pickle.loads(self._conn.recv_bytes())
            except (EOFError, OSError):
                self.busy = False
                if self.stopping.is_set():
                    return
                code = self._proc.exitcode if self._proc is not None else None
                with contextlib.suppress(Exception):
                    self._proc.join(1.0)
                    code = self._proc.exitcode
                log.error("request reader process exited (code %s); starting another", code)
                time.sleep(0.5)
                if self.stopping.is_set():
                    return
                self._spawn()
                continue
            kind = message[0]
            if kind == "add":
                self.busy = True
                for record in message[1]:
                    d, received, params, max_tokens, error = unpack(record)
                    self.hold(d)
                    self.shared[_RECEIVED] += 1
                    self.deliver(d, received, params, max_tokens, error)
                self.busy = False
            elif kind == "down":
                self.redis_down(message[1], ConnectionError(message[2]))
            elif kind == "up":
                self.redis_up()

    def stop(self, timeout: float = 5.0) -> None:
        self.accepting.clear()
        self.stopping.set()
        proc = self._proc
        if proc is not None:
            proc.join(timeout)
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)
        if self._thread is not None:
            self._thread.join(timeout)


# ------------------------------------------------------------------- the child
def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the parent (thread) that started it goes, however it goes."""
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _child_main(spec: ReaderSpec, conn, shared, accepting, stopping, parent_pid: int) -> None:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the worker drains on SIGINT/SIGTERM; it stops this child itself
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    logging.basicConfig(level=spec.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    handed = 0  # records sent to the parent
    ok: bool | None = None
    q: WorkerQueue | None = None
    limits = spec.limits

    def send(message) -> bool:
        try:
            conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
            return True
        except (BrokenPipeError, EOFError, OSError):
            return False  # the parent is gone

    while not stopping.is_set():
        if os.getppid() != parent_pid:
            return
        if not accepting.is_set():
            shared[_READING] = 0
            stopping.wait(0.1)
            continue
        try:
            q = q or WorkerQueue(
                connect(spec.url, blocking_ms=1000), spec.keys, spec.worker_id, max_deliveries=spec.max_deliveries
            )
            in_flight = handed - shared[_RECEIVED]
            held = shared[_HELD] + in_flight
            room = spec.max_num_seqs - held
            if room <= 0:
                shared[_READING] = 0
                time.sleep(0.002)
                continue
            batch_room = max(0, min(room, int(spec.max_num_seqs * spec.batch_share) - shared[_HELD_BATCH] - in_flight))
            got = q.read(["interactive"], room, None)
            if len(got) < room and batch_room:
                got += q.read(["batch"], min(batch_room, room - len(got)), None)
            if not got:
                shared[_READING] = 0
                got = q.read(["interactive", "batch"] if batch_room else ["interactive"], 1, 1000)
                shared[_READING] = int(bool(got))
            received = time.monotonic()
            if not ok:
                ok = True
                if not send(("up",)):
                    return
            for i in range(0, len(got), HANDOVER_BATCH):
                records = [pack(d, received, limits) for d in got[i : i + HANDOVER_BATCH]]
                if not send(("add", records)):
                    return
                handed += len(records)
        except _REDIS_DOWN as exc:
            shared[_READING] = 0
            ok = False
            if not send(("down", "read", str(exc))):
                return
            q = None
            stopping.wait(0.5)
    shared[_READING] = 0
