"""The Batch API through the official OpenAI client against real processes (gateway, engine worker, Celery
batch worker, Redis), and ``kernellab batch`` offline on the same inputs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.batch import (
    body_text,
    chat_line,
    comparable,
    completion_line,
    file_lines,
    logprob_values,
    mixed_lines,
    reference_texts,
    start_batch,
    wait_batch,
    write_jsonl,
)
from tests.support.stack import MODEL

pytestmark = pytest.mark.integration


def run_offline(tmp_path, input_path):
    out, errors = tmp_path / "offline.jsonl", tmp_path / "offline.errors.jsonl"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kernellab",
            "batch",
            "-i",
            str(input_path),
            "-o",
            str(out),
            "--errors",
            str(errors),
            "--model",
            MODEL,
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--num-kv-blocks",
            "512",
            "--max-num-seqs",
            "32",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "lines in" in proc.stderr  # the summary under the progress bar

    def read(path):
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    return read(out), read(errors)


def test_200_lines_equal_the_engines_greedy_outputs(client, offline_llm, tmp_path):
    lines = mixed_lines(200)
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    created = start_batch(client, path)
    assert created.status == "validating" and created.request_counts.total == 0
    b = wait_batch(client, created.id)
    assert b.status == "completed", b
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (200, 200, 0)
    assert b.in_progress_at and b.finalizing_at and b.completed_at and b.error_file_id is None
    out = file_lines(client, b.output_file_id)
    assert [x["custom_id"] for x in out] == [x["custom_id"] for x in lines]  # input order
    reference = reference_texts(offline_llm, lines)
    for line, request, ref in zip(out, lines, reference, strict=True):
        body = line["response"]["body"]
        assert line["response"]["status_code"] == 200 and line["error"] is None
        assert body["object"] == ("chat.completion" if "messages" in request["body"] else "text_completion")
        assert body_text(line) == ref.text, line["custom_id"]
        assert body["choices"][0]["finish_reason"] == ref.finish_reason
        assert body["usage"]["completion_tokens"] == len(ref.token_ids)
    assert b.usage.output_tokens == sum(len(r.token_ids) for r in reference)


def test_malformed_lines_land_in_the_error_file_and_offline_writes_the_same_lines(client, tmp_path):
    lines = [
        chat_line("ok-chat", "Name a primary color.", 4),
        "{this is not json",
        completion_line("ok-completion", "One, two, three,", 4),
        {"custom_id": "embed", "method": "POST", "url": "/v1/embeddings", "body": {"model": MODEL, "input": "x"}},
        completion_line("negative-temperature", "x", 4, temperature=-0.5),
        completion_line("string-max-tokens", "x", max_tokens="4"),
        chat_line("wrong-model", "x", 4, model="gpt-4o"),
        chat_line("ok-chat", "A duplicate custom_id.", 4),
        {"method": "POST", "url": "/v1/completions", "body": {"model": MODEL, "prompt": "no custom_id"}},
        {"custom_id": "get", "method": "GET", "url": "/v1/completions", "body": {}},
        completion_line("ok-logprobs", "The sky is", 3, logprobs=2),
        chat_line("ok-n2-stop", "Count from one to ten.", 12, n=2, stop=[","]),
    ]
    path = write_jsonl(tmp_path / "bad.jsonl", lines)
    b = wait_batch(client, start_batch(client, path).id, timeout=120)
    assert b.status == "completed"
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (12, 4, 8)
    out = file_lines(client, b.output_file_id)
    errors = file_lines(client, b.error_file_id)
    assert [x["custom_id"] for x in out] == ["ok-chat", "ok-completion", "ok-logprobs", "ok-n2-stop"]
    assert len(out[2]["response"]["body"]["choices"][0]["logprobs"]["tokens"]) == 3
    assert len(out[3]["response"]["body"]["choices"]) == 2
    reasons = [(x["custom_id"], x["error"]["code"] if x["error"] else x["response"]["status_code"]) for x in errors]
    assert reasons == [
        (None, "invalid_json_line"),
        ("embed", "invalid_url"),
        ("negative-temperature", 400),
        ("string-max-tokens", 400),
        ("wrong-model", 404),
        ("ok-chat", "duplicate_custom_id"),
        (None, "invalid_custom_id"),
        ("get", "invalid_method"),
    ]
    for x in errors:  # every error says why
        message = x["error"]["message"] if x["error"] else x["response"]["body"]["error"]["message"]
        assert message
    assert errors[2]["response"]["body"]["error"]["param"] == "temperature"
    assert errors[3]["response"]["body"]["error"]["param"] == "max_tokens"
    assert errors[4]["response"]["body"]["error"]["code"] == "model_not_found"

    offline_out, offline_errors = run_offline(tmp_path, path)
    assert [comparable(x) for x in offline_out] == [comparable(x) for x in out]
    assert [comparable(x) for x in offline_errors] == [comparable(x) for x in errors]
    assert logprob_values(offline_out[2]) == pytest.approx(logprob_values(out[2]), abs=1e-3)


def test_structured_and_tool_call_lines_answer_as_the_api_does(client, tmp_path):
    """A batch line with a JSON schema answers JSON that validates; one with a forced tool call answers
    ``tool_calls`` with ``finish_reason: "tool_calls"``: the same request layer and output parser as the API."""
    import jsonschema

    person = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 16}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
    lines = [
        chat_line(
            "json",
            "Describe a person.",
            80,
            temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": person}},
        ),
        chat_line(
            "tool",
            "What is the weather in Paris?",
            80,
            temperature=0,
            tools=[weather],
            tool_choice="required",
            parallel_tool_calls=False,
        ),
    ]
    b = wait_batch(client, start_batch(client, write_jsonl(tmp_path / "structured.jsonl", lines)).id, timeout=180)
    assert b.status == "completed" and b.request_counts.completed == 2
    out = {x["custom_id"]: x["response"]["body"]["choices"][0] for x in file_lines(client, b.output_file_id)}
    assert out["json"]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(out["json"]["message"]["content"]), person)
    assert out["tool"]["finish_reason"] == "tool_calls"
    [call] = out["tool"]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), weather["function"]["parameters"])
