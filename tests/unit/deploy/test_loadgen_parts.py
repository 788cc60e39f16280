"""The load generator's parts on their own: request mix, SSE decoding, timings, percentiles and goodput.

End-to-end runs against a real stack are in tests/integration/deploy."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kernellab.services.loadgen.sse import SSEDecoder, StreamResult, iter_sse_data
from kernellab.services.loadgen.stats import (
    SLO,
    RequestRecord,
    distribution,
    format_table,
    percentile,
    summarize,
)
from kernellab.services.loadgen.workload import MixEntry, Workload, parse_mix


def _chunk(text=None, finish=None, usage=None) -> str:
    choices = [] if text is None and finish is None else [{"index": 0, "delta": {"content": text} if text else {},
                                                            "finish_reason": finish}]  # fmt: skip
    body = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": choices}
    if usage:
        body["usage"] = usage
    return json.dumps(body)


# ---- mix
def test_parse_mix_with_and_without_weights():
    assert parse_mix("128:64:3, 1024:256") == (MixEntry(128, 64, 3.0), MixEntry(1024, 256, 1.0))


@pytest.mark.parametrize("spec", ["", "128", "a:b:c", "0:16:1", "16:0:1", "16:16:0", "1:2:3:4"])
def test_parse_mix_rejects_bad_entries(spec):
    with pytest.raises(ValueError):
        parse_mix(spec)


def test_workload_is_deterministic_follows_weights_and_shares_the_system_prompt():
    first, again = Workload("10:5:9,40:7:1", seed=3), Workload("10:5:9,40:7:1", seed=3)
    assert [first.next() for _ in range(5)] == [again.next() for _ in range(5)]
    workload = Workload("10:5:9,40:7:1", seed=3)
    specs = [workload.next() for _ in range(400)]
    short = sum(1 for s in specs if s.max_tokens == 5)
    assert 320 < short < 400  # weight 9:1
    assert len({s.messages[0]["content"] for s in specs}) == 1  # one shared prefix
    assert len({s.messages[1]["content"] for s in specs}) == 400  # distinct after it
    long_words = next(s for s in specs if s.max_tokens == 7).messages[1]["content"].split()
    assert len(long_words) == 2 + 40 + 7  # "Request N:", 40 words, the 7-word instruction


# ---- SSE
def test_sse_decoder_handles_comments_multiline_data_and_done():
    lines = [": keep-alive", "data: {\"a\":", "data: 1}", "", "event: x", "data: second", "", "data: [DONE]", "",
             "data: after-done", ""]  # fmt: skip
    assert list(iter_sse_data(lines)) == ['{"a":\n1}', "second"]
    decoder = SSEDecoder()
    assert decoder.feed_line(b"data: tail-without-blank-line") is None
    assert decoder.close() == "tail-without-blank-line"


def test_stream_result_times_text_chunks_and_takes_tokens_from_usage():
    result = StreamResult(start=10.0)
    result.feed(_chunk(text=""), now=10.1)  # role chunk: no text, no time
    result.feed(_chunk(text="Hel"), now=10.5)
    result.feed(_chunk(text="lo, world"), now=10.7)  # one chunk, several tokens
    result.feed(_chunk(text=" again"), now=11.0)
    result.feed(_chunk(finish="length"), now=11.0)
    result.feed(_chunk(usage={"prompt_tokens": 7, "completion_tokens": 5}), now=11.0)
    result.finish(now=11.2)
    assert result.error is None
    assert result.ttft == pytest.approx(0.5)
    assert result.itls == pytest.approx([0.2, 0.3])
    assert result.e2e == pytest.approx(1.2)
    assert (result.prompt_tokens, result.completion_tokens) == (7, 5)  # not 3 chunks
    assert "".join(result.text) == "Hello, world again"


@pytest.mark.parametrize(
    ("payloads", "error"),
    [
        ([_chunk(text="x"), _chunk(finish="stop")], "no usage"),
        ([_chunk(text="x")], "without a finish_reason"),
        (['{"error": {"message": "worker died"}}'], "worker died"),
        (["not json"], "malformed"),
    ],
)
def test_stream_result_failures(payloads, error):
    result = StreamResult(start=0.0)
    for payload in payloads:
        result.feed(payload, now=1.0)
    result.finish(now=2.0)
    assert error in result.error


def test_completions_chunks_are_understood_too():
    result = StreamResult(start=0.0)
    result.feed(json.dumps({"choices": [{"index": 0, "text": "abc", "finish_reason": None}]}), now=1.0)
    result.feed(json.dumps({"choices": [{"index": 0, "text": "", "finish_reason": "stop"}],
                            "usage": {"prompt_tokens": 2, "completion_tokens": 1}}), now=1.5)  # fmt: skip
    result.finish(now=1.5)
    assert result.error is None and result.ttft == 1.0 and result.completion_tokens == 1


# ---- statistics
@pytest.mark.parametrize("q", [0, 1, 50, 90, 99, 100])
def test_percentile_matches_numpy(q):
    values = sorted(np.random.default_rng(0).exponential(size=37).tolist())
    assert percentile(values, q) == pytest.approx(np.percentile(values, q))


def test_tpot_excludes_the_first_token():
    record = RequestRecord(ok=True, ttft=0.5, e2e=2.5, completion_tokens=5)
    assert record.tpot == pytest.approx(0.5)
    assert RequestRecord(ok=True, ttft=0.5, e2e=0.5, completion_tokens=1).tpot is None


def test_summarize_throughput_goodput_and_failures():
    records = [
        RequestRecord(ok=True, ttft=0.1, itls=[0.05, 0.05], e2e=0.3, prompt_tokens=10, completion_tokens=5),
        RequestRecord(ok=True, ttft=0.9, itls=[0.05], e2e=1.0, prompt_tokens=10, completion_tokens=3),
        RequestRecord(ok=False, error="HTTP 429: busy"),
        RequestRecord(ok=False, error="HTTP 429: busy"),
    ]
    summary = summarize(records, duration_s=2.0, slo=SLO(ttft_ms=500))
    assert summary["requests"] == {"total": 4, "completed": 2, "failed": 2, "failures": {"HTTP 429: busy": 2}}
    assert summary["request_throughput_rps"] == 1.0
    assert summary["output_token_throughput_tps"] == 4.0
    assert summary["ttft_s"]["count"] == 2 and summary["itl_s"]["count"] == 3
    assert summary["goodput"]["requests_meeting_slo"] == 1  # the 0.9 s TTFT misses the 500 ms SLO
    assert summary["goodput"]["goodput_rps"] == 0.5
    assert summary["goodput"]["fraction"] == 0.25
    assert "failure x2: HTTP 429: busy" in format_table(summary)


def test_without_slos_every_completed_request_is_good():
    records = [RequestRecord(ok=True, ttft=5.0, e2e=9.0, completion_tokens=2)]
    assert summarize(records, 1.0)["goodput"]["requests_meeting_slo"] == 1
    assert distribution([]) == {"count": 0}
