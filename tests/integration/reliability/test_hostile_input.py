"""A hand-written list of hostile requests against the running gateway: each must get a 4xx OpenAI error
object (or a normal answer), quickly, never a 5xx; and the stack must still serve afterwards."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from tests.support.reliability import KEY, MODEL, auth, is_openai_error

pytestmark = pytest.mark.integration

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
JSON = {"Content-Type": "application/json"}


def chat(**kw) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **kw}).encode()


def nested(depth: int) -> bytes:
    return b'{"model": "' + MODEL.encode() + b'", "messages": ' + b"[" * depth + b"]" * depth + b"}"


# (id, path, raw body, extra headers). A body of bytes is sent as is: invalid JSON and invalid UTF-8 included.
CASES = [
    ("deeply-nested-array", CHAT, nested(100_000), JSON),
    (
        "deeply-nested-object",
        CHAT,
        b'{"model": "x", "stream_options": ' + b'{"a":' * 50_000 + b"1" + b"}" * 50_001,
        JSON,
    ),
    ("huge-string-over-body-limit", CHAT, chat(messages=[{"role": "user", "content": "a" * (2 << 20)}]), JSON),
    ("huge-string-under-body-limit", CHAT, chat(messages=[{"role": "user", "content": "word " * 200_000}]), JSON),
    ("huge-token-id-list", COMPLETIONS, json.dumps({"model": MODEL, "prompt": [1] * 200_000}).encode(), JSON),
    (
        "invalid-utf8",
        CHAT,
        b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
        JSON,
    ),
    ("lone-surrogate", CHAT, chat(messages=[{"role": "user", "content": "\ud800"}]), JSON),
    ("lone-surrogate-in-stop", CHAT, chat(stop=["\udfff"]), JSON),
    ("control-chars-in-stop", CHAT, chat(stop=["\u0000", "\x1b[31m", "\r\n\t\x7f"]), JSON),
    ("many-long-stop-strings", CHAT, chat(stop=["x" * 20_000] * 40), JSON),
    ("nul-in-content", CHAT, chat(messages=[{"role": "user", "content": "a\u0000b"}]), JSON),
    ("negative-max-tokens", CHAT, chat(max_tokens=-1), JSON),
    ("enormous-max-tokens", CHAT, chat(max_tokens=10**30), JSON),
    ("enormous-n", CHAT, chat(n=10**20), JSON),
    ("negative-n", CHAT, chat(n=-3), JSON),
    ("enormous-seed", CHAT, chat(seed=2**64), JSON),
    ("negative-seed", CHAT, chat(seed=-1), JSON),
    ("enormous-temperature", CHAT, chat(temperature=1e308), JSON),
    ("negative-temperature", CHAT, chat(temperature=-0.5), JSON),
    ("nan-temperature", CHAT, chat().replace(b'"max_tokens": 2', b'"max_tokens": 2, "temperature": NaN'), JSON),
    ("infinite-top-p", CHAT, chat().replace(b'"max_tokens": 2', b'"max_tokens": 2, "top_p": Infinity'), JSON),
    (
        "negative-infinite-penalty",
        CHAT,
        chat().replace(b'"max_tokens": 2', b'"max_tokens": 2, "presence_penalty": -Infinity'),
        JSON,
    ),
    ("huge-float-literal", CHAT, chat().replace(b'"max_tokens": 2', b'"max_tokens": 2, "temperature": 1e999'), JSON),
    ("huge-int-literal", CHAT, chat().replace(b'"max_tokens": 2', b'"max_tokens": ' + b"9" * 5000), JSON),
    ("enormous-top-logprobs", CHAT, chat(logprobs=True, top_logprobs=10**9), JSON),
    (
        "enormous-completion-logprobs",
        COMPLETIONS,
        json.dumps({"model": MODEL, "prompt": "a", "logprobs": 10**9, "max_tokens": 1}).encode(),
        JSON,
    ),
    ("negative-top-k", CHAT, chat(top_k=-7), JSON),
    ("token-id-out-of-range", COMPLETIONS, json.dumps({"model": MODEL, "prompt": [10**12, -1]}).encode(), JSON),
    ("wrong-types", CHAT, chat(stream="true", max_tokens="5", temperature=[1]), JSON),
    ("messages-not-objects", CHAT, chat(messages=[1, "two", None]), JSON),
    ("message-content-object", CHAT, chat(messages=[{"role": "user", "content": {"nested": {"deep": 1}}}]), JSON),
    ("image-part", CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]), JSON),
    ("role-missing", CHAT, chat(messages=[{"content": "hi"}]), JSON),
    ("unknown-role", CHAT, chat(messages=[{"role": "\u202eresu", "content": "hi"}]), JSON),
    ("ten-thousand-messages", CHAT, chat(messages=[{"role": "user", "content": "hi"}] * 10_000), JSON),
    ("empty-messages", CHAT, chat(messages=[]), JSON),
    ("top-level-array", CHAT, b"[1, 2, 3]", JSON),
    ("top-level-string", CHAT, b'"hello"', JSON),
    ("null-body", CHAT, b"null", JSON),
    ("empty-body", CHAT, b"", JSON),
    ("truncated-json", CHAT, chat()[:-7], JSON),
    ("duplicate-keys", CHAT, b'{"model": "x", "model": "' + MODEL.encode() + b'", "messages": 5}', JSON),
    ("unknown-model", CHAT, chat(model="../../etc/passwd"), JSON),
    ("model-home-of-unknown-user", COMPLETIONS, json.dumps({"model": "~nosuchuser/m", "prompt": "a"}).encode(), JSON),
    ("model-local-directory", CHAT, chat(model="/"), JSON),
    ("text-plain", CHAT, b"model=smollm2-135m", {"Content-Type": "text/plain"}),
    ("form-urlencoded", CHAT, b"model=smollm2-135m&messages=hi", {"Content-Type": "application/x-www-form-urlencoded"}),
    ("xml", CHAT, b"<?xml version='1.0'?><model>x</model>", {"Content-Type": "application/xml"}),
    (
        "multipart-to-chat",
        CHAT,
        b'--b\r\nContent-Disposition: form-data; name="model"\r\n\r\nx\r\n--b--\r\n',
        {"Content-Type": "multipart/form-data; boundary=b"},
    ),
    ("json-to-files", "/v1/files", b'{"purpose": "batch"}', JSON),
    (
        "broken-multipart-to-files",
        "/v1/files",
        b'--b\r\nContent-Disposition: form-data; name="file"',
        {"Content-Type": "multipart/form-data; boundary=b"},
    ),
    ("multipart-without-boundary", "/v1/files", b"garbage", {"Content-Type": "multipart/form-data"}),
    (
        "batch-metadata-flood",
        "/v1/batches",
        json.dumps(
            {
                "input_file_id": "file-" + "0" * 24,
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
                "metadata": {str(i): "v" * 600 for i in range(100)},
            }
        ).encode(),
        JSON,
    ),
    ("batch-wrong-types", "/v1/batches", b'{"input_file_id": 7, "endpoint": null, "completion_window": []}', JSON),
    ("batch-deeply-nested", "/v1/batches", b'{"metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", JSON),
    (
        "batch-lone-surrogate-metadata",
        "/v1/batches",
        json.dumps(
            {
                "input_file_id": "file-" + "0" * 24,
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
                "metadata": {"k": "\ud800"},
            }
        ).encode(),
        JSON,
    ),
    ("stream-options-garbage", CHAT, chat(stream=True, stream_options={"include_usage": {"x": [1]}}), JSON),
    (
        "echo-with-logprobs-token-prompt",
        COMPLETIONS,
        json.dumps(
            {"model": MODEL, "prompt": [[1, 2], [3]], "echo": True, "logprobs": 2, "max_tokens": 1, "n": 2}
        ).encode(),
        JSON,
    ),
]


@pytest.mark.parametrize(("path", "body", "headers"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_hostile_request_gets_a_clean_4xx_or_an_answer(rstack, path, body, headers):
    t0 = time.monotonic()
    resp = httpx.post(rstack.url + path, content=body, headers={**auth(), **headers}, timeout=60)
    elapsed = time.monotonic() - t0
    assert resp.status_code < 500, (resp.status_code, resp.text[:300])
    if resp.status_code >= 400:
        is_openai_error(resp)
    else:
        text = resp.text
        assert text.startswith("{") or text.startswith("data: "), text[:200]
    assert elapsed < 30, f"took {elapsed:.1f}s"


def test_the_stack_still_serves_after_the_hostile_list(rstack):
    resp = httpx.post(rstack.url + CHAT, content=chat(max_tokens=3), headers={**auth(), **JSON}, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] <= 3
    assert rstack.ready_workers() == 2, rstack.log_tail()
    for name, proc in rstack.procs.items():
        assert proc.poll() is None, f"{name} died: {rstack.log_tail()}"


def test_a_lying_content_length_is_refused_before_the_body(rstack):
    """Declares ~1 GB, sends 20 bytes: answered 413 at once (no wait for bytes that never come)."""
    with socket.create_connection(("127.0.0.1", rstack.port), timeout=10) as sock:
        sock.sendall(
            (
                f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                'Content-Type: application/json\r\nContent-Length: 999999999\r\n\r\n{"model": 1}'
            ).encode()
        )
        head = sock.recv(65536).decode(errors="replace")
    assert head.startswith("HTTP/1.1 413"), head[:200]
