"""The /v1/files and /v1/batches routes inside the gateway app (TestClient, real Redis): the gateway's API key
and OpenAI error objects apply to them; a created batch is a Celery message on the prefixed queue."""

from __future__ import annotations

import base64
import json

import pytest
import redis
from fastapi.testclient import TestClient

from kernellab.runtime.request.registry import DEFAULT_CPU_MODEL as MODEL
from kernellab.services.batch.celery_app import TASK_NAME
from kernellab.services.config import GatewaySettings
from kernellab.services.gateway.app import create_app

KEY = "sk-batch-unit"
AUTH = {"Authorization": f"Bearer {KEY}"}
LINE = (
    json.dumps(
        {
            "custom_id": "a",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": MODEL, "prompt": "hi", "max_tokens": 2},
        }
    )
    + "\n"
)


@pytest.fixture
def client(redis_url, prefix, tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("KERNELLAB_FILES_DIR", str(tmp_path / "files"))
    monkeypatch.setenv("KERNELLAB_BATCH_MAX_FILE_BYTES", "4096")
    monkeypatch.setenv("KERNELLAB_BATCH_MAX_LINES", "5")
    settings = GatewaySettings(
        redis_url=redis_url, key_prefix=prefix, model=MODEL, api_keys=KEY, gateway_metrics_port=0
    )
    with TestClient(create_app(settings, tokenizer=tokenizer)) as c:
        yield c


def openai_error(resp, status: int, param=None, code=None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def upload(client, data: bytes = LINE.encode(), purpose: str = "batch", headers=AUTH):
    return client.post(
        "/v1/files", files={"file": ("in.jsonl", data, "application/jsonl")}, data={"purpose": purpose}, headers=headers
    )


def queued_batch_ids(redis_url, prefix) -> list[str]:
    out = []
    for raw in redis.Redis.from_url(redis_url).lrange(f"{prefix}celery:kernellab.batch", 0, -1):
        envelope = json.loads(raw)
        assert envelope["headers"]["task"] == TASK_NAME
        args, _kwargs, _embed = json.loads(base64.b64decode(envelope["body"]))
        out.append(args[0])
    return out


def test_routes_need_the_gateways_api_key(client):
    openai_error(upload(client, headers={}), 401, code="invalid_api_key")
    openai_error(client.get("/v1/files/file-" + "0" * 24), 401)
    openai_error(client.get("/v1/batches"), 401)
    openai_error(client.post("/v1/batches/batch_x/cancel", headers={"Authorization": "Bearer nope"}), 401)


def test_file_lifecycle(client):
    meta = upload(client).json()
    assert meta["object"] == "file" and meta["purpose"] == "batch" and meta["bytes"] == len(LINE.encode())
    assert client.get(f"/v1/files/{meta['id']}", headers=AUTH).json() == meta
    content = client.get(f"/v1/files/{meta['id']}/content", headers=AUTH)
    assert content.status_code == 200 and content.content == LINE.encode()
    assert client.delete(f"/v1/files/{meta['id']}", headers=AUTH).json() == {
        "id": meta["id"],
        "object": "file",
        "deleted": True,
    }
    for resp in (
        client.get(f"/v1/files/{meta['id']}", headers=AUTH),
        client.get(f"/v1/files/{meta['id']}/content", headers=AUTH),
        client.delete(f"/v1/files/{meta['id']}", headers=AUTH),
        client.get("/v1/files/..%2F..%2Fetc%2Fpasswd", headers=AUTH),
    ):
        openai_error(resp, 404)


def test_upload_errors(client):
    openai_error(upload(client, purpose="fine-tune"), 400, param="purpose")
    openai_error(upload(client, data=b"x" * 5000), 413, code="payload_too_large")
    openai_error(upload(client, data=LINE.encode() * 6), 400, param="file")
    openai_error(upload(client, data=b"\xff\xfe{}\n"), 400, param="file")
    openai_error(upload(client, data=b"\n\n"), 400, param="file")
    openai_error(client.post("/v1/files", json={"purpose": "batch"}, headers=AUTH), 400)
    openai_error(
        client.post("/v1/files", data={"purpose": "batch"}, files={"other": ("x", b"{}")}, headers=AUTH),
        400,
        param="file",
    )


def test_create_get_list_cancel(client, redis_url, prefix):
    file_id = upload(client).json()["id"]
    body = {
        "input_file_id": file_id,
        "endpoint": "/v1/completions",
        "completion_window": "24h",
        "metadata": {"team": "search"},
    }
    created = [client.post("/v1/batches", json=body, headers=AUTH).json() for _ in range(3)]
    b = created[0]
    assert b["object"] == "batch" and b["status"] == "validating" and b["id"].startswith("batch_")
    assert b["input_file_id"] == file_id and b["metadata"] == {"team": "search"} and b["model"] == MODEL
    assert b["expires_at"] - b["created_at"] == 86400
    assert queued_batch_ids(redis_url, prefix) == [c["id"] for c in created][::-1]  # LPUSH: newest first
    assert client.get(f"/v1/batches/{b['id']}", headers=AUTH).json() == b
    page = client.get("/v1/batches?limit=2", headers=AUTH).json()
    assert [x["id"] for x in page["data"]] == [created[2]["id"], created[1]["id"]] and page["has_more"]
    assert page["object"] == "list" and page["first_id"] == created[2]["id"] and page["last_id"] == created[1]["id"]
    rest = client.get(f"/v1/batches?limit=2&after={page['last_id']}", headers=AUTH).json()
    assert [x["id"] for x in rest["data"]] == [b["id"]] and not rest["has_more"]
    openai_error(client.get("/v1/batches?limit=0", headers=AUTH), 400)

    cancelled = client.post(f"/v1/batches/{b['id']}/cancel", headers=AUTH).json()
    assert cancelled["status"] == "cancelling" and cancelled["cancelling_at"]
    assert client.post(f"/v1/batches/{b['id']}/cancel", headers=AUTH).json()["status"] == "cancelling"
    r = redis.Redis.from_url(redis_url)
    r.hset(f"{prefix}batch:{created[1]['id']}", "status", "completed")
    openai_error(client.post(f"/v1/batches/{created[1]['id']}/cancel", headers=AUTH), 400, code="batch_not_cancellable")
    openai_error(client.post("/v1/batches/batch_nope/cancel", headers=AUTH), 404)
    openai_error(client.get("/v1/batches/batch_nope", headers=AUTH), 404)


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"endpoint": "/v1/embeddings"}, "endpoint"),
        ({"completion_window": "1h"}, "completion_window"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k": "v" * 513}}, "metadata"),
        ({"input_file_id": "file-" + "0" * 24}, "input_file_id"),
        ({"input_file_id": 5}, None),
        ({"endpoint": None}, None),
    ],
)
def test_create_validation(client, redis_url, prefix, change, param):
    file_id = upload(client).json()["id"]
    body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h", **change}
    openai_error(client.post("/v1/batches", json=body, headers=AUTH), 400, param=param)
    assert queued_batch_ids(redis_url, prefix) == []


def test_output_files_are_not_batch_inputs(client, tmp_path):
    from kernellab.services.batch.files import FileStore

    out = FileStore(tmp_path / "files").save_output("file-" + "ab" * 12, "x_output.jsonl", ["{}"])
    body = {"input_file_id": out["id"], "endpoint": "/v1/completions", "completion_window": "24h"}
    openai_error(client.post("/v1/batches", json=body, headers=AUTH), 400, param="input_file_id")


def test_no_batch_is_left_behind_when_the_queue_is_down(redis_url, prefix, tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("KERNELLAB_FILES_DIR", str(tmp_path / "files"))
    monkeypatch.setenv("KERNELLAB_CELERY_BROKER_URL", "redis://127.0.0.1:1/0")
    settings = GatewaySettings(
        redis_url=redis_url, key_prefix=prefix, model=MODEL, api_keys=KEY, gateway_metrics_port=0
    )
    with TestClient(create_app(settings, tokenizer=tokenizer)) as c:
        file_id = upload(c).json()["id"]
        body = {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"}
        openai_error(c.post("/v1/batches", json=body, headers=AUTH), 503, code="queue_unavailable")
        assert c.get("/v1/batches", headers=AUTH).json()["data"] == []
