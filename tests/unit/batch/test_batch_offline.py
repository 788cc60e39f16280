"""``kernellab batch``'s executor (an engine in this process, no Redis) with the fake engine: the same lines
the queue path writes, in input order, with stop strings and n > 1; an engine failure ends the run."""

from __future__ import annotations

import asyncio
import json

import pytest

from kernellab.runtime.request.registry import DEFAULT_CPU_MODEL as MODEL
from kernellab.services.batch import lines as L
from kernellab.services.batch.offline import EngineExecutor
from kernellab.services.batch.runner import LineRunner
from tests.support.fake_engine import FakeEngine


def run_lines(tokenizer, raw_lines: list[dict], engine=None, concurrency: int = 3) -> dict[int, tuple[bool, dict]]:
    engine = engine or FakeEngine(step_s=0.0)
    results: dict[int, tuple[bool, dict]] = {}

    async def record(o):
        results[o.index] = (o.ok, o.line)

    async def main():
        seen: set[str] = set()
        parsed = [L.parse_line(json.dumps(x), i, i + 1, seen) for i, x in enumerate(raw_lines)]
        async with EngineExecutor(engine, tokenizer, MODEL, 8192) as ex:
            await LineRunner(ex, record, concurrency=concurrency, max_n=4).run(parsed)

    asyncio.run(main())
    return results


def completion(cid, prompt, **body):
    return {
        "custom_id": cid,
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": MODEL, "prompt": prompt, **body},
    }


def test_lines_match_what_the_api_answers(tokenizer):
    lines = [completion(f"r{i}", f"prompt number {i} is here", max_tokens=4) for i in range(7)]
    lines.append(
        {
            "custom_id": "c",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "n": 2},
        }
    )
    lines.append(completion("lp", "The quick brown fox", max_tokens=2, logprobs=1))
    results = run_lines(tokenizer, lines)
    assert sorted(results) == list(range(9)) and all(ok for ok, _ in results.values())
    for i in range(7):
        body = results[i][1]["response"]["body"]
        assert body["choices"][0]["text"] == tokenizer.decode(tokenizer.encode(f"prompt number {i} is here")[:4])
        assert body["usage"]["completion_tokens"] == 4 and body["choices"][0]["finish_reason"] == "length"
    chat = results[7][1]["response"]["body"]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert [c["message"]["content"] for c in chat["choices"]] == [tokenizer.decode(prompt[:3])] * 2
    lp = results[8][1]["response"]["body"]["choices"][0]["logprobs"]
    assert lp["tokens"] == ["The", " quick"] and lp["token_logprobs"] == [-0.5, -0.5]


def test_a_stop_string_ends_the_choice_and_frees_the_engine(tokenizer):
    engine = FakeEngine(step_s=0.0)
    results = run_lines(
        tokenizer, [completion("s", "alpha beta gamma delta", max_tokens=20, stop=[" gamma"])], engine=engine
    )
    choice = results[0][1]["response"]["body"]["choices"][0]
    assert choice["text"] == "alpha beta" and choice["finish_reason"] == "stop"
    assert engine.seqs == {}  # aborted at once, not run to max_tokens


def test_engine_refusals_are_error_lines(tokenizer):
    results = run_lines(
        tokenizer, [completion("long", "word " * 300, max_tokens=2), completion("ok", "fine", max_tokens=1)]
    )
    ok, line = results[0]
    assert not ok and line["response"]["status_code"] == 400
    assert line["response"]["body"]["error"]["code"] == "context_length_exceeded"
    assert results[1][0]


def test_an_engine_failure_ends_the_run(tokenizer):
    class Broken(FakeEngine):
        def step(self):
            raise RuntimeError("device lost")

    with pytest.raises(RuntimeError, match="device lost"):
        run_lines(tokenizer, [completion(f"r{i}", "x y z", max_tokens=2) for i in range(5)], engine=Broken(step_s=0.0))
