"""Security of the running stack: every route but /health needs a key, /ready tells details only to a key
holder, metrics and API listen on 127.0.0.1 by default, and one tenant (API key) can neither cancel nor read
another's requests, files or batches."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from kernellab.services.config import GatewaySettings
from tests.support.reliability import KEY, MODEL, OTHER, auth, is_openai_error

pytestmark = pytest.mark.integration

DUMMY = {"file_id": "file-" + "0" * 24, "batch_id": "batch_" + "0" * 24, "request_id": "chatcmpl-" + "0" * 32}


def gateway_routes() -> list[tuple[str, str]]:
    """(method, path) of every route the gateway app declares, read from the app's own OpenAPI document
    (included routers too), so a new route is covered the day it is added."""
    from kernellab.services.gateway.app import create_app

    app = create_app(GatewaySettings(gateway_metrics_port=0), tokenizer=object())
    return [(method.upper(), path) for path, ops in app.openapi()["paths"].items() for method in ops]


ROUTES = gateway_routes()


def test_the_route_list_covers_the_api():
    paths = {p for _, p in ROUTES}
    for expected in (
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/v1/requests/{request_id}/cancel",
        "/ready",
        "/health",
        "/v1/files",
        "/v1/files/{file_id}",
        "/v1/files/{file_id}/content",
        "/v1/batches",
        "/v1/batches/{batch_id}",
        "/v1/batches/{batch_id}/cancel",
    ):
        assert expected in paths, f"{expected} is gone from the app: update this test"


@pytest.mark.parametrize(("method", "path"), [r for r in ROUTES if r[1] not in ("/health", "/ready")], ids=lambda v: v)
def test_every_route_needs_a_key(rstack, method, path):
    url = rstack.url + re.sub(r"\{(\w+)\}", lambda m: DUMMY.get(m.group(1), "x"), path)
    for headers in (
        {},
        auth("sk-wrong"),
        {"Authorization": "Bearer"},
        {"Authorization": f"Basic {KEY}"},
        {"X-Api-Key": KEY},
    ):
        resp = httpx.request(method, url, headers=headers, json={}, params={"api_key": KEY}, timeout=10)
        err = is_openai_error(resp, 401)
        assert err["code"] == "invalid_api_key" and resp.headers.get("www-authenticate") == "Bearer", (path, headers)


def test_health_is_open_and_says_nothing(rstack):
    resp = httpx.get(f"{rstack.url}/health", timeout=5)
    assert resp.status_code == 200 and resp.json() == {"status": "ok"}


def test_ready_gives_details_only_to_a_key_holder(rstack):
    anonymous = httpx.get(f"{rstack.url}/ready", timeout=5)
    assert anonymous.status_code == 200  # probes need no key: the status code is the answer
    assert anonymous.json() == {"status": "ready"}, "model and worker count must not leak without a key"
    wrong = httpx.get(f"{rstack.url}/ready", headers=auth("sk-wrong"), timeout=5)
    assert wrong.status_code == 200 and wrong.json() == {"status": "ready"}
    detailed = httpx.get(f"{rstack.url}/ready", headers=auth(), timeout=5).json()
    assert detailed["model"] == MODEL and detailed["workers"] == 2


def test_no_docs_or_schema_routes_are_served(rstack):
    for path in ("/docs", "/redoc", "/openapi.json", "/metrics"):
        assert httpx.get(rstack.url + path, timeout=5).status_code in (401, 404), path


def _listening(port: int) -> set[str]:
    """Local addresses of the LISTEN sockets on ``port`` (from /proc/net/tcp and tcp6)."""
    found = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        path = Path(table)
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            addr, _, hexport = fields[1].partition(":")
            if int(hexport, 16) == port and fields[3] == "0A":  # 0A: LISTEN
                if width == 8:
                    found.add(".".join(str(int(addr[i : i + 2], 16)) for i in (6, 4, 2, 0)))
                else:
                    found.add("::1" if addr == "0" * 24 + "01000000" else addr)
    return found


def test_metrics_and_api_ports_listen_on_loopback_only(rstack):
    assert "KERNELLAB_METRICS_HOST" not in rstack.env, "the stack must run with the default metrics host"
    ports = {"gateway API": rstack.port, "gateway metrics": rstack.gateway_metrics_port}
    ports.update({f"worker {i} metrics": p for i, p in enumerate(rstack.worker_ports)})
    for name, port in ports.items():
        addresses = _listening(port)
        assert addresses == {"127.0.0.1"}, f"{name} (:{port}) listens on {addresses or 'nothing'}"


def test_local_defaults_bind_loopback(monkeypatch):
    for var in ("KERNELLAB_METRICS_HOST", "KERNELLAB_HOST"):
        monkeypatch.delenv(var, raising=False)
    settings = GatewaySettings()
    assert settings.metrics_host == "127.0.0.1" and settings.host == "127.0.0.1"


def _stream_first_id(http: httpx.Client, lines) -> str:
    for line in lines:
        if line.startswith("data: "):
            return json.loads(line[6:])["id"]
    raise AssertionError("the stream ended before its first chunk")


def test_a_tenant_cannot_cancel_another_tenants_request(rstack):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Count to one thousand."}],
        "max_tokens": 1000,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", f"{rstack.url}/v1/chat/completions", json=body, headers=auth(KEY)) as resp,
    ):
        assert resp.status_code == 200
        lines = resp.iter_lines()
        request_id = _stream_first_id(http, lines)
        theirs = httpx.post(f"{rstack.url}/v1/requests/{request_id}/cancel", headers=auth(OTHER), timeout=10)
        assert is_openai_error(theirs, 404)["code"] == "not_found"
        after = [line for _, line in zip(range(12), lines, strict=False) if line.startswith("data: ")]
        assert len(after) >= 3 and all("error" not in json.loads(x[6:]) for x in after), after
        mine = httpx.post(f"{rstack.url}/v1/requests/{request_id}/cancel", headers=auth(KEY), timeout=10)
        assert mine.status_code == 200 and mine.json()["cancelled"] is True
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest and rest[-1] == "data: [DONE]" and len(rest) < 900, "the owner's cancel must end the stream"


def test_a_tenant_cannot_see_or_touch_another_tenants_files_and_batches(rstack):
    line = {
        "custom_id": "a",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    }
    up = httpx.post(
        f"{rstack.url}/v1/files",
        headers=auth(KEY),
        data={"purpose": "batch"},
        files={"file": ("in.jsonl", json.dumps(line).encode() + b"\n")},
        timeout=30,
    )
    assert up.status_code == 200, up.text
    file_id = up.json()["id"]
    assert "owner" not in up.json()
    batch = httpx.post(
        f"{rstack.url}/v1/batches",
        headers=auth(KEY),
        timeout=30,
        json={"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    )
    assert batch.status_code == 200, batch.text
    batch_id = batch.json()["id"]
    base = rstack.url
    other = auth(OTHER)
    for method, path in (
        ("GET", f"/v1/files/{file_id}"),
        ("GET", f"/v1/files/{file_id}/content"),
        ("DELETE", f"/v1/files/{file_id}"),
        ("GET", f"/v1/batches/{batch_id}"),
        ("POST", f"/v1/batches/{batch_id}/cancel"),
    ):
        resp = httpx.request(method, base + path, headers=other, timeout=10)
        assert is_openai_error(resp, 404)["code"] == "not_found", (method, path)
    reuse = httpx.post(
        f"{base}/v1/batches",
        headers=other,
        timeout=10,
        json={"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    )
    is_openai_error(reuse, 400)
    listed = httpx.get(f"{base}/v1/batches", headers=other, timeout=10).json()
    assert batch_id not in [b["id"] for b in listed["data"]]
    # The owner still has everything.
    assert httpx.get(f"{base}/v1/files/{file_id}", headers=auth(KEY), timeout=10).status_code == 200
    assert httpx.get(f"{base}/v1/batches/{batch_id}", headers=auth(KEY), timeout=10).json()["id"] == batch_id
    assert batch_id in [b["id"] for b in httpx.get(f"{base}/v1/batches", headers=auth(KEY), timeout=10).json()["data"]]
    cancel = httpx.post(f"{base}/v1/batches/{batch_id}/cancel", headers=auth(KEY), timeout=10)
    assert cancel.status_code == 200 and cancel.json()["status"] in ("cancelling", "cancelled"), cancel.text
