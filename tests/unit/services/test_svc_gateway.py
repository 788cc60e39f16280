"""The gateway app in-process (TestClient) against a real Redis and a worker thread with a fake engine."""

import asyncio
import contextlib
import json
import subprocess
import sys
import threading
import time

import pytest
import redis
from fastapi.testclient import TestClient

from kernellab.services.config import GatewaySettings, WorkerSettings
from kernellab.services.gateway.app import create_app
from kernellab.services.queue.keys import Keys
from kernellab.services.queue.protocol import CancelMessage, from_entry
from kernellab.services.worker.loop import Worker
from tests.support.fake_engine import FakeEngine

KEY = "sk-unit"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "smollm2-135m"


def gateway_settings(redis_url, prefix, **kw):
    base = dict(
        redis_url=redis_url,
        key_prefix=prefix,
        model=MODEL,
        api_keys=f"other,{KEY}",
        gateway_metrics_port=0,
        max_body_bytes=4096,
        worker_dead_after_s=2.0,
    )
    return GatewaySettings(**{**base, **kw})


@contextlib.contextmanager
def fake_worker(redis_url, prefix, step_s: float):
    """A worker loop on a thread in front of the fake engine (``step_s`` per step), drained at the end."""
    w = Worker(
        WorkerSettings(
            redis_url=redis_url, key_prefix=prefix, model=MODEL, heartbeat_interval_s=0.05, worker_metrics_port=0
        ),
        engine=FakeEngine(step_s=step_s),
    )
    t = threading.Thread(target=w.run, daemon=True)
    t.start()
    try:
        yield w
    finally:
        w.drain()
        t.join(10)


@pytest.fixture
def worker(redis_url, prefix):
    with fake_worker(redis_url, prefix, 0.003) as w:
        yield w


def wait_ready(c):
    deadline = time.monotonic() + 5
    while c.get("/ready").status_code != 200:
        assert time.monotonic() < deadline, c.get("/ready").json()
        time.sleep(0.05)


@pytest.fixture
def client(redis_url, prefix, tokenizer, worker):
    with TestClient(create_app(gateway_settings(redis_url, prefix), tokenizer=tokenizer)) as c:
        wait_ready(c)
        yield c


def is_openai_error(resp, status, code=None):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code
    return err


def test_health_needs_no_key_and_v1_routes_do(client):
    assert client.get("/health").json() == {"status": "ok"}
    is_openai_error(client.get("/v1/models"), 401, "invalid_api_key")
    is_openai_error(client.get("/v1/models", headers={"Authorization": "Bearer nope"}), 401, "invalid_api_key")
    is_openai_error(client.post("/v1/chat/completions", json={}), 401)
    assert client.get("/v1/models", headers=AUTH).json()["data"][0]["id"] == MODEL


def test_http_level_errors(client):
    is_openai_error(client.post("/v1/completions", content=b"{not json", headers=AUTH), 400)
    is_openai_error(client.post("/v1/completions", content=b"\xff\xfe", headers=AUTH), 400)
    body = {"model": MODEL, "prompt": "x" * 5000}
    is_openai_error(client.post("/v1/completions", json=body, headers=AUTH), 413, "payload_too_large")
    is_openai_error(client.get("/v1/nothing-here", headers=AUTH), 404)
    is_openai_error(client.get("/v1/completions", headers=AUTH), 405)
    err = is_openai_error(client.post("/v1/chat/completions", json={"model": MODEL, "messages": []}, headers=AUTH), 400)
    assert err["param"] == "messages" and err["type"] == "invalid_request_error"
    is_openai_error(
        client.post(
            "/v1/chat/completions",
            json={"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]},
            headers=AUTH,
        ),
        404,
        "model_not_found",
    )


def test_chat_and_completion(client, tokenizer):
    resp = client.post(
        "/v1/chat/completions",
        headers=AUTH,
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
    )
    body = resp.json()
    assert resp.status_code == 200 and body["object"] == "chat.completion"
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 3
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert body["choices"][0]["message"]["content"] == tokenizer.decode(prompt[:3])
    body = client.post(
        "/v1/completions",
        headers=AUTH,
        json={"model": MODEL, "prompt": "Hello there my friend", "max_tokens": 4, "n": 2, "echo": True},
    ).json()
    assert [c["text"] for c in body["choices"]] == ["Hello there my friend" + "Hello there my friend"] * 2
    assert body["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 8,
        "total_tokens": 12,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def sse_events(resp):
    events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_streaming_stop_string_cancels_on_the_worker(client, redis_url, prefix):
    body = {
        "model": MODEL,
        "prompt": "Hello there my friend",
        "max_tokens": 50,
        "stream": True,
        "stop": [" my"],
        "stream_options": {"include_usage": True},
    }
    with client.stream("POST", "/v1/completions", headers=AUTH, json=body) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp)
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == "Hello there"
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "stop"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] >= 3
    r = redis.Redis.from_url(redis_url)
    cancels = [from_entry(f) for _i, f in r.xrange(Keys(prefix, MODEL).cancel)]
    assert cancels and isinstance(cancels[0], CancelMessage) and cancels[0].reason == "stop_string"


def test_chat_stream_shape_and_logprobs(client):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 3,
        "stream": True,
        "logprobs": True,
        "top_logprobs": 1,
    }
    with client.stream("POST", "/v1/chat/completions", headers=AUTH, json=body) as resp:
        events = sse_events(resp)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(e["object"] == "chat.completion.chunk" and "usage" not in e for e in events)
    lps = [c for e in events for c in e["choices"][0]["logprobs"]["content"]]
    assert len(lps) == 3 and all(len(x["top_logprobs"]) == 1 and x["logprob"] == -0.5 for x in lps)


def test_cancel_endpoint(client):
    is_openai_error(client.post("/v1/requests/cmpl-unknown/cancel", headers=AUTH), 404)
    result = {}

    def long_request():
        result["body"] = client.post(
            "/v1/completions", headers=AUTH, json={"model": MODEL, "prompt": "Hello there", "max_tokens": 200}
        ).json()

    t = threading.Thread(target=long_request)
    t.start()
    gw = client.app.state.gateway
    deadline = time.monotonic() + 5
    while not gw.router._subs:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    rid = next(iter(gw.router._subs)).split(":out:")[1].rsplit("-", 1)[0]
    assert client.post(f"/v1/requests/{rid}/cancel", headers=AUTH).json()["cancelled"] is True
    t.join(10)
    assert result["body"]["choices"][0]["finish_reason"] == "abort"


def test_backpressure_is_429_with_retry_after(redis_url, prefix, tokenizer, worker):
    with TestClient(create_app(gateway_settings(redis_url, prefix, max_waiting=0), tokenizer=tokenizer)) as c:
        wait_ready(c)
        resp = c.post("/v1/completions", headers=AUTH, json={"model": MODEL, "prompt": "x", "max_tokens": 1})
        is_openai_error(resp, 429, "rate_limit_exceeded")
        assert resp.headers["retry-after"] == "1"


def test_not_ready_without_workers(redis_url, prefix, tokenizer):
    with TestClient(create_app(gateway_settings(redis_url, prefix), tokenizer=tokenizer)) as c:
        resp = c.get("/ready", headers=AUTH)  # the reason is a detail: key holders only
        assert resp.status_code == 503 and "no live worker" in resp.json()["status"]
        assert c.get("/ready").json() == {"status": "not ready"}
        resp = c.post("/v1/completions", headers=AUTH, json={"model": MODEL, "prompt": "x", "max_tokens": 1})
        is_openai_error(resp, 503, "no_worker")


def test_gateway_never_imports_torch(redis_url, prefix):
    code = (
        "import sys\n"
        "from fastapi.testclient import TestClient\n"
        "from kernellab.services.config import GatewaySettings\n"
        "from kernellab.services.gateway.app import create_app\n"
        f"s = GatewaySettings(redis_url={redis_url!r}, key_prefix={prefix!r}, gateway_metrics_port=0)\n"
        "with TestClient(create_app(s)) as c:\n"
        "    assert c.get('/health').status_code == 200\n"
        "    c.post('/v1/completions', json={'model': 'smollm2-135m', 'prompt': [1, 2], 'max_tokens': 1})\n"
        "print('torch' in sys.modules, 'transformers' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False False"


def test_context_limit_follows_what_live_workers_serve(redis_url, prefix, tokenizer):
    from kernellab.services.gateway.state import Gateway
    from kernellab.services.queue.protocol import Heartbeat

    def gateway(configured, *worker_lens):
        g = Gateway(gateway_settings(redis_url, prefix), tokenizer, MODEL, configured)
        g.live_workers = [Heartbeat(f"w{i}", MODEL, 0.0, max_model_len=n) for i, n in enumerate(worker_lens)]
        return g

    assert gateway(8192).max_model_len == 8192
    assert gateway(8192, 4096, 0).max_model_len == 4096  # a worker started with a shorter context
    assert gateway(0, 2048, 4096).max_model_len == 2048  # a hub id the registry does not know
    assert gateway(0).max_model_len == 1 << 30  # unknown: the worker checks


def test_a_message_the_template_cannot_render_is_a_400(client):
    """A chat message without content is the client's input, not a server fault: a 400 naming the message (a user
    or tool turn; an assistant turn may leave it out, as the API allows)."""
    resp = client.post("/v1/chat/completions", headers=AUTH, json={"model": MODEL, "messages": [{"role": "user"}]})
    is_openai_error(resp, 400)
    assert resp.json()["error"]["param"] == "messages[0].content"
    two = [{"role": "user", "content": "hi"}, {"role": "assistant"}, {"role": "tool", "tool_call_id": "c"}]
    resp = client.post("/v1/chat/completions", headers=AUTH, json={"model": MODEL, "messages": two})
    is_openai_error(resp, 400)
    assert resp.json()["error"]["param"] == "messages[2].content"


class _FailingTemplate:
    """The real tokenizer, except that a chat message "boom" raises an unexpected error (an internal fault)."""

    def __init__(self, tok):
        self._tok = tok

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def render_chat(self, messages, *a, **kw):
        if any(m.get("content") == "boom" for m in messages):
            raise RuntimeError("boom")
        return self._tok.render_chat(messages, *a, **kw)


def _http(sock, body: dict, path: str) -> tuple[int, dict]:
    data = json.dumps(body).encode()
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json"
        f"\r\nContent-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    f = sock.makefile("rb")
    status = int(f.readline().split()[1])
    length = 0
    while (line := f.readline()) not in (b"\r\n", b""):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return status, json.loads(f.read(length))


def test_an_internal_error_is_an_openai_500_and_the_connection_stays_usable(redis_url, prefix, tokenizer, worker):
    import socket

    import uvicorn

    app = create_app(gateway_settings(redis_url, prefix), tokenizer=_FailingTemplate(tokenizer))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            while True:  # the worker's heartbeat must reach the gateway first
                status, body = _http(sock, {"model": MODEL, "prompt": "hi", "max_tokens": 2}, "/v1/completions")
                if status != 503:
                    break
                assert time.monotonic() < deadline, body
                time.sleep(0.05)
            assert status == 200, body
            status, body = _http(
                sock, {"model": MODEL, "messages": [{"role": "user", "content": "boom"}]}, "/v1/chat/completions"
            )
            assert status == 500 and body["error"]["message"] == "internal error: RuntimeError"
            # The same connection answers the next request.
            status, body = _http(sock, {"model": MODEL, "prompt": "hello", "max_tokens": 3}, "/v1/completions")
            assert status == 200 and body["usage"]["completion_tokens"] == 3
            status, body = _http(sock, {"model": MODEL, "prompt": "hi", "max_tokens": -1}, "/v1/completions")
            assert status == 400 and body["error"]["param"] == "max_tokens"
        # The generation routes are served ahead of the middleware stack (GenerationFastPath), and still counted
        # by route template and status, as the metrics middleware counts every other route.
        registry = app.state.gateway.metrics.registry

        def count(route: str, status: str) -> float:
            labels = {"route": route, "method": "POST", "status": status}
            return registry.get_sample_value("kernellab_gateway_http_requests_total", labels) or 0.0

        assert count("/v1/chat/completions", "500") == 1
        assert count("/v1/completions", "400") == 1
        assert count("/v1/completions", "200") >= 2
        assert (
            registry.get_sample_value(
                "kernellab_gateway_http_request_duration_seconds_count", {"route": "/v1/chat/completions"}
            )
            == 1
        )
    finally:
        server.should_exit = True
        thread.join(10)


def _asgi_call(c, path: str, body: dict, disconnect_after_s: float) -> list[dict]:
    """Drive the app at the ASGI level on its own event loop, as uvicorn does (ASGI spec 2.3: ``send`` after a
    disconnect returns quietly): the body, then an ``http.disconnect`` once ``disconnect_after_s`` has passed.
    Returns every message the app sent (a server drops those after the disconnect)."""
    payload = json.dumps(body).encode()
    headers = [(b"authorization", f"Bearer {KEY}".encode()), (b"content-type", b"application/json")]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [*headers, (b"content-length", str(len(payload)).encode())],
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 8000),
    }

    async def run():
        sent: list[dict] = []
        body_sent, gone_at = False, time.monotonic() + disconnect_after_s

        async def receive():
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": payload, "more_body": False}
            await asyncio.sleep(max(0.0, gone_at - time.monotonic()))
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        await c.app(scope, receive, send)
        return sent

    return c.portal.call(run)


def _cancels(redis_url, prefix) -> list:
    """The cancel stream's messages, once there is one (the gateway sends cancels from a task of their own)."""
    r, deadline = redis.Redis.from_url(redis_url), time.monotonic() + 2.0
    while not r.xlen(Keys(prefix, MODEL).cancel) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)  # and no second one
    return [from_entry(f) for _i, f in r.xrange(Keys(prefix, MODEL).cancel)]


@pytest.mark.parametrize("stream", [False, True])
def test_client_gone_before_the_first_token_is_a_499_and_a_cancel(redis_url, prefix, tokenizer, stream):
    """The client leaves while its request waits for a first token (a slow worker step): the gateway answers 499
    (nothing was sent), cancels it on the worker, counts the disconnect and returns its counts."""
    with (
        fake_worker(redis_url, prefix, 2.0),
        TestClient(create_app(gateway_settings(redis_url, prefix), tokenizer=tokenizer)) as c,
    ):
        wait_ready(c)
        gw = c.app.state.gateway
        body = {"model": MODEL, "prompt": "Hello there", "max_tokens": 5, "stream": stream}
        sent = _asgi_call(c, "/v1/completions", body, disconnect_after_s=0.3)
        assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
        assert [(m.reason, m.index) for m in _cancels(redis_url, prefix)] == [("closed", None)]
        assert (
            gw.metrics.registry.get_sample_value("kernellab_gateway_client_disconnects_total", {"model_name": MODEL})
            == 1.0
        )
        assert gw.waiting == 0 and gw.in_flight == 0 and not gw.router._subs


def test_client_gone_mid_stream_ends_the_stream_and_cancels(redis_url, prefix, tokenizer):
    with (
        fake_worker(redis_url, prefix, 0.05),
        TestClient(create_app(gateway_settings(redis_url, prefix), tokenizer=tokenizer)) as c,
    ):
        wait_ready(c)
        gw = c.app.state.gateway
        body = {"model": MODEL, "prompt": "Hello there", "max_tokens": 200, "stream": True}
        started = time.monotonic()
        sent = _asgi_call(c, "/v1/completions", body, disconnect_after_s=0.5)
        assert time.monotonic() - started < 5.0  # not the 10 s the 200 tokens take
        assert sent[0]["status"] == 200 and b"[DONE]" not in b"".join(m.get("body", b"") for m in sent)
        assert any(m.get("body", b"").startswith(b"data: {") for m in sent)
        assert [m.reason for m in _cancels(redis_url, prefix)] == ["closed"]
        assert (
            gw.metrics.registry.get_sample_value("kernellab_gateway_client_disconnects_total", {"model_name": MODEL})
            == 1.0
        )
        assert gw.waiting == 0 and gw.in_flight == 0 and not gw.router._subs


def test_finished_requests_output_streams_are_unlinked(client, redis_url, prefix):
    r = redis.Redis.from_url(redis_url)
    keys = Keys(prefix, MODEL)
    body = client.post("/v1/completions", headers=AUTH, json={"model": MODEL, "prompt": "Hi there", "max_tokens": 2})
    first = keys.output(f"{body.json()['id']}-0")
    deadline = time.monotonic() + 2.0  # FORGET_DELAY_S later at the latest, without another request
    while r.exists(first):
        assert time.monotonic() < deadline, "the finished request's output stream was never unlinked"
        time.sleep(0.01)


def test_a_worker_that_never_answers_ends_in_a_504_at_the_deadline(redis_url, prefix, tokenizer, monkeypatch):
    """A live worker (its heartbeat is fresh) that never writes a token: the gateway's own deadline timer ends the
    request with 504 deadline_exceeded, streaming or not, instead of holding the client forever."""
    from kernellab.services.gateway import generation
    from kernellab.services.queue.protocol import Heartbeat, encode

    monkeypatch.setattr(generation, "DEADLINE_GRACE_S", 0.0)
    keys, r, stop = Keys(prefix, MODEL), redis.Redis.from_url(redis_url), threading.Event()

    def beat():
        while not stop.is_set():
            r.set(
                keys.heartbeat("silent"), encode(Heartbeat("silent", MODEL, time.time(), max_model_len=2048)), px=5000
            )
            r.zadd(keys.workers, {"silent": time.time()})
            stop.wait(0.1)

    beater = threading.Thread(target=beat, daemon=True)
    beater.start()
    try:
        settings = gateway_settings(redis_url, prefix, request_timeout_s=0.4)
        with TestClient(create_app(settings, tokenizer=tokenizer)) as c:
            wait_ready(c)
            for stream in (False, True):
                t = time.monotonic()
                body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": stream}
                resp = c.post("/v1/completions", headers=AUTH, json=body)
                is_openai_error(resp, 504, "deadline_exceeded")
                assert 0.3 < time.monotonic() - t < 5.0
    finally:
        stop.set()
        beater.join(5)


def test_a_worker_that_came_up_since_the_last_poll_serves_at_once(redis_url, prefix, tokenizer, monkeypatch):
    """Each gateway process reads the live workers on its own clock: one that has not polled since a worker came
    up reads them again before turning a request away with 503, so a tier of processes serves a new worker from
    its first request on any of them (the readiness poll is slowed here so that only that read can see it)."""
    from kernellab.services.gateway import state

    monkeypatch.setattr(state, "POLL_INTERVAL_S", 60.0)
    keys, r = Keys(prefix, MODEL), redis.Redis.from_url(redis_url)
    with TestClient(create_app(gateway_settings(redis_url, prefix), tokenizer=tokenizer)) as c:
        assert c.get("/ready").status_code == 503  # the startup poll found no worker
        with fake_worker(redis_url, prefix, 0.003):
            deadline = time.monotonic() + 10
            while r.zscore(keys.workers, next(iter(r.zrange(keys.workers, 0, -1)), b"")) is None:
                assert time.monotonic() < deadline, "the worker never registered"
                time.sleep(0.01)
            resp = c.post("/v1/completions", headers=AUTH, json={"model": MODEL, "prompt": "x", "max_tokens": 2})
            assert resp.status_code == 200, resp.text
            assert resp.json()["usage"]["completion_tokens"] == 2
