"""Structured outputs, tool calls, logit_bias and /tokenize through the real stack (gateway → Redis → 2 workers,
the embedded SmolLM2) with the official openai client."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.support.stack import API_KEY, MODEL

pytestmark = pytest.mark.integration

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"enum": ["happy", "sad", "calm"]},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 2},
    },
    "required": ["name", "age", "mood", "hobbies"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a timezone",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"enum": ["UTC", "CET"]}},
            "required": ["tz"],
            "additionalProperties": False,
        },
    },
}
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}


@pytest.fixture(scope="module")
def client(stack):
    return stack.openai()


def test_json_schema_answers_always_validate(client):
    """200 sampled requests (temperature 1, 32 at a time, several seeds): every answer parses and validates."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

    def ask(seed: int):
        resp = client.chat.completions.create(
            model=MODEL, messages=ASK, temperature=1.0, seed=seed, max_tokens=120, response_format=fmt
        )
        return resp.choices[0]

    with ThreadPoolExecutor(32) as pool:
        choices = list(pool.map(ask, range(200)))
    for choice in choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_object_mode_streams_a_json_object(client):
    # Greedy: a free-form object sampled at a high temperature can run on to max_tokens (a valid prefix, cut).
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, temperature=0, max_tokens=200, response_format={"type": "json_object"}, stream=True
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert isinstance(json.loads(text), dict)


def test_parse_with_a_pydantic_model(client):
    class Person(BaseModel):
        name: str
        age: int

    resp = client.chat.completions.parse(
        model=MODEL, messages=ASK, temperature=0.7, seed=1, max_tokens=200, response_format=Person
    )
    person = resp.choices[0].message.parsed
    assert isinstance(person, Person)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls_parse(client, choice):
    messages = [{"role": "user", "content": "What is the weather in Paris, and the time?"}]
    for seed in range(4):
        resp = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            tools=[WEATHER, CLOCK],
            tool_choice=choice,
            temperature=1.0,
            seed=seed,
            max_tokens=150,
        )
        c = resp.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.tool_calls, c
        for call in c.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            if isinstance(choice, dict):
                assert call.function.name == "get_time"
            jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_streamed_tool_calls_and_a_tool_result_round_trip(client):
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=150,
        stream=True,
    )
    chunks = list(stream)
    calls = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    args = json.loads(calls[0].function.arguments)
    jsonschema.validate(args, PARAMS["get_weather"])
    # The call and its result go back in; the model answers in text (tool_choice auto, nothing forced).
    messages += [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": calls[0].id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": calls[0].function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": calls[0].id, "content": '{"temp": 3, "sky": "snow"}'},
    ]
    resp = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], temperature=0, max_tokens=12)
    assert resp.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_deprecated_functions_answer_a_function_call(client):
    """OpenAI's deprecated function calling (``functions`` / ``function_call``), still sent by older clients: served
    as tools, answered in the old form, streamed and whole, and its call and result taken back as history."""
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    ask = dict(
        model=MODEL,
        functions=[WEATHER["function"]],
        function_call={"name": "get_weather"},
        temperature=0,
        max_tokens=150,
    )
    resp = client.chat.completions.create(messages=messages, **ask)
    message = resp.choices[0].message
    assert resp.choices[0].finish_reason == "function_call" and message.tool_calls is None
    assert message.function_call.name == "get_weather"
    jsonschema.validate(json.loads(message.function_call.arguments), PARAMS["get_weather"])
    chunks = list(client.chat.completions.create(messages=messages, stream=True, **ask))
    calls = [c.choices[0].delta.function_call for c in chunks if c.choices and c.choices[0].delta.function_call]
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", message.function_call.arguments)]
    assert chunks[-1].choices[0].finish_reason == "function_call"
    messages += [
        {"role": "assistant", "content": None, "function_call": message.function_call.model_dump()},
        {"role": "function", "name": "get_weather", "content": '{"temp": 3, "sky": "snow"}'},
    ]
    after = client.chat.completions.create(
        model=MODEL, messages=messages, functions=[WEATHER["function"]], temperature=0, max_tokens=12
    )
    assert after.choices[0].finish_reason in ("stop", "length", "function_call")


def test_logit_bias_bans_and_forces(stack, client):
    greedy = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=1, logprobs=True)
    first = greedy.choices[0].logprobs.content[0].token
    ids = httpx.post(
        f"{stack.url}/tokenize",
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={"prompt": first, "add_special_tokens": False},
    ).json()["tokens"]
    banned = client.chat.completions.create(
        model=MODEL, messages=ASK, temperature=0, max_tokens=1, logprobs=True, logit_bias={str(i): -100 for i in ids}
    )
    assert banned.choices[0].logprobs.content[0].token != first
    forced = client.chat.completions.create(
        model=MODEL, messages=ASK, temperature=1.0, seed=5, max_tokens=3, logprobs=True, logit_bias={str(ids[0]): 100}
    )
    assert len({t.token for t in forced.choices[0].logprobs.content}) == 1


def test_tokenize_detokenize_need_the_key(stack):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.post(f"{stack.url}/tokenize", json={"prompt": "hi"}).status_code == 401
    out = httpx.post(f"{stack.url}/tokenize", headers=auth, json={"model": MODEL, "messages": ASK}).json()
    assert out["count"] == len(out["tokens"]) > 0
    text = httpx.post(f"{stack.url}/detokenize", headers=auth, json={"tokens": out["tokens"]}).json()["prompt"]
    assert "Describe a person as JSON." in text
    bad = httpx.post(f"{stack.url}/detokenize", headers=auth, json={"tokens": [-5]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_bad_schema_and_tool_requests_are_400s(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            max_tokens=5,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}},
        )
    assert info.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, tool_choice="required")
