"""One thread owns the engine; async jobs talk to it through queues, so concurrent jobs batch together.

``LLMEngine`` is synchronous: ``step()`` runs one batch on the device. The RunPod SDK runs every job as a
coroutine on one event loop, so the engine cannot be stepped from the jobs themselves (each step would block
every other job, and two jobs would race on the engine). Instead:

    job coroutine ──submit/abort──▶ command queue ──▶ engine thread: add/abort, step(), step(), ...
    job coroutine ◀──asyncio.Queue (call_soon_threadsafe)── RequestOutput per step ◀──┘

Invariants: only the engine thread touches the engine after ``start()``; a request's queue receives
``RequestOutput`` objects until one has ``finished=True``, or a single exception, and nothing after that.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("kernellab.runpod")

# Messages of errors after which the CUDA context is unusable: the process must go.
_CUDA_FAULT_MARKERS = (
    "CUDA error",
    "CUDA-capable device",
    "cudaError",
    "CUBLAS_STATUS",
    "CUDNN_STATUS",
    "illegal memory access",
    "device-side assert",
    "unspecified launch failure",
    "uncorrectable ECC error",
    "NCCL error",
)


def is_cuda_fault(error: BaseException) -> bool:
    """True for a device fault (sticky: later CUDA calls fail too); False for out-of-memory and host errors.

    torch raises ``torch.AcceleratorError`` (a RuntimeError) for CUDA runtime errors; older releases raise a
    plain RuntimeError. Both carry the CUDA error text, so the message decides.
    """
    if type(error).__name__ == "OutOfMemoryError" or "out of memory" in str(error):
        return False
    return type(error).__name__ == "AcceleratorError" or any(m in str(error) for m in _CUDA_FAULT_MARKERS)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item) -> None:
        # RuntimeError: the job's event loop has closed, nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class EngineLoop:
    def __init__(self, engine, on_fatal: Callable[[BaseException], None], idle_wait_s: float = 0.5):
        self._engine = engine
        self._on_fatal = on_fatal
        self._idle_wait_s = idle_wait_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kernellab-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(("wake",))
        self._thread.join(timeout)

    # ---- called from job coroutines (the event loop's thread)
    def submit(self, request_id: str, prompt_token_ids: list[int], params) -> asyncio.Queue:
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._commands.put(("add", request_id, prompt_token_ids, params, stream))
        return stream.queue

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    # ---- the engine thread
    def _run(self) -> None:
        engine = self._engine
        while not self._stop.is_set():
            self._apply_commands(block=not engine.has_unfinished_requests())
            if not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except Exception as error:  # the step failed for every request in it
                log.exception("engine step failed")
                self._fail_all(error)
                if is_cuda_fault(error):
                    self._on_fatal(error)
                    return
                continue
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is None:
                    continue
                stream.put(output)
                if output.finished:
                    del self._streams[output.request_id]

    def _apply_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=self._idle_wait_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: tuple) -> None:
        if command[0] == "add":
            _, request_id, prompt_token_ids, params, stream = command
            try:
                self._engine.add_request(request_id, prompt_token_ids, params)
            except Exception as error:  # invalid request (context length, ...): only this job fails
                stream.put(error)
                return
            self._streams[request_id] = stream
        elif command[0] == "abort":
            self._engine.abort(command[1])
            self._streams.pop(command[1], None)

    def _fail_all(self, error: BaseException) -> None:
        for request_id, stream in list(self._streams.items()):
            stream.put(error)
            try:
                self._engine.abort(request_id)
            except Exception:  # after a device fault the engine may fail this too; the process is going
                log.debug("abort of %s after a failed step failed", request_id, exc_info=True)
        self._streams.clear()
