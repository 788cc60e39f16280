"""The worker loop with a fake engine and a real Redis: outputs, cancels, resume after reclaim, drain."""

import json
import threading
import time

import pytest
import redis

from kernellab.services.config import WorkerSettings
from kernellab.services.queue.broker import WorkerQueue
from kernellab.services.queue.keys import GROUP, Keys
from kernellab.services.queue.protocol import (
    CancelMessage,
    ErrorMessage,
    OutputChunk,
    RequestMessage,
    entry,
    from_entry,
)
from kernellab.services.worker.loop import Worker
from tests.support.fake_engine import FakeEngine

PROMPT = [101, 102, 103, 104, 105]


def settings(redis_url, prefix, **kw):
    base = dict(
        redis_url=redis_url,
        key_prefix=prefix,
        model="smollm2-135m",
        heartbeat_interval_s=0.05,
        worker_dead_after_s=0.3,
        worker_metrics_port=0,
        drain_timeout_s=5.0,
    )
    return WorkerSettings(**{**base, **kw})


class Running:
    def __init__(self, s, step_s=0.005):
        self.worker = Worker(s, engine=FakeEngine(step_s=step_s))
        self.thread = threading.Thread(target=self.worker.run, daemon=True)
        self.thread.start()

    def stop(self):
        self.worker.drain()
        self.thread.join(10)
        assert not self.thread.is_alive()


@pytest.fixture
def ctx(redis_url, prefix):
    r = redis.Redis.from_url(redis_url)
    workers = []

    def start(step_s=0.005, **kw):
        w = Running(settings(redis_url, prefix, **kw), step_s)
        workers.append(w)
        return w

    yield r, Keys(prefix, "smollm2-135m"), start
    for w in workers:
        if w.thread.is_alive():
            w.stop()


def send(r, keys, rid, max_tokens=6, index=0, **kw):
    params = {"max_tokens": max_tokens, "logprobs": kw.pop("logprobs", None)}
    msg = RequestMessage(rid, index, "smollm2-135m", kw.pop("prompt", PROMPT), params, **kw)
    r.xadd(keys.requests(msg.priority), entry(msg))
    return msg


def collect(r, keys, eid, timeout=10.0):
    """Tokens of one choice, deduplicated by seq as the gateway does, and its last message."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        tokens, last = [], None
        for _id, fields in r.xrange(keys.output(eid)):
            last = from_entry(fields)
            if isinstance(last, OutputChunk):
                assert last.seq <= len(tokens), "a gap in the stream"
                tokens.extend(last.token_ids[len(tokens) - last.seq :])
        if isinstance(last, ErrorMessage) or (last is not None and last.finished):
            return tokens, last
        time.sleep(0.01)
    raise AssertionError(f"{eid} did not finish")


def expected(n, prompt=PROMPT):
    return [prompt[i % len(prompt)] for i in range(n)]


def wait_for(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_request_runs_and_is_acked(ctx):
    r, keys, start = ctx
    w = start()
    send(r, keys, "a", logprobs=1)
    tokens, last = collect(r, keys, "a-0")
    assert tokens == expected(6) and last.finish_reason == "length" and last.completion_tokens == 6
    assert last.prompt_tokens == len(PROMPT) and last.worker == w.worker.worker_id
    first = from_entry(r.xrange(keys.output("a-0"))[0][1])
    assert first.logprobs == [[PROMPT[0], -0.5, [[PROMPT[0], -0.5]]]]
    wait_for(lambda: r.xpending(keys.requests("interactive"), GROUP)["pending"] == 0)
    assert 0 < r.pttl(keys.output("a-0")) <= 600_000
    wait_for(lambda: r.zscore(keys.workers, w.worker.worker_id) is not None)


def test_cancel_frees_the_request_and_acks(ctx):
    r, keys, start = ctx
    w = start(step_s=0.01)
    send(r, keys, "long", max_tokens=200)
    wait_for(lambda: r.xlen(keys.output("long-0")) >= 3)
    r.xadd(keys.cancel, entry(CancelMessage("long")))
    tokens, last = collect(r, keys, "long-0")
    assert last.finish_reason == "abort" and len(tokens) < 200
    wait_for(lambda: w.worker.metrics.kv_usage._value.get() == 0.0)
    assert not w.worker.engine.seqs
    assert r.xpending(keys.requests("interactive"), GROUP)["pending"] == 0


def test_cancel_before_pickup_never_reaches_the_engine(ctx):
    r, keys, start = ctx
    r.xadd(keys.cancel, entry(CancelMessage("early")))
    w = start()
    time.sleep(0.2)
    send(r, keys, "early")
    tokens, last = collect(r, keys, "early-0")
    assert tokens == [] and last.finish_reason == "abort"
    assert w.worker.engine.added == []


@pytest.mark.parametrize("in_reader", [True, False])
def test_bad_request_gets_an_error_and_is_acked(ctx, in_reader):
    """Wherever a request is prepared (the reader thread during a step, or the loop as it takes it in), a bad one
    is answered with its error and acked, and a good one behind it still runs."""
    r, keys, start = ctx
    start(prepare_in_reader=in_reader)
    send(r, keys, "big", prompt=list(range(1, 300)))
    _tokens, last = collect(r, keys, "big-0")
    assert isinstance(last, ErrorMessage) and last.status == 400 and last.code == "context_length_exceeded"
    send(r, keys, "late", deadline=time.time() - 1)
    _tokens, last = collect(r, keys, "late-0")
    assert last.finish_reason == "deadline"
    send(r, keys, "ok")
    tokens, last = collect(r, keys, "ok-0")
    assert tokens == expected(6) and last.finish_reason == "length"


def test_dead_workers_request_is_resumed_seamlessly(ctx):
    r, keys, start = ctx
    send(r, keys, "a", max_tokens=12)
    dead = WorkerQueue(r, keys, "dead-worker")
    dead.ensure_groups()
    [held] = dead.read(["interactive"], 1, None)
    r.xadd(keys.output("a-0"), entry(OutputChunk("a", 0, 0, expected(4))))  # it emitted 4 tokens, then died
    w = start()
    tokens, last = collect(r, keys, "a-0")
    assert tokens == expected(12) and last.finish_reason == "length"
    [(rid, _prompt, emitted)] = w.worker.engine.added
    assert rid == "a-0" and emitted == expected(4)
    assert w.worker.metrics.reclaimed._value.get() == 1
    assert r.xpending(held.stream, GROUP)["pending"] == 0


def test_drain_hands_unfinished_work_to_another_worker(ctx):
    r, keys, start = ctx
    first = start(step_s=0.01, drain_timeout_s=0.1)
    send(r, keys, "a", max_tokens=60)
    wait_for(lambda: r.xlen(keys.output("a-0")) >= 3)
    first.stop()
    assert first.worker.engine.seqs == {}
    second = start()
    tokens, last = collect(r, keys, "a-0")
    assert tokens == expected(60) and last.finish_reason == "length"
    [(_rid, _p, emitted)] = second.worker.engine.added
    assert 3 <= len(emitted) < 60
    assert r.zscore(keys.workers, first.worker.worker_id) is None


def test_n_choices_and_priorities(ctx):
    r, keys, start = ctx
    start(worker_id="w-prio")
    send(r, keys, "b", priority="batch")
    for i in range(2):
        send(r, keys, "c", index=i)
    for eid in ("b-0", "c-0", "c-1"):
        tokens, _last = collect(r, keys, eid)
        assert tokens == expected(6)


def _delivery(rid, prompt_len):
    from kernellab.services.queue.broker import Delivery

    return Delivery(
        "stream", f"{rid}-0", RequestMessage(rid, 0, "smollm2-135m", list(range(1, prompt_len + 1)), {"max_tokens": 4})
    )


@pytest.mark.parametrize(
    "limits", [{"max_num_batched_tokens": 100}, {"max_num_batched_tokens": 960}, {"gather_tokens": 200}]
)
def test_gather_stops_once_the_first_step_has_enough_work(redis_url, prefix, limits):
    """An idle worker gathers a burst, but once the first step holds its gather target (a quarter of the step
    budget by default, or gather_tokens) it does not wait for the rest: they join the next step (the engine has
    them as soon as the loop drains the inbox again), and the device is busy meanwhile."""
    w = Worker(
        settings(redis_url, prefix, gather_burst_gap_s=5.0, gather_max_s=5.0, **limits),
        engine=FakeEngine(step_s=0),
    )
    for i in range(4):
        w.inbox.put(("add", w.prepare(_delivery(f"r{i}", 60), time.monotonic())))
    t = time.monotonic()
    assert w._drain_inbox(block=False) == 4  # all four were there already: 240 prompt tokens ≥ 100
    w.inbox.put(("add", w.prepare(_delivery("late", 60), time.monotonic())))
    w._gather(burst=True)
    assert time.monotonic() - t < 1.0  # not the 5 s burst gap
    assert "late" not in {eid.rsplit("-", 1)[0] for eid in w.active}  # left for the next drain


def test_gather_waits_out_a_burst_arriving_in_pieces(redis_url, prefix):
    """Pieces of a burst closer than gather_burst_gap_s join the first step; the gather ends at the first
    quiet gap."""
    w = Worker(
        settings(
            redis_url,
            prefix,
            max_num_batched_tokens=10_000,
            gather_gap_s=0.5,
            gather_burst_gap_s=1.0,
            gather_max_s=10.0,
        ),
        engine=FakeEngine(step_s=0),
    )
    w.inbox.put(("add", w.prepare(_delivery("first", 10), time.monotonic())))
    w._drain_inbox(block=False)

    def pieces():
        for i in range(3):
            time.sleep(0.1)
            w.inbox.put(("add", w.prepare(_delivery(f"piece{i}", 10), time.monotonic())))

    feeder = threading.Thread(target=pieces)
    t = time.monotonic()
    feeder.start()
    w._gather(burst=False)
    feeder.join()
    took = time.monotonic() - t
    assert {eid.rsplit("-", 1)[0] for eid in w.active} == {"first", "piece0", "piece1", "piece2"}
    assert 0.3 + 1.0 - 0.05 <= took < 6.0  # three pieces, then one quiet burst gap


def test_step_trace_records_each_request_and_the_step_that_made_its_first_token(ctx, tmp_path):
    r, keys, start = ctx
    path = tmp_path / "trace.jsonl"
    w = start(step_trace=str(path))
    msgs = [send(r, keys, f"req-trace-{i}", max_tokens=3) for i in range(2)]
    for m in msgs:
        tokens, last = collect(r, keys, m.engine_id)
        assert len(tokens) == 3 and last.finished
    w.stop()  # the trace is written when the engine goes idle and at exit
    events = [json.loads(x) for x in path.read_text().splitlines()]
    adds = {e["rid"]: e for e in events if e["ev"] == "add"}
    assert set(adds) == {"req-trace-0", "req-trace-1"}
    assert all(0 <= e["t"] - e["recv"] < 5.0 for e in adds.values())  # read by the I/O thread, then taken in
    steps = [e for e in events if e["ev"] == "step"]
    firsts = [rid for e in steps for rid in e["first"]]
    assert sorted(firsts) == ["req-trace-0:0", "req-trace-1:0"]  # each first token once
    assert all(e["dt"] >= 0 and e["emit_dt"] >= 0 and e["gc_dt"] >= 0 for e in steps)
    # the collector's time split by generation: [seconds, collections, the collecting thread's CPU seconds] each,
    # adding up to gc_dt (each to the µs)
    for e in steps:
        assert len(e["gc_gen"]) == 3
        assert all(s >= 0 and n >= 0 and c >= 0 and isinstance(n, int) for s, n, c in e["gc_gen"])
        assert abs(sum(s for s, _, _ in e["gc_gen"]) - e["gc_dt"]) <= 2e-6
        assert "gc_census" not in e  # the probe is off unless KERNELLAB_GC_PROBE_MS sets it
    assert [e["t"] for e in steps] == sorted(e["t"] for e in steps)


@pytest.mark.parametrize("follows", [True, False])
def test_gather_waits_for_a_busy_reader_past_its_quiet_gap(redis_url, prefix, follows):
    """A burst's later read can take longer than the first gather gap to decode and prepare; while the request
    reader says it is busy the gather keeps waiting (bounded by gather_max_s), so what it hands over joins the
    first step. With gather_follows_reader off the gap alone decides and the late request is left out."""
    w = Worker(
        settings(
            redis_url,
            prefix,
            max_num_batched_tokens=10_000,
            gather_gap_s=0.05,
            gather_burst_gap_s=0.05,
            gather_max_s=5.0,
            gather_follows_reader=follows,
        ),
        engine=FakeEngine(step_s=0),
    )
    w.inbox.put(("add", w.prepare(_delivery("first", 10), time.monotonic())))
    w._drain_inbox(block=False)
    w.io.reading = True  # as the reader thread sets it while it holds a read's entries

    def reader():
        time.sleep(0.3)  # six quiet gaps
        w.inbox.put(("add", w.prepare(_delivery("late", 10), time.monotonic())))
        w.io.reading = False

    feeder = threading.Thread(target=reader)
    t = time.monotonic()
    feeder.start()
    w._gather(burst=False)
    took = time.monotonic() - t
    feeder.join()
    taken = {eid.rsplit("-", 1)[0] for eid in w.active}
    if follows:
        assert taken == {"first", "late"} and 0.3 <= took < 4.0, took
    else:
        assert taken == {"first"} and took < 0.25


def test_the_reader_is_not_busy_while_parked_in_its_idle_read(ctx):
    """A stuck ``reading`` would hold every idle worker's gather to gather_max_s: it must clear once the reader
    has handed a request over and found nothing more."""
    r, keys, start = ctx
    w = start()
    wait_for(lambda: not w.worker.io.reading)
    send(r, keys, "solo", max_tokens=3)
    tokens, _last = collect(r, keys, "solo-0")
    assert tokens == expected(3)
    wait_for(lambda: not w.worker.io.reading, timeout=2.0)


class LaunchingEngine(FakeEngine):
    """A fake whose step first spends ``host_s`` launching (the step's Python; sleeping, so the GIL is free for
    the reader as it is at every torch op), then ``step_s`` on the device, and records both phases."""

    def __init__(self, host_s, step_s):
        super().__init__(step_s=step_s)
        self.host_s = host_s
        self.launches: list[tuple[float, float]] = []  # (launch began, device wait began)

    def step(self):
        t0 = time.monotonic()
        time.sleep(self.host_s)
        self.launches.append((t0, time.monotonic()))
        return super().step()


@pytest.mark.parametrize("yields", [True, False])
def test_the_reader_prepares_requests_only_while_the_step_is_not_launching(redis_url, prefix, yields):
    """Requests arriving while the worker runs are decoded and prepared by its reader while the step waits on the
    device or between steps, never while a step's Python launches (runtime/host_gate.py). Off, the reader works
    whenever it reads."""
    engine = LaunchingEngine(host_s=0.02, step_s=0.02)
    w = Worker(settings(redis_url, prefix, reader_yields_to_step=yields), engine=engine)
    prepared: list[float] = []
    prepare = w.io.prepare

    def timed(d, received):
        prepared.append(time.monotonic())
        return prepare(d, received)

    w.io.prepare = timed
    thread = threading.Thread(target=w.run, daemon=True)
    thread.start()
    r, keys = redis.Redis.from_url(redis_url), Keys(prefix, "smollm2-135m")
    try:
        send(r, keys, "long", max_tokens=60)  # keeps the worker stepping
        wait_for(lambda: len(engine.launches) >= 2)
        for i in range(12):
            time.sleep(0.0137)  # off the step's rhythm: some arrive in each phase
            send(r, keys, f"late{i}", max_tokens=2)
        for i in range(12):
            assert collect(r, keys, f"late{i}-0")[0] == expected(2)
        assert collect(r, keys, "long-0")[0] == expected(60)
    finally:
        w.drain()
        thread.join(10)
    # A prepare that began well inside a launch (not at its very start: the reader may have been admitted just
    # before the loop began the step).
    inside = [t for t in prepared[1:] for a, b in engine.launches if a + 0.004 < t < b]
    if yields:
        assert not inside, (inside, engine.launches)
        assert w.gate.held > 0  # it did wait
    else:
        assert len(prepared) == 13


ENGINE_CONFIGS: list = []


def recording_engine(config):
    """An engine factory (``KERNELLAB_ENGINE``) that keeps the EngineConfig the worker built from its settings."""
    ENGINE_CONFIGS.append(config)
    return FakeEngine()


def test_the_kernel_settings_reach_the_engine_and_a_bad_name_is_refused(redis_url, prefix, monkeypatch):
    from kernellab.runtime.request.errors import ConfigError

    monkeypatch.setenv("KERNELLAB_KERNELS", "experimental")
    monkeypatch.setenv("KERNELLAB_DISABLED_KERNELS", "rms_norm, argmax")
    Worker(settings(redis_url, prefix, engine=f"{__name__}:recording_engine"))
    assert ENGINE_CONFIGS[-1].kernels == "experimental"
    assert ENGINE_CONFIGS[-1].disabled_kernels == ("rms_norm", "argmax")
    monkeypatch.setenv("KERNELLAB_DISABLED_KERNELS", "rms_norm,flash_attention")
    with pytest.raises(ConfigError, match="disabled_kernels names no op: flash_attention"):
        Worker(settings(redis_url, prefix, engine=f"{__name__}:recording_engine"))
    monkeypatch.setenv("KERNELLAB_KERNELS", "fast")
    with pytest.raises(ValueError, match="kernels"):
        settings(redis_url, prefix)


def test_sliced_writes_deliver_every_stream_whole_and_in_order(ctx):
    """``output_write_slice=2``: each step's messages go to Redis in fenced writes of two, first tokens first;
    twelve requests taken in over two bursts (so steps mix first tokens with continuing chunks) each get every
    token once, in order, and their entries acked."""
    r, keys, start = ctx
    start(output_write_slice=2)
    for i in range(6):
        send(r, keys, f"s{i}", max_tokens=5 + i)
    time.sleep(0.03)
    for i in range(6, 12):
        send(r, keys, f"s{i}", max_tokens=5 + i)
    for i in range(12):
        tokens, last = collect(r, keys, f"s{i}-0")
        assert tokens == expected(5 + i) and last.finish_reason == "length"
    wait_for(lambda: r.xpending(keys.requests("interactive"), GROUP)["pending"] == 0)


def test_slices_put_first_tokens_first_and_keep_each_streams_order():
    from kernellab.services.worker.io import RedisIO, WriteBatch

    io = RedisIO.__new__(RedisIO)  # only the slicing: no threads, no connection
    io.write_slice = 2
    batch = WriteBatch()
    chunks = [
        OutputChunk("a", 0, 3, [1]),  # continuing
        OutputChunk("b", 0, 0, [1]),  # first token
        OutputChunk("c", 0, 5, [1]),
        OutputChunk("d", 0, 0, [1]),
        OutputChunk("b", 0, 1, [2]),  # b's second chunk (a coalesced batch): after its first
        OutputChunk("e", 0, 0, [], finished=True, finish_reason="abort"),  # no token: not a first token
    ]
    for c in chunks:
        batch.add(c, None)
    outputs = [(f"{c.request_id}:{c.seq}", b"", None) for c in chunks]
    parts = io._slices(batch, outputs)
    assert [[k for k, _, _ in p] for p in parts] == [["b:0", "d:0"], ["a:3", "c:5"], ["b:1", "e:0"]]
    io.write_slice = 0
    assert io._slices(batch, outputs) == [outputs]
    io.write_slice = 6
    assert io._slices(batch, outputs) == [outputs]


def test_gc_idle_freeze_collects_and_freezes_once_each_time_the_worker_goes_idle(ctx):
    """gc_idle_freeze: after a busy spell the idle loop collects and freezes what survived, once per spell (not at
    every idle poll), and the worker keeps serving afterwards; off, it never does."""
    import gc

    r, keys, start = ctx
    off = start()
    m = send(r, keys, "req-nofreeze", max_tokens=2)
    assert len(collect(r, keys, m.engine_id)[0]) == 2
    time.sleep(0.3)
    assert off.worker.refreezes == 0
    off.stop()
    try:
        w = start(gc_idle_freeze=True)
        frozen_before = gc.get_freeze_count()
        for spell in range(2):
            m = send(r, keys, f"req-freeze-{spell}", max_tokens=3)
            assert len(collect(r, keys, m.engine_id)[0]) == 3
            deadline = time.monotonic() + 5
            while w.worker.refreezes < spell + 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.3)  # several idle polls: still one freeze for the spell
            assert w.worker.refreezes == spell + 1
        assert gc.get_freeze_count() >= frozen_before
        w.stop()
    finally:
        gc.unfreeze()  # the test process's heap back in the collector's generations
