"""The worker's request reader in a process of its own (services/worker/reader.py), with a real Redis and real
processes: the handover keeps every field and error, the child reads only what the worker has room for, a dead
child is replaced without losing requests, and the child dies with its worker (``kill -9`` included)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import redis

from kernellab.runtime.request.errors import ContextLengthError, InvalidRequestError
from kernellab.runtime.request.limits import RequestLimits
from kernellab.runtime.request.sampling import SamplingParams
from kernellab.runtime.request.token_ids import TokenIds
from kernellab.services.queue.broker import Delivery
from kernellab.services.queue.keys import GROUP, Keys
from kernellab.services.queue.protocol import RequestMessage
from kernellab.services.worker.reader import pack, unpack
from tests.unit.services.test_svc_worker import Running, collect, expected, send, settings, wait_for


@pytest.fixture
def live(redis_url, prefix):
    """(redis, keys, start a worker with its reader in a process): stopped (drained) after the test."""
    started = []

    def start(step_s=0.005, **kw):
        w = Running(settings(redis_url, prefix, reader_process=True, **kw), step_s)
        started.append(w)
        return w

    yield redis.Redis.from_url(redis_url), Keys(prefix, "smollm2-135m"), start
    for w in started:
        if w.thread.is_alive():
            w.stop()


def _delivery(prompt, params, **kw) -> Delivery:
    msg = RequestMessage("chatcmpl-1", 2, "m", TokenIds(prompt, max(prompt)), params, "batch", 123.5, 7.0, 1, True)
    return Delivery("kl:req:m:batch", "5-0", msg, 2, **kw)


def test_a_checked_request_survives_the_handover_field_for_field():
    limits = RequestLimits(vocab_size=1000, max_model_len=64)
    d = _delivery([5, 999, 0, 17], {"max_tokens": 9, "temperature": 0.5, "stop": ["x"]}, emitted=[3, 4])
    back, received, params, max_tokens, error = unpack(pack(d, 42.25, limits))
    assert error is None and received == 42.25 and max_tokens == 9
    assert params == SamplingParams.from_dict(d.message.params)
    assert back == d  # every field of the delivery and its message, token ids included
    assert isinstance(back.message.prompt_token_ids, TokenIds) and back.message.prompt_token_ids.max_id == 999


@pytest.mark.parametrize(
    ("prompt", "params", "error", "param"),
    [
        ([1, 2, 3], {"max_tokens": 80}, ContextLengthError, "max_tokens"),
        ([1, 2, 1000], {"max_tokens": 4}, InvalidRequestError, "prompt"),
        ([1, 2, 3], {"max_tokens": 4, "temperature": -1}, InvalidRequestError, "temperature"),
    ],
)
def test_what_the_child_rejects_reaches_the_loop_as_the_same_error(prompt, params, error, param):
    d = _delivery(prompt, params)
    back, _received, checked, max_tokens, exc = unpack(pack(d, 0.0, RequestLimits(1000, 64)))
    assert back == d and checked is None and max_tokens is None
    assert type(exc) is error and exc.param == param and exc.status_code == 400


def _reader_pid(w) -> int:
    wait_for(lambda: w.worker.io.reader is not None and w.worker.io.reader.pid is not None)
    return w.worker.io.reader.pid


def test_the_worker_serves_through_its_reader_process(live):
    r, keys, start = live
    w = start()
    assert w.worker.io.reader is not None
    for i in range(5):
        send(r, keys, f"p{i}", max_tokens=4)
    for i in range(5):
        tokens, last = collect(r, keys, f"p{i}-0")
        assert tokens == expected(4) and last.finished
    assert r.xpending(keys.requests("interactive"), GROUP)["pending"] == 0  # all XACKed


def test_the_reader_process_reads_only_what_the_worker_has_room_for(live):
    r, keys, start = live
    w = start(step_s=0.02, max_num_seqs=2)
    for i in range(8):
        send(r, keys, f"room{i}", max_tokens=3)
    most = 0
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        most = max(most, r.xpending(keys.requests("interactive"), GROUP)["pending"])
        if all(r.exists(keys.output(f"room{i}-0")) for i in range(8)) and not w.worker.active:
            break
        time.sleep(0.002)
    for i in range(8):
        assert collect(r, keys, f"room{i}-0")[0] == expected(3)
    assert most <= 2


def test_a_dead_reader_process_is_replaced_and_nothing_is_lost(live):
    r, keys, start = live
    w = start()
    send(r, keys, "before", max_tokens=3)
    assert collect(r, keys, "before-0")[0] == expected(3)
    first = _reader_pid(w)
    os.kill(first, signal.SIGKILL)
    wait_for(lambda: w.worker.io.reader.starts == 2, timeout=10)
    assert w.worker.io.reader.pid != first
    for i in range(3):
        send(r, keys, f"after{i}", max_tokens=3)
    for i in range(3):
        assert collect(r, keys, f"after{i}-0")[0] == expected(3)


_WORKER = textwrap.dedent(
    """
    import sys
    from kernellab.services.worker.loop import Worker
    from tests.unit.services.test_svc_worker import settings
    from tests.support.fake_engine import FakeEngine

    w = Worker(settings(sys.argv[1], sys.argv[2], reader_process=True), engine=FakeEngine(step_s=0.005))
    w.io.start()
    while w.io.reader.pid is None:
        pass
    print(w.io.reader.pid, flush=True)
    w._loop()
    """
)


def test_the_reader_process_dies_with_a_killed_worker(redis_url, prefix):
    proc = subprocess.Popen(
        [sys.executable, "-c", _WORKER, redis_url, prefix],
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.getcwd(),
    )
    try:
        child = int(proc.stdout.readline())
        os.kill(child, 0)  # alive
        proc.kill()  # SIGKILL: no cleanup runs in the worker
        proc.wait(10)

        def gone() -> bool:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                return True
            with open(f"/proc/{child}/stat") as f:  # a zombie until init reaps it counts as gone
                return f.read().split(") ")[-1].startswith("Z")

        wait_for(gone, timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
