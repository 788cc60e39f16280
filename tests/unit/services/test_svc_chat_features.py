"""Qwen3 as people use it, in the request layer: its own chat template (thinking on/off, tools, tool calls, tool
results) rendered as transformers renders it; tools, tool_choice, response_format, logit_bias, stop_token_ids
and the model's sampling defaults turned into engine parameters; /tokenize and /detokenize shapes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kernellab.runtime.request.errors import InvalidRequestError
from kernellab.runtime.request.tokenizer import TextTokenizer
from kernellab.services.gateway.options import ServingOptions
from kernellab.services.gateway.requests import prepare
from kernellab.services.gateway.utility import detokenize_request, tokenize_request

MODEL = "smollm2-135m"
QWEN3_TEMPLATE = (Path(__file__).parents[2] / "fixtures" / "chat_templates" / "qwen3.jinja").read_text()
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city"],
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}

CONVERSATIONS = {
    "plain": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}],
    "multi_turn_with_reasoning": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nGreet back.\n</think>\n\nHello!"},
        {"role": "user", "content": "Weather?"},
    ],
    "tool_round_trip": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
        {"role": "tool", "tool_call_id": "call_2", "content": '{"temp": 22}'},
    ],
}


@pytest.fixture(scope="module")
def qwen3(tokenizer):
    """The embedded model's vocabulary with Qwen3's chat template: what the gateway renders for Qwen3."""
    return TextTokenizer(tokenizer._tok, {**tokenizer.config, "chat_template": QWEN3_TEMPLATE}, tokenizer.eos_token_ids)


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    from kernellab.runtime.request.registry import resolve_model
    from kernellab.runtime.request.tokenizer import tokenizer_dir

    return AutoTokenizer.from_pretrained(str(tokenizer_dir(resolve_model(MODEL))))


@pytest.mark.parametrize("thinking", [None, True, False])
@pytest.mark.parametrize("tools", [None, [WEATHER, CLOCK]])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_qwen3_template_renders_as_transformers_does(qwen3, hf_tokenizer, name, tools, thinking):
    messages = CONVERSATIONS[name]
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    expected = hf_tokenizer.apply_chat_template(
        messages, chat_template=QWEN3_TEMPLATE, tools=tools, add_generation_prompt=True, tokenize=False, **kwargs
    )
    assert qwen3.render_chat(messages, tools=tools, **kwargs) == expected
    if thinking is False:
        assert expected.endswith("<think>\n\n</think>\n\n")
    if tools:
        assert '"name": "get_weather"' in expected


def options(tok, **kw) -> ServingOptions:
    return ServingOptions.build(tok, **kw)


def chat(tok, opts=None, **body):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **body}
    return prepare("chat", body, tok, served_model=MODEL, max_model_len=4096, max_n=4, options=opts or options(tok))


def test_thinking_switch_and_reasoning_effort(qwen3):
    opts = options(qwen3)
    assert opts.reasoning  # the template has <think> blocks: the reasoning parser runs
    on, off = chat(qwen3, opts), chat(qwen3, opts, chat_template_kwargs={"enable_thinking": False})
    assert on.parser.reasoning and not on.parser.reasoning_open
    assert qwen3.decode(off.prompts[0], skip_special_tokens=False).endswith("<think>\n\n</think>\n\n")
    effort = chat(qwen3, opts, reasoning_effort="none")
    assert effort.prompts == off.prompts
    server_off = options(qwen3, chat_template_kwargs={"enable_thinking": False})
    assert chat(qwen3, server_off).prompts == off.prompts  # KERNELLAB_CHAT_TEMPLATE_KWARGS
    assert chat(qwen3, server_off, chat_template_kwargs={"enable_thinking": True}).prompts == on.prompts
    with pytest.raises(InvalidRequestError) as info:
        chat(qwen3, opts, chat_template_kwargs={"messages": []})
    assert info.value.param == "chat_template_kwargs"


def test_tools_reach_the_template_and_auto_parses_without_forcing(qwen3):
    p = chat(qwen3, tools=[WEATHER])
    assert "get_weather" in qwen3.decode(p.prompts[0]) and p.parser.tools
    assert p.choices[0].params.structured is None
    none = chat(qwen3, tools=[WEATHER], tool_choice="none")
    assert "get_weather" not in qwen3.decode(none.prompts[0]) and not none.parser.tools


def test_a_template_without_tools_gets_them_in_a_system_turn(tokenizer):
    p = chat(tokenizer, tools=[WEATHER])
    text = tokenizer.decode(p.prompts[0])
    assert "get_weather" in text and "<tool_call>" in text and p.parser.tools


@pytest.mark.parametrize(
    "choice, names",
    [("required", ["get_weather", "get_time"]), ({"type": "function", "function": {"name": "get_time"}}, ["get_time"])],
)
def test_forced_tool_choice_is_a_grammar(qwen3, choice, names):
    from kernellab.runtime.request.structured import check

    p = chat(qwen3, tools=[WEATHER, CLOCK], tool_choice=choice)
    grammar = p.choices[0].params.structured["lark"]
    assert all(json.dumps(n) in grammar for n in names)
    assert "think" in grammar  # Qwen3 may think before it calls
    check(p.choices[0].params.structured, qwen3)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
        ({"response_format": {"type": "xml"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
            "response_format",
        ),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 500}}, "logit_bias"),
        ({"stop_token_ids": [10**9]}, "stop_token_ids"),
    ],
)
def test_bad_tool_and_format_requests_are_400s(tokenizer, body, param):
    with pytest.raises(InvalidRequestError) as info:
        chat(tokenizer, **body)
    assert info.value.param == param and info.value.status_code == 400


def test_response_format_logit_bias_and_stop_token_ids_reach_the_engine(tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    p = chat(
        tokenizer,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}},
        logit_bias={"17": -100, "42": 2.5},
        stop_token_ids=[7],
    )
    params = p.choices[0].params
    assert params.structured == {"json_schema": schema}
    assert params.logit_bias == {17: -100.0, 42: 2.5} and params.stop_token_ids == [7]
    assert chat(tokenizer, response_format={"type": "json_object"}).choices[0].params.structured == {
        "json_object": True
    }
    completion = prepare(
        "completion",
        {"model": MODEL, "prompt": "x", "logit_bias": {"3": 1}, "response_format": {"type": "json_object"}},
        tokenizer,
        served_model=MODEL,
        max_model_len=4096,
        max_n=1,
        options=options(tokenizer),
    )
    assert completion.choices[0].params.logit_bias == {3: 1.0}
    assert completion.choices[0].params.structured == {"json_object": True}


def test_sampling_defaults_come_from_generation_config(tokenizer):
    tok = TextTokenizer(tokenizer._tok, tokenizer.config, tokenizer.eos_token_ids)
    tok.generation_config = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True}
    params = chat(tok).choices[0].params
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.95, 20)
    params = chat(tok, temperature=0.1, top_k=-1).choices[0].params  # the request's own values win
    assert (params.temperature, params.top_p, params.top_k) == (0.1, 0.95, -1)
    params = chat(tok, options(tok, generation_config="none")).choices[0].params  # KERNELLAB_GENERATION_CONFIG
    assert (params.temperature, params.top_p, params.top_k) == (1.0, 1.0, -1)
    tok.generation_config = {"do_sample": False, "max_new_tokens": 64}
    params = chat(tok).choices[0].params
    assert params.greedy and params.max_tokens == 64


def test_tokenize_and_detokenize(qwen3, tokenizer):
    opts = options(tokenizer)
    out = tokenize_request(
        {"prompt": "Hello world", "return_token_strs": True},
        tokenizer,
        served_model=MODEL,
        max_model_len=4096,
        options=opts,
    )
    assert out["tokens"] == tokenizer.encode("Hello world") and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == 4096 and len(out["token_strs"]) == out["count"]
    msgs = [{"role": "user", "content": "Hi"}]
    out = tokenize_request(
        {"model": MODEL, "messages": msgs}, tokenizer, served_model=MODEL, max_model_len=4096, options=opts
    )
    assert out["tokens"] == tokenizer.apply_chat_template(msgs) and out["token_strs"] is None
    back = detokenize_request({"tokens": out["tokens"]}, tokenizer, served_model=MODEL)
    assert back["prompt"] == tokenizer.decode(out["tokens"], skip_special_tokens=False)
    for bad in ({}, {"prompt": "x", "messages": msgs}, {"prompt": 5}, {"prompt": "x", "model": "other"}):
        with pytest.raises(Exception) as info:
            tokenize_request(bad, tokenizer, served_model=MODEL, max_model_len=4096, options=opts)
        assert 400 <= info.value.status_code < 500
    for bad in ({"tokens": [-1]}, {"tokens": "abc"}, {}):
        with pytest.raises(InvalidRequestError):
            detokenize_request(bad, tokenizer, served_model=MODEL)


def test_incoming_reasoning_and_developer_role(qwen3, tokenizer):
    """An assistant turn sent back with its ``reasoning`` (the new name) reaches the template as
    ``reasoning_content``; ``developer`` renders as ``system`` where the template has no such role."""
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", "reasoning": "R1 thought"}]
    text = qwen3.decode(chat(qwen3, messages=msgs).prompts[0], skip_special_tokens=False)
    assert "<think>\nR1 thought\n</think>\n\nHello" in text
    dev = chat(tokenizer, messages=[{"role": "developer", "content": "Be terse."}, {"role": "user", "content": "Hi"}])
    sys_ = chat(tokenizer, messages=[{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}])
    assert dev.prompts == sys_.prompts


def test_an_assistant_refusal_part_is_its_text(tokenizer):
    msgs = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't help with that."}]},
        {"role": "user", "content": "Why?"},
    ]
    text = tokenizer.decode(chat(tokenizer, messages=msgs).prompts[0])
    assert "I can't help with that." in text
    with pytest.raises(InvalidRequestError):
        chat(tokenizer, messages=[{"role": "user", "content": [{"type": "refusal", "refusal": "x"}]}])


def test_deprecated_functions_are_served_as_tools(qwen3):
    fn = WEATHER["function"]
    p = chat(qwen3, functions=[fn])
    assert "get_weather" in qwen3.decode(p.prompts[0]) and p.parser.tools and p.parser.legacy_functions
    assert p.choices[0].params.structured is None  # "auto": nothing forced
    forced = chat(qwen3, functions=[fn, CLOCK["function"]], function_call={"name": "get_time"})
    assert "get_time" in forced.choices[0].params.structured["lark"]
    assert "get_weather" not in forced.choices[0].params.structured["lark"]
    assert chat(qwen3, functions=[fn], function_call="auto", tool_choice="auto").parser.legacy_functions  # agree
    off = chat(qwen3, functions=[fn], function_call="none")
    assert not off.parser.tools and "get_weather" not in qwen3.decode(off.prompts[0])
    # an earlier call and its result in the old form render as the tool call and tool turn they became
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "function_call": {"name": "get_weather", "arguments": '{"city": "P"}'}},
        {"role": "function", "name": "get_weather", "content": '{"temp": 21}'},
    ]
    new = [
        history[0],
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{**CALL, "id": "call_1", "function": {"name": "get_weather", "arguments": '{"city": "P"}'}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": '{"temp": 21}'},
    ]
    assert chat(qwen3, messages=history, functions=[fn]).prompts == chat(qwen3, messages=new, tools=[WEATHER]).prompts


@pytest.mark.parametrize(
    "body, param",
    [
        ({"functions": [WEATHER["function"]], "tools": [CLOCK]}, "functions"),
        ({"functions": "get_weather"}, "functions"),
        ({"function_call": {"name": "get_weather"}}, "function_call"),  # no functions to call
        ({"functions": [WEATHER["function"]], "function_call": "always"}, "function_call"),
        ({"functions": [WEATHER["function"]], "function_call": "auto", "tool_choice": "none"}, "function_call"),
        ({"functions": [WEATHER["function"]], "function_call": {"name": "nope"}}, "tool_choice"),
    ],
)
def test_bad_deprecated_function_requests_are_400s(tokenizer, body, param):
    with pytest.raises(InvalidRequestError) as info:
        chat(tokenizer, **body)
    assert info.value.param == param, info.value.message


def test_the_deprecated_form_answers_one_function_call():
    from kernellab.services.gateway.output_parsers import ChatOutputParser, ParserConfig, finish_delta
    from kernellab.services.gateway.responses import chat_choice

    text = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "f"}\n</tool_call>'
    streamed = ChatOutputParser(ParserConfig(tools=True, legacy_functions=True))
    deltas = [streamed.feed(text[:30]), streamed.feed(text[30:])]
    last, reason = finish_delta(streamed, {}, "stop")
    assert reason == "function_call" and [d for d in [*deltas, last] if d] == [
        {"function_call": {"name": "get_time", "arguments": "{}"}}
    ]
    whole = ChatOutputParser(ParserConfig(tools=True, legacy_functions=True))
    whole.feed(text)
    whole.finish()
    message = chat_choice(0, text, None, "function_call", whole.result())["message"]
    assert message["function_call"] == {"name": "get_time", "arguments": "{}"} and "tool_calls" not in message
    assert message["content"] is None
