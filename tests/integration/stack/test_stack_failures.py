"""Failures through real processes: a worker killed with SIGKILL mid-stream, Redis stopped and restarted, the
gateway drained by SIGTERM. Runs after test_stack_api.py on the shared stack (it ends that stack's life)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from kernellab.runtime.request.sampling import SamplingParams
from tests.support.stack import API_KEY, MODEL, metric, wait_for

pytestmark = pytest.mark.integration

CHATS = [
    [{"role": "user", "content": "Write one sentence about the sea."}],
    [{"role": "user", "content": "What is two plus two?"}],
]
N = 10
# The kill test's plain streams: long enough (EOS ignored) that none can finish between the check that every
# stream is running and the kill, so the killed worker surely holds some of them.
N_LONG = 40
# A structured stream killed mid-way must continue exactly: the survivor rebuilds the grammar from the emitted tokens.
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}


@pytest.fixture(scope="module")
def reference(offline_llm):
    greedy = SamplingParams(max_tokens=N, temperature=0)
    return [offline_llm.generate([m], greedy)[0].text for m in CHATS]


@pytest.fixture(scope="module")
def long_reference(offline_llm):
    params = SamplingParams(max_tokens=N_LONG, temperature=0, ignore_eos=True)
    return [offline_llm.generate([m], params)[0].text for m in CHATS]


@pytest.fixture(scope="module")
def structured_reference(offline_llm):
    params = SamplingParams(max_tokens=N, temperature=0, structured={"json_schema": PERSON})
    return [offline_llm.generate([m], params)[0].text for m in CHATS]


def stream_chat(stack, messages, max_tokens, record: dict, key: str, **extra):
    """Stream one chat completion over raw SSE; record every content delta in order."""
    record[key] = {"deltas": [], "done": False, "error": None}
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True, **extra}
    try:
        with (
            httpx.Client(timeout=180) as http,
            http.stream(
                "POST", f"{stack.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}
            ) as resp,
        ):
            assert resp.status_code == 200, resp.read()
            for line in resp.iter_lines():
                if line == "data: [DONE]":
                    record[key]["done"] = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        record[key]["error"] = event["error"]
                    for choice in event.get("choices", []):
                        record[key]["deltas"].append(choice["delta"].get("content") or "")
    except Exception as exc:
        record[key]["error"] = repr(exc)


def wait_first_token(stack, record: dict, key: str, timeout: float = 60) -> None:
    """Wait for the stream's first delta; a stream that failed instead ends the wait at once, and either failure
    reports the stream's record and the processes' log tails (what a flaky run needs to be understood)."""

    def started():
        r = record.get(key, {})
        return r.get("deltas") or r.get("error")

    try:
        wait_for(started, timeout, f"the first token of stream {key!r}")
    except TimeoutError as exc:
        raise AssertionError(f"{exc}: {record.get(key)}\n{stack.log_tail(40)}") from None
    assert record[key]["deltas"], f"stream {key!r} failed before its first token: {record[key]}\n{stack.log_tail(40)}"


def test_kill_9_of_one_worker_mid_stream_loses_and_duplicates_nothing(stack, long_reference, structured_reference):
    wait_for(lambda: stack.ready(2), 30, "two live workers")
    record: dict = {}
    threads = [
        threading.Thread(
            target=stream_chat, args=(stack, CHATS[i % 2], N_LONG, record, f"s{i}"), kwargs={"ignore_eos": True}
        )
        for i in range(4)
    ]
    threads += [
        threading.Thread(
            target=stream_chat, args=(stack, CHATS[i % 2], N, record, f"j{i}"), kwargs={"response_format": FORMAT}
        )
        for i in range(2)
    ]
    for t in threads:
        t.start()

    def running(i):
        return metric(stack.worker_metrics(i), "kernellab:num_requests_running")

    wait_for(
        lambda: len(record) == 6 and all(len(r["deltas"]) >= 2 for r in record.values()),
        120,
        "every stream to emit tokens",
    )
    busy = {i: running(i) for i in stack.live_workers()}
    busy = {i: n for i, n in busy.items() if n > 0}
    assert busy, "no worker is running the streams"
    victim = max(busy, key=busy.__getitem__)  # the busiest: it holds at least one of the long streams
    stack.kill_worker(victim)
    for t in threads:
        t.join(180)
    survivor = next(i for i in stack.live_workers() if i != victim)
    for i in range(4):
        r = record[f"s{i}"]
        assert r["error"] is None and r["done"], r
        assert "".join(r["deltas"]) == long_reference[i % 2], (i, r["deltas"])
    for i in range(2):
        r = record[f"j{i}"]
        assert r["error"] is None and r["done"], r
        assert "".join(r["deltas"]) == structured_reference[i % 2], (i, r["deltas"])
    assert metric(stack.worker_metrics(survivor), "kernellab:requests_reclaimed_total") >= 1
    wait_for(lambda: metric(stack.worker_metrics(survivor), "kernellab:kv_cache_usage_perc") == 0, 30, "idle")


def test_redis_outage_answers_503_fast_and_recovers(stack, private_redis, reference):
    wait_for(lambda: stack.ready(1), 30, "a live worker")
    auth = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": MODEL, "messages": CHATS[1], "max_tokens": 200, "temperature": 0, "stream": True}
    record: dict = {}
    t = threading.Thread(target=stream_chat, args=(stack, CHATS[1], 200, record, "inflight"))
    t.start()
    wait_first_token(stack, record, "inflight")
    private_redis.stop()
    try:
        start = time.monotonic()
        t.join(15)
        assert not t.is_alive(), "an in-flight stream hung while Redis was down"
        assert record["inflight"]["error"] is not None
        for _ in range(3):
            t0 = time.monotonic()
            resp = httpx.post(
                f"{stack.url}/v1/chat/completions", headers=auth, json={**body, "stream": False}, timeout=10
            )
            assert resp.status_code == 503 and resp.json()["error"]["type"] == "server_error", resp.text
            assert time.monotonic() - t0 < 3.0
            assert httpx.get(f"{stack.url}/ready", timeout=5).status_code == 503
            assert httpx.get(f"{stack.url}/health", timeout=5).status_code == 200
        assert time.monotonic() - start < 30
    finally:
        private_redis.restart()  # same port, empty: the worst case
    wait_for(lambda: stack.ready(1), 60, "/ready after Redis came back", interval=0.5)
    resp = stack.openai().chat.completions.create(model=MODEL, messages=CHATS[0], max_tokens=N, temperature=0)
    assert resp.choices[0].message.content == reference[0]


def test_sigterm_drains_the_gateways_open_streams(stack, reference):
    wait_for(lambda: stack.ready(1), 60, "a live worker")
    record: dict = {}
    t = threading.Thread(target=stream_chat, args=(stack, CHATS[0], N, record, "draining"))
    t.start()
    wait_first_token(stack, record, "draining")
    gateway = stack.procs["gateway"]
    os.kill(gateway.pid, signal.SIGTERM)

    def refusing() -> bool:
        try:
            return httpx.get(f"{stack.url}/ready", timeout=1).status_code == 503
        except httpx.ConnectError:  # the listening socket is closed: also refused
            return True

    wait_for(refusing, 10, "new work to be refused", interval=0.05)
    t.join(120)
    r = record["draining"]
    assert r["error"] is None and r["done"] and "".join(r["deltas"]) == reference[0], r
    gateway.wait(30)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{stack.url}/health", timeout=2)
