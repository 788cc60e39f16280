"""Qwen3-style reasoning and tool-call output through the real gateway (SSE and JSON), Redis and a worker.

The worker's fake engine echoes its prompt from the offset ``seed``; the user turn holds the exact text a Qwen3
model writes (a think block and an answer, or a tool call), so the engine "generates" that text token by token
and the gateway, serving Qwen3's own chat template, must split it as it would a real Qwen3's output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from test_svc_gateway import AUTH, MODEL, gateway_settings, wait_ready, worker  # noqa: F401 (fixture)

from kernellab.runtime.request.tokenizer import TextTokenizer

QWEN3_TEMPLATE = (Path(__file__).parents[2] / "fixtures" / "chat_templates" / "qwen3.jinja").read_text()
THOUGHT = "<think>\nThe user greets me. I greet back.\n</think>\n\nHello there!"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture
def qwen3(tokenizer):
    return TextTokenizer(tokenizer._tok, {**tokenizer.config, "chat_template": QWEN3_TEMPLATE}, tokenizer.eos_token_ids)


@pytest.fixture
def client(redis_url, prefix, qwen3, worker):  # noqa: F811 (the imported fixture, requested by name)
    with TestClient(create_app_for(redis_url, prefix, qwen3)) as c:
        wait_ready(c)
        yield c


def create_app_for(redis_url, prefix, tok):
    from kernellab.services.gateway.app import create_app

    return create_app(gateway_settings(redis_url, prefix, max_body_bytes=1 << 16), tokenizer=tok)


def echo_body(tok, text: str, **extra) -> dict:
    """A chat body whose (echoing) engine output is exactly ``text``: the seed points at the user turn's tokens."""
    messages = [{"role": "user", "content": text}]
    prompt = tok.encode(tok.render_chat(messages, tools=extra.get("tools")), add_special_tokens=False)
    want = tok.encode(text, add_special_tokens=False)
    start = next(i for i in range(len(prompt)) if prompt[i : i + len(want)] == want)
    return {"model": MODEL, "messages": messages, "seed": start, "max_tokens": len(want), **extra}


def test_reasoning_is_split_from_the_answer(client, qwen3):
    body = echo_body(qwen3, THOUGHT)
    resp = client.post("/v1/chat/completions", json=body, headers=AUTH).json()
    message = resp["choices"][0]["message"]
    assert message["reasoning"] == message["reasoning_content"] == "\nThe user greets me. I greet back.\n"
    assert message["content"] == "Hello there!"
    details = resp["usage"]["completion_tokens_details"]
    assert 0 < details["reasoning_tokens"] < resp["usage"]["completion_tokens"]

    events = []
    with client.stream(
        "POST",
        "/v1/chat/completions",
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
        headers=AUTH,
    ) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert deltas[0]["role"] == "assistant"
    assert "".join(d.get("reasoning", "") for d in deltas) == message["reasoning"]
    assert "".join(d.get("content", "") for d in deltas) == "Hello there!"
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    assert events[-1]["usage"]["completion_tokens_details"] == details


def test_a_tool_call_in_the_output_becomes_tool_calls(client, qwen3):
    body = echo_body(qwen3, CALL, tools=[WEATHER])
    choice = client.post("/v1/chat/completions", json=body, headers=AUTH).json()["choices"][0]
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert choice["message"]["content"] is None
    assert choice["finish_reason"] == "length"  # the echo ended on max_tokens: a cut-off answer says so
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}, headers=AUTH) as stream:
        deltas = [
            json.loads(line[6:])["choices"][0]["delta"]
            for line in stream.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [c["function"]["name"] for c in calls] == ["get_weather"] and calls[0]["index"] == 0
    assert "".join(d.get("content") or "" for d in deltas) == ""


def test_thinking_off_leaves_the_output_as_content(client, qwen3):
    body = echo_body(qwen3, "Just the answer.")
    body["chat_template_kwargs"] = {"enable_thinking": False}
    # The closed think block is now in the prompt: the echo offset moves with it.
    prompt = qwen3.encode(qwen3.render_chat(body["messages"], enable_thinking=False), add_special_tokens=False)
    want = qwen3.encode("Just the answer.", add_special_tokens=False)
    body["seed"] = next(i for i in range(len(prompt)) if prompt[i : i + len(want)] == want)
    message = client.post("/v1/chat/completions", json=body, headers=AUTH).json()["choices"][0]["message"]
    assert message["content"] == "Just the answer." and message.get("reasoning") is None
