"""When other threads of the engine's process may run Python without slowing the engine's step.

A step's host work launches hundreds of kernels, and every PyTorch op lets go of the GIL while it dispatches. A
thread with Python to run (a serving worker's request reader decoding and preparing a burst) takes the GIL at
each of those moments, and the step's thread waits for it back: the launches, and with them the device, fall
behind. Measured on the H200: a worker's first prefill step of 8 × 512 tokens took 16-23 ms while its reader
prepared the rest of a 64-request burst, against ~10.5 ms alone (step traces in
results/gpu/serve_h200_dev/product_e9f7932.json).

The gate lets such a thread run only while that costs the step nothing: when the engine's thread is not in a step
(``IDLE``), or while it waits for the device (``DEVICE``, from the moment the step's work is queued until the
device has done it: a CUDA event recorded at the wait tells). While the step's thread runs host work (``HOST``)
the other thread blocks, GIL released, at its next ``admit``.

The engine's thread: ``host()`` before each step, ``device_wait()`` around each wait for the device's results,
``idle()`` when it next blocks waiting for work (the serving worker keeps its Python between busy steps, emitting
and taking requests in, in ``HOST`` too: a reader running then made the gap between a burst's first two steps
grow from ~1.3 ms to 2-10 ms on the H200). Another thread: ``admit()`` before each piece of Python work (one
request, say), which returns at once when it may run, or blocks until it may, at most ``timeout`` seconds (then
the rest of that phase's admits pass at once).

Off by default in the serving worker (``reader_yields_to_step``): on the H200 it cut the first step's launch
(8 × 512 tokens: 6-12 ms against 13-18 beside the reader) but the added TTFT p50 moved with how each burst split
into reads, not with the gate (+6.5 / +7.7 / +16.7 ms gated against +5.0 / +11.0 / +9.7 in three A/B runs;
results/gpu/serve_h200_dev/gate_*). In the worker, steps that mix prefill and decode rows launch for longer than
the device computes (device waits of 0.1 ms), so a gated reader gets little time there; alone the engine launches
them in a third of the time with no sync inside (serve_h200_dev/sync_probe_6764c7f.json).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

IDLE, HOST, DEVICE = "idle", "host", "device"


class HostGate:
    def __init__(self, device_done: Callable[[], bool], mark: Callable[[], None] = lambda: None):
        """``mark()`` records where the step's queued device work ends; ``device_done()`` tells whether the
        device has reached that mark (on CUDA: an event's record and query)."""
        self._mark, self._done = mark, device_done
        self._cond = threading.Condition()
        self.state = IDLE
        # State changes: a thread that saw a device wait finish waits for a later phase; an admit() that timed out
        # lets the rest of its phase's admits through (_pass).
        self._phase = 0
        self._pass = -1
        # The last step told (host() to idle()): seconds from its start to its first device wait (None: it had none),
        # and seconds spent in device waits; the worker's step trace records them.
        self.launch_s: float | None = None
        self.wait_s = 0.0
        self._host_at = 0.0
        self.admitted = 0  # admit() calls that returned at once
        self.held = 0  # admit() calls that blocked first
        self.held_s = 0.0  # how long they blocked, in all

    # ----------------------------------------------------------------- the engine's thread
    def _enter(self, state: str) -> None:
        """Caller holds ``_cond``."""
        self.state = state
        self._phase += 1
        if state != HOST:  # what a held thread waits for: a device wait, or idle
            self._cond.notify_all()

    def host(self) -> None:
        with self._cond:
            self._enter(HOST)
            self._host_at = time.monotonic()
            self.launch_s, self.wait_s = None, 0.0

    def idle(self) -> None:
        with self._cond:
            self._enter(IDLE)

    @contextlib.contextmanager
    def device_wait(self) -> Iterator[None]:
        """Around a wait for the device's results (a ``.tolist()`` of sampled tokens) inside ``host()``."""
        if self.state == IDLE:  # not a step the gate is told about (offline generate, warm-up): nothing to do
            yield
            return
        self._mark()
        t0 = time.monotonic()
        if self.launch_s is None:
            self.launch_s = t0 - self._host_at
        with self._cond:
            self._enter(DEVICE)
        try:
            yield
        finally:
            with self._cond:
                self._enter(HOST)
            self.wait_s += time.monotonic() - t0

    # ----------------------------------------------------------------- other threads
    def _may_run(self, seen: int) -> bool:
        if self.state == IDLE:
            return True
        return self.state == DEVICE and self._phase != seen and not self._done()

    def admit(self, timeout: float = 0.05) -> None:
        """Return once this thread's next piece of Python costs the engine's step nothing, or after ``timeout``."""
        with self._cond:
            if self._may_run(-1) or self._pass == self._phase:
                self.admitted += 1
                return
            # Blocked: in HOST until the next device wait or idle; in DEVICE with the device done, past this wait
            # (the step's thread is about to want the GIL back for its results).
            seen = self._phase if self.state == DEVICE else -1
            t0 = time.monotonic()
            end = t0 + timeout
            while not self._may_run(seen) and (left := end - time.monotonic()) > 0:
                self._cond.wait(left)  # device_wait() and idle() notify
            if not self._may_run(seen):
                # Held the whole timeout: a phase that long (a first use compiling kernels: 0.8 s on the H200)
                # must not hold every request for it in turn; the rest of this phase admits at once.
                self._pass = self._phase
            self.held += 1
            self.held_s += time.monotonic() - t0
