"""The reasoning / tool-call parser on Qwen3-style outputs, streamed in random splits: the deltas always add up
to the non-streaming parse, whatever way the tags were cut."""

from __future__ import annotations

import json
import random

import pytest

from kernellab.services.gateway.output_parsers import ChatOutputParser, ParserConfig

CALL_W = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
CALL_T = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'

# (output text, config, expected reasoning, expected content, expected calls as (name, arguments dict))
CASES = {
    "think_then_answer": (
        "<think>\nThe user asks 2+2. That is 4.\n</think>\n\nThe answer is **4**.",
        ParserConfig(reasoning=True),
        "\nThe user asks 2+2. That is 4.\n",
        "The answer is **4**.",
        [],
    ),
    "thinking_off": ("The answer is 4.", ParserConfig(reasoning=True), None, "The answer is 4.", []),
    "prompt_opened_the_block": (
        "Short thought.\n</think>\n\nAnswer.",
        ParserConfig(reasoning=True, reasoning_open=True),
        "Short thought.\n",
        "Answer.",
        [],
    ),
    "cut_by_max_tokens": (
        "<think>\nStill thinking about",
        ParserConfig(reasoning=True),
        "\nStill thinking about",
        "",
        [],
    ),
    "think_then_two_calls": (
        "<think>\nNeed weather and time.\n</think>\n\n" + CALL_W + "\n" + CALL_T,
        ParserConfig(reasoning=True, tools=True),
        "\nNeed weather and time.\n",
        None,
        [("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {})],
    ),
    "text_then_call": (
        "Let me check.\n" + CALL_W,
        ParserConfig(tools=True),
        None,
        "Let me check.",
        [("get_weather", {"city": "Paris", "unit": "C"})],
    ),
    "broken_call_stays_text": (
        '<tool_call>\n{"name": "get_weather", "arguments": {oops}\n</tool_call>',
        ParserConfig(tools=True),
        None,
        '<tool_call>\n{"name": "get_weather", "arguments": {oops}\n</tool_call>',
        [],
    ),
    "unclosed_call_at_the_end": (
        '<tool_call>\n{"name": "get_time", "arguments": {}}',
        ParserConfig(tools=True),
        None,
        None,
        [("get_time", {})],
    ),
    "tags_mentioned_in_text": (
        "Use <tool to say <thin things",
        ParserConfig(reasoning=True, tools=True),
        None,
        "Use <tool to say <thin things",
        [],
    ),
    "no_parsers": (
        "<think>x</think> <tool_call>{}</tool_call>",
        ParserConfig(),
        None,
        "<think>x</think> <tool_call>{}</tool_call>",
        [],
    ),
}


def stream(text: str, cfg: ParserConfig, rng: random.Random) -> tuple[ChatOutputParser, list[dict]]:
    parser, deltas, i = ChatOutputParser(cfg), [], 0
    while i < len(text):
        n = rng.randint(1, 9)
        deltas.append(parser.feed(text[i : i + n], list(range(n))))
        i += n
    deltas.append(parser.finish())
    return parser, deltas


@pytest.mark.parametrize("name", sorted(CASES))
def test_parses_in_any_split(name):
    text, cfg, reasoning, content, calls = CASES[name]
    for seed in range(25):
        parser, deltas = stream(text, cfg, random.Random(seed))
        msg = parser.result()
        assert msg.reasoning == reasoning
        assert msg.content == content
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.tool_calls] == calls
        # The stream carries the same message: reasoning exactly, content up to the whitespace around calls.
        streamed_reasoning = "".join(d.get("reasoning", "") for d in deltas)
        assert streamed_reasoning == (reasoning or "")
        streamed_content = "".join(d.get("content", "") for d in deltas)
        assert streamed_content.strip() == (content or "").strip()
        streamed_calls = [c for d in deltas for c in d.get("tool_calls", [])]
        assert streamed_calls == msg.tool_calls
        assert [c["index"] for c in streamed_calls] == list(range(len(calls)))


def test_reasoning_tokens_are_counted_to_the_end_of_the_block():
    # One token per piece, as the worker sends them: "<think>", "a", "b", "</think>", "\n\n", "ok".
    pieces = [("<think>", [1]), ("a", [2]), ("b", [3]), ("</think>", [9]), ("\n\n", [4]), ("ok", [5])]
    parser = ChatOutputParser(ParserConfig(reasoning=True, think_end_id=9))
    for text, ids in pieces:
        parser.feed(text, ids)
    parser.finish()
    assert parser.result().reasoning_tokens == 4
    # The same output in one coalesced update: counted up to the </think> token exactly.
    parser = ChatOutputParser(ParserConfig(reasoning=True, think_end_id=9))
    parser.feed("".join(t for t, _ in pieces), [i for _, ids in pieces for i in ids])
    parser.finish()
    assert parser.result().reasoning_tokens == 4
    # No reasoning block: none counted.
    parser = ChatOutputParser(ParserConfig(reasoning=True, think_end_id=9))
    parser.feed("plain answer", [1, 2])
    parser.finish()
    assert parser.result().reasoning_tokens == 0
