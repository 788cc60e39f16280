"""The worker: one engine, driven by a step loop that never touches the network.

Between steps the loop drains its inbox (new requests, cancels, "abort all" after a Redis outage) that the I/O
threads fill; after each step it hands that step's chunks and XACKs to the writer thread as one batch. A new
request reaches the inbox already prepared (``Worker.prepare``, run by the I/O thread that read it: parameters
parsed, engine request validated and built, or the error that answers it), so the loop, which owns the engine's
scheduler, only enqueues it: a burst arriving during a step costs the next step little.

Invariants:
- A request is XACKed only in the same transaction that writes its final chunk or error.
- ``OutputChunk.seq`` counts the tokens emitted for the choice, including those emitted before a resume.
- Drain (SIGTERM): stop reading, finish what runs until ``drain_timeout_s``, then hand the rest back to the
  queue as resumable copies after their emitted chunks are written; a live worker continues them.

Over 400 lines on purpose: the loop is one class whose invariants (above) are kept by code spread over its
methods (take-in, emit, cancel, abort, hand-back); they are checked together, so they are read together. What
is not the loop lives beside it: Redis I/O threads (io.py), metrics (metrics.py), the step trace (trace.py).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

from kernellab.runtime.request.errors import KernellabError
from kernellab.runtime.request.outputs import Engine
from kernellab.runtime.request.sampling import SamplingParams
from kernellab.services.config import WorkerSettings
from kernellab.services.observability import GC_PAUSES, refreeze_heap
from kernellab.services.queue.broker import Delivery, WorkerQueue, connect
from kernellab.services.queue.keys import Keys
from kernellab.services.queue.protocol import ErrorMessage, Heartbeat, OutputChunk
from kernellab.services.worker.io import RedisIO, WriteBatch
from kernellab.services.worker.metrics import WorkerMetrics
from kernellab.services.worker.trace import StepTrace

log = logging.getLogger("kernellab.worker")

PRIORITY_VALUE = {"interactive": 0, "batch": 1}  # the engine runs lower values first
READER_POLL_S = 0.0002  # a gather past its quiet gap looks this often whether the request reader is done


@dataclass
class Incoming:
    """A request entry as an I/O thread hands it to the loop (the inbox's "add" payload)."""

    delivery: Delivery
    received: float  # time.monotonic() when the I/O thread read it
    prepared: Any = None  # engine.prepare_request's result, for engine.add_prepared
    error: Exception | None = None  # or what preparing it raised (answered once the loop takes it in)
    deferred: bool = False  # not prepared yet: the loop prepares it (WorkerSettings.prepare_in_reader off)


@dataclass
class Active:
    delivery: Delivery
    emitted: int  # tokens emitted so far for this choice (seq of the next chunk)
    arrival: float
    first: float | None = None
    last: float | None = None


def _wire_logprobs(entries) -> list:
    """TokenLogprob entries as the protocol carries them: [token_id, logprob, [[top_id, top_logprob], ...]]."""
    return [[lp.token_id, float(lp.logprob), [[int(t), float(v)] for t, v in lp.top]] for lp in entries]


def load_engine_factory(path: str):
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr or "LLMEngine")


class Worker:
    def __init__(self, settings: WorkerSettings, engine=None):
        self.settings = s = settings
        self.worker_id = s.resolved_worker_id()
        if engine is None:
            from kernellab.runtime.config import EngineConfig

            engine = load_engine_factory(s.engine)(
                EngineConfig(
                    model=s.model,
                    device=s.device,
                    dtype=s.dtype,
                    max_model_len=s.max_model_len,
                    max_num_seqs=s.max_num_seqs,
                    max_num_batched_tokens=s.max_num_batched_tokens,
                    background_prefill_tokens=s.background_prefill_tokens,
                    num_kv_blocks=s.num_kv_blocks,
                    block_size=s.block_size,
                    weight_quant=s.weight_quant,
                    kv_cache_dtype=s.kv_cache_dtype,
                    piecewise_graphs=s.piecewise_graphs,
                    fresh_prompt_graphs=s.fresh_prompt_graphs,
                    async_scheduling=s.async_scheduling,
                    kernels=s.kernels,
                    disabled_kernels=s.disabled_kernels,
                )
            )
        self.engine: Engine = engine
        self.gate = getattr(engine, "host_gate", None)  # runtime/host_gate.py: None where steps are host work
        self.model_name = engine.model_name or s.model
        self.keys = Keys(s.key_prefix, self.model_name)
        self.metrics = WorkerMetrics(self.model_name)
        self.metrics_url = ""
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.io = RedisIO(
            s.redis_url,
            self.keys,
            self.worker_id,
            max_num_seqs=s.max_num_seqs,
            batch_share=s.batch_share,
            max_deliveries=s.max_deliveries,
            heartbeat_interval_s=s.heartbeat_interval_s,
            dead_after_s=s.worker_dead_after_s,
            output_ttl_s=s.output_ttl_s,
            request_timeout_s=s.request_timeout_s,
            inbox=self.inbox,
            heartbeat=self.heartbeat,
            prepare=self.prepare if s.prepare_in_reader else self._defer,
            metrics=self.metrics,
            write_slice=s.output_write_slice,
            admit=self.gate.admit if self.gate is not None and s.reader_yields_to_step else None,
        )
        self.active: dict[str, Active] = {}
        self.trace = StepTrace(s.step_trace) if s.step_trace else None
        self.metrics.registry.register(GC_PAUSES.install())
        self._gc_mark = GC_PAUSES.snapshot()  # the step trace's gc_dt / gc_gen: collector time since the last line
        if s.gc_probe_ms is not None:
            GC_PAUSES.probe(s.gc_probe_ms)
        self.draining = threading.Event()
        self.stopped = threading.Event()
        self._stats = engine.stats()
        self.loop_error: BaseException | None = None
        self.integrity = "unchecked"  # engine.check_integrity() when last idle: "ok" or what it found
        self._integrity_at = 0.0
        self._stepped = False  # a step ran since the loop last went idle (gc_idle_freeze)
        self.refreezes = 0

    # ----------------------------------------------------------------- public
    def heartbeat(self) -> Heartbeat:
        st = self._stats
        return Heartbeat(
            self.worker_id,
            self.model_name,
            time.time(),
            os.getpid(),
            st.num_running,
            st.num_waiting,
            float(st.kv_cache_usage),
            int(self.engine.max_model_len),
            self.metrics_url,
            self.draining.is_set(),
            {"active": len(self.active)},
        )

    def health(self) -> dict:
        ok = self.loop_error is None and not self.stopped.is_set()
        st = self._stats
        return {
            "status": "ok" if ok else "failed",
            "worker_id": self.worker_id,
            "model": self.model_name,
            "redis": self.io.redis_ok.is_set(),
            "draining": self.draining.is_set(),
            "running": st.num_running,
            "waiting": st.num_waiting,
            "kv_cache_usage": st.kv_cache_usage,
            # Leak checks (tests, `kernellab stress`): once idle, used blocks and active requests must be 0.
            "kv_blocks_total": st.num_total_blocks,
            "kv_blocks_used": st.num_total_blocks - st.num_free_blocks,
            "active": len(self.active),
            "held": self.io.holdings.count(),
            "integrity": self.integrity,
        }

    def prepare(self, d: Delivery, received: float) -> Incoming:
        """Called by the I/O thread that read ``d``, beside the step loop (which holds the GIL only between
        device waits): everything about a new request that does not touch the engine's scheduler. Exceptions
        are kept for the loop, which decides in ``_add`` whether the request is answered with them."""
        item = Incoming(d, received)
        if d.finished:  # only its XACK is missing
            return item
        msg = d.message
        try:
            item.prepared = self.engine.prepare_request(
                msg.engine_id,
                msg.prompt_token_ids,
                SamplingParams.from_dict(msg.params),
                priority=PRIORITY_VALUE.get(msg.priority, 0),
                deadline=msg.deadline,
                output_token_ids=list(d.emitted or []),
            )
        except Exception as exc:
            item.error = exc
        return item

    @staticmethod
    def _defer(d: Delivery, received: float) -> Incoming:
        return Incoming(d, received, deferred=True)

    def drain(self) -> None:
        """Stop taking requests; the loop finishes what it has (up to drain_timeout_s) and returns."""
        self.draining.set()
        self.io.accepting.clear()
        self.inbox.put(("wake", None))

    def run(self) -> None:
        try:
            WorkerQueue(connect(self.settings.redis_url), self.keys, self.worker_id).ensure_groups()
        except Exception as exc:  # Redis may come later; the I/O threads retry
            log.warning("could not create consumer groups yet: %s", exc)
        self.io.start()
        try:
            self._loop()
        except BaseException as exc:
            self.loop_error = exc
            raise
        finally:
            self.io.stop()
            if self.trace is not None:
                self.trace.close()
            self.stopped.set()

    # ----------------------------------------------------------------- the loop
    def _loop(self) -> None:
        drain_deadline = None
        last = time.monotonic()
        while True:
            self._check_stall(last)
            last = time.monotonic()
            idle = not self.engine.has_unfinished_requests()
            if idle and self.gate is not None:
                self.gate.idle()  # the loop waits for requests (and gathers a burst): the reader may run
            taken = self._drain_inbox(block=idle)
            if idle and self.engine.has_unfinished_requests():
                self._gather(burst=taken > 1)
            if self.draining.is_set():
                drain_deadline = drain_deadline or time.monotonic() + self.settings.drain_timeout_s
                if not self.active or time.monotonic() >= drain_deadline:
                    self._hand_back()
                    return
            if not self.engine.has_unfinished_requests():
                if self.trace is not None:
                    self.trace.flush()
                self._refresh_stats()
                self._check_integrity()
                self._idle_refreeze()
                continue
            t0 = time.monotonic()
            if self.gate is not None:
                # From here until the loop waits for work again, the request reader runs only while a step waits
                # for the device: the loop's own Python (launches, emit, take-in) never waits for the reader's.
                self.gate.host()
            outputs = self.engine.step()
            self._stepped = True
            t1 = time.monotonic()
            self._check_stall(last)  # stopped mid-step: what others reclaimed meanwhile is not emitted
            first = self._emit(outputs)
            if self.trace is not None:
                gate = (self.gate.launch_s, self.gate.wait_s) if self.gate is not None else None
                gc_now = GC_PAUSES.snapshot()
                gc_d = [now - before for now, before in zip(gc_now, self._gc_mark, strict=True)]
                self._gc_mark = gc_now
                census = GC_PAUSES.take_census()
                self.trace.step(
                    t0, t1 - t0, self.engine.last_schedule, first, time.monotonic() - t1, gate, gc_d, census
                )
            self._refresh_stats()

    def _check_stall(self, since: float) -> None:
        """Stopped longer than the reclaim timeout (SIGSTOP, swap, a debugger)? Other workers may own our
        requests now. Before stepping or emitting, let the housekeeping thread finish a full refresh, which
        puts the requests we lost into the inbox ("lost"), and drop them instead of running them twice."""
        if time.monotonic() - since <= self.settings.worker_dead_after_s:
            return
        seen, end = self.io.refreshes, time.monotonic() + 2 * self.settings.heartbeat_interval_s + 1.0
        while self.io.refreshes < seen + 2 and time.monotonic() < end:
            time.sleep(0.01)
        self._drain_inbox(block=False)

    def _refresh_stats(self) -> None:
        self._stats = self.engine.stats()
        self.metrics.update_from_stats(self._stats)

    def _idle_refreeze(self) -> None:
        """Gone idle after a busy spell (``gc_idle_freeze``): collect and freeze the survivors, unless a request
        is already waiting in the inbox (it goes first; the next idle spell freezes)."""
        if not (self._stepped and self.settings.gc_idle_freeze and self.inbox.empty()):
            return
        self._stepped = False
        frozen, seconds = refreeze_heap()
        self.refreezes += 1
        log.debug("idle: collected and froze the heap (%d objects frozen, %.2f ms)", frozen, seconds * 1e3)

    def _check_integrity(self) -> None:
        """Idle: the engine's own consistency check (ref counts, free queue, hash index), at most once a second."""
        if time.monotonic() - self._integrity_at < 1.0:
            return
        self._integrity_at = time.monotonic()
        try:
            self.engine.check_integrity()
            self.integrity = "ok"
        except AssertionError as exc:
            if self.integrity != str(exc):
                log.error("engine integrity check failed: %s", exc)
            self.integrity = str(exc)

    def _drain_inbox(self, block: bool) -> int:
        """Handle what the I/O threads delivered; returns how many items."""
        batch = WriteBatch()
        n = 0
        try:
            item = self.inbox.get(timeout=0.1) if block else self.inbox.get_nowait()
            while True:
                self._handle(item, batch)
                n += 1
                item = self.inbox.get_nowait()
        except queue.Empty:
            pass
        if batch.messages or batch.acks:
            self.io.outbox.put(batch)
        return n

    def _gather(self, burst: bool) -> None:
        """Idle → busy: wait while a burst is still arriving, so its requests share the first steps (see
        ``WorkerSettings.gather_burst_gap_s``). ``burst``: more than one request came at once already."""
        s = self.settings
        burst_gap = max(s.gather_gap_s, s.gather_burst_gap_s)
        gap, end = burst_gap if burst else s.gather_gap_s, time.monotonic() + s.gather_max_s
        batch = WriteBatch()
        # Once the first step has enough work to keep the device busy while the rest arrives, waiting longer only
        # delays it: later arrivals join the next step (the loop takes them in between steps).
        target = min(s.gather_tokens or s.max_num_batched_tokens // 4, s.max_num_batched_tokens)
        gathered = self._new_prompt_tokens()
        last = time.monotonic()
        while gap > 0 and (left := end - (now := time.monotonic())) > 0 and gathered < target:
            wait = last + gap - now
            final = wait <= 0 and not (s.gather_follows_reader and self.io.reading)
            try:
                if final:  # quiet, and the reader is parked: it may have handed over its last item just before
                    item = self.inbox.get_nowait()
                else:  # within the gap, or past it while the reader still holds (or fetches) more
                    item = self.inbox.get(timeout=min(wait if wait > 0 else READER_POLL_S, left))
            except queue.Empty:
                if final:
                    break
                continue
            last = time.monotonic()
            before = len(self.active)
            self._handle(item, batch)
            if item[0] == "add" and len(self.active) == before + 1:  # counted as it comes, not re-summed
                gathered += len(item[1].delivery.message.prompt_token_ids)
            else:
                gathered = self._new_prompt_tokens()
            gap = burst_gap
        if batch.messages or batch.acks:
            self.io.outbox.put(batch)

    def _new_prompt_tokens(self) -> int:
        """Prompt tokens of the requests not started yet (while gathering: all of them)."""
        return sum(len(a.delivery.message.prompt_token_ids) for a in self.active.values() if a.first is None)

    def _handle(self, item, batch: WriteBatch) -> None:
        kind, payload = item
        if kind == "add":
            self._add(payload, batch)
        elif kind == "cancel":
            self._cancel(payload.request_id, payload.index, batch)
        elif kind == "lost":  # reclaimed by another worker while we were stalled: it owns them, write nothing
            for eid in payload:
                if self.active.pop(eid, None) is not None:
                    self.engine.abort(eid)
        elif kind == "abort_all":
            log.warning("aborting %d request(s): %s", len(self.active), payload)
            for eid in list(self.active):
                self._abort(eid, batch)

    def _add(self, item: Incoming, batch: WriteBatch) -> None:
        if item.deferred:
            item = self.prepare(item.delivery, item.received)
        d = item.delivery
        msg = d.message
        eid = msg.engine_id
        if d.finished:  # resumed, but its final chunk is already written: only the XACK was lost
            batch.ack(d)
            return
        emitted = len(d.emitted or [])

        def finish(reason: str) -> None:
            batch.add(self._chunk(d, emitted, [], None, True, reason), d)
            batch.ack(d, lambda: self.metrics.finish(reason))

        if self.io.cancels.cancelled(msg.request_id, msg.index):
            return finish("abort")
        if msg.deadline is not None and msg.deadline <= time.time():
            return finish("deadline")
        if eid in self.active:  # read twice (a reclaim raced our own refresh): the running copy wins
            self.io.holdings.release([d])
            return
        try:
            if item.error is not None:
                raise item.error
            self.engine.add_prepared(item.prepared)
        except KernellabError as exc:
            batch.add(
                ErrorMessage(
                    msg.request_id,
                    msg.index,
                    exc.status_code,
                    exc.message,
                    exc.error_type,
                    exc.code,
                    exc.param,
                    self.worker_id,
                ),
                d,
            )
            batch.ack(d)
            return
        except (TypeError, ValueError) as exc:
            batch.add(
                ErrorMessage(
                    msg.request_id,
                    msg.index,
                    400,
                    f"bad request: {exc}",
                    "invalid_request_error",
                    None,
                    None,
                    self.worker_id,
                ),
                d,
            )
            batch.ack(d)
            return
        self.active[eid] = a = Active(d, emitted, time.monotonic())
        if self.trace is not None:
            self.trace.add(a.arrival, msg.request_id, msg.index, len(msg.prompt_token_ids), item.received)

    def _cancel(self, request_id: str, index: int | None, batch: WriteBatch) -> None:
        indices = [index] if index is not None else None
        for eid, a in list(self.active.items()):
            m = a.delivery.message
            if m.request_id == request_id and (indices is None or m.index in indices):
                self._abort(eid, batch)

    def _abort(self, eid: str, batch: WriteBatch) -> None:
        a = self.active.pop(eid)
        self.engine.abort(eid)
        batch.add(self._chunk(a.delivery, a.emitted, [], None, True, "abort"), a.delivery)
        batch.ack(a.delivery, lambda: self.metrics.finish("abort"))

    def _chunk(
        self,
        d: Delivery,
        seq: int,
        tokens,
        logprobs,
        finished: bool,
        reason,
        stop_reason=None,
        cached: int = 0,
        prompt_logprobs: list | None = None,
    ) -> OutputChunk:
        m = d.message
        return OutputChunk(
            m.request_id,
            m.index,
            seq,
            tokens,
            logprobs,
            finished,
            reason,
            stop_reason,
            len(m.prompt_token_ids),
            seq + len(tokens),
            cached,
            self.worker_id,
            prompt_logprobs,
        )

    def _emit(self, outputs) -> list[str]:
        """Hand a step's chunks to the writer; returns "request_id:index" of the requests that got their first
        token (for the step trace)."""
        batch = WriteBatch()
        now = time.monotonic()
        m = self.metrics
        first_tokens: list[str] = []
        for out in outputs:
            a = self.active.get(out.request_id)
            if a is None:
                continue
            tokens = list(out.new_token_ids)
            if not tokens and not out.finished:
                continue
            logprobs = _wire_logprobs(out.new_logprobs) if out.new_logprobs else None
            batch.add(
                self._chunk(
                    a.delivery,
                    a.emitted,
                    tokens,
                    logprobs,
                    out.finished,
                    out.finish_reason,
                    out.stop_reason,
                    out.num_cached_tokens,
                    _wire_logprobs(out.prompt_logprobs) if out.prompt_logprobs is not None else None,
                ),
                a.delivery,
            )
            a.emitted += len(tokens)
            if tokens:
                if a.first is None:
                    a.first = now
                    first_tokens.append(f"{a.delivery.message.request_id}:{a.delivery.message.index}")
                    m.ttft.observe(now - a.arrival)
                elif a.last is not None:
                    m.itl.observe((now - a.last) / len(tokens))
                a.last = now
            if out.finished:
                m.e2e.observe(now - a.arrival)
                # Counted once the XACK is ours: a stalled worker's finish of a reclaimed request is not one.
                batch.ack(a.delivery, functools.partial(m.finish, out.finish_reason))
                del self.active[out.request_id]
        if batch.messages or batch.acks:
            written = threading.Event()
            batch.written.append(written)
            self.io.outbox.put(batch)
            if first_tokens and self.settings.first_token_flush_s > 0:
                # First tokens are what clients wait on most. The next step's Python would hold the GIL the
                # writer thread needs (and on a CPU its threads take the cores the gateway needs), so let
                # this batch reach Redis first; a later batch never waits.
                written.wait(self.settings.first_token_flush_s)
        return first_tokens

    def _hand_back(self) -> None:
        """Drain timed out (or finished): abort what still runs and requeue it, after its chunks are written."""
        batch = WriteBatch()
        for eid, a in list(self.active.items()):
            self.engine.abort(eid)
            batch.requeue.append(a.delivery)
            del self.active[eid]
        # Requests read but never started (still in the inbox) go back too.
        try:
            while True:
                kind, payload = self.inbox.get_nowait()
                if kind == "add":
                    batch.requeue.append(payload.delivery)
        except queue.Empty:
            pass
        if batch.requeue:
            log.info("handing %d unfinished request(s) back to the queue", len(batch.requeue))
            self.io.outbox.put(batch)
        self._refresh_stats()
