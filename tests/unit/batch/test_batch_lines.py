"""The batch line formats: envelope checks, input order and counting, output and error line shapes."""

from __future__ import annotations

import json

import pytest

from kernellab.runtime.request.errors import InvalidRequestError
from kernellab.services.batch import lines as L


def line(custom_id="q1", url="/v1/chat/completions", body=None, **extra) -> str:
    obj = {"custom_id": custom_id, "method": "POST", "url": url, "body": body or {"model": "m"}, **extra}
    return json.dumps(obj)


@pytest.mark.parametrize(
    ("text", "code"),
    [
        ("{not json", "invalid_json_line"),
        ("[1, 2]", "invalid_json_line"),
        (json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}), "invalid_custom_id"),
        (line(custom_id=""), "invalid_custom_id"),
        (line(custom_id=7), "invalid_custom_id"),
        (line(custom_id="x" * 513), "invalid_custom_id"),
        (line(url="/v1/embeddings"), "invalid_url"),
        (line(url=None), "invalid_url"),
        (line(method="GET"), "invalid_method"),
        (json.dumps({"custom_id": "q", "url": "/v1/completions"}), "missing_body"),
    ],
)
def test_envelope_errors_name_the_line(text, code):
    parsed = L.parse_line(text, 4, 9, set())
    assert parsed.error is not None and parsed.error.code == code
    assert "line 9" in parsed.error.message and parsed.index == 4


def test_first_occurrence_of_a_custom_id_wins():
    seen: set[str] = set()
    first = L.parse_line(line("dup", "/v1/completions"), 0, 1, seen)
    second = L.parse_line(line("dup"), 1, 2, seen)
    assert first.error is None and first.kind == "completion"
    assert second.error.code == "duplicate_custom_id" and second.custom_id == "dup"
    # A line refused for another reason does not claim its id.
    seen = set()
    assert L.parse_line(line("a", url="/v1/nope"), 0, 1, seen).error.code == "invalid_url"
    assert L.parse_line(line("b"), 1, 2, seen).error is None


def test_iter_input_skips_blank_lines_and_counts_as_the_upload_does(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(("\n".join([line("a"), "", "   ", line("b", "/v1/completions") + "\r", "{bad"]) + "\n\n").encode())
    parsed = list(L.iter_input(path))
    assert [(p.index, p.lineno, p.custom_id) for p in parsed] == [(0, 1, "a"), (1, 4, "b"), (2, 5, None)]
    assert parsed[1].error is None and parsed[1].kind == "completion"
    assert parsed[2].error.code == "invalid_json_line"
    assert L.count_lines(path) == 3


def test_output_line_shapes():
    ok = L.success_line("q1", "req_1", {"object": "chat.completion"})
    assert ok["id"].startswith("batch_req_") and ok["error"] is None
    assert ok["response"] == {"status_code": 200, "request_id": "req_1", "body": {"object": "chat.completion"}}
    assert L.is_success(ok)
    refused = L.http_error_line("q2", "req_2", InvalidRequestError("bad temperature", param="temperature"))
    assert refused["response"]["status_code"] == 400 and not L.is_success(refused)
    assert refused["response"]["body"]["error"]["param"] == "temperature"
    broken = L.envelope_error_line(None, L.LineError("invalid_json_line", "line 3 is not valid JSON"))
    assert broken["response"] is None and broken["error"] == {
        "code": "invalid_json_line",
        "message": "line 3 is not valid JSON",
    }
    assert "\n" not in L.dumps({"text": "a\nb"}) and json.loads(L.dumps({"é": "ü"})) == {"é": "ü"}
