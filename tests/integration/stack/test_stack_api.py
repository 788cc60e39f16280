"""The OpenAI API through the official client against real processes: gateway → Redis → 2 workers."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from kernellab.runtime.request.sampling import SamplingParams
from tests.support.stack import API_KEY, MODEL, metric, wait_for

pytestmark = pytest.mark.integration

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Name three colors."}],
]
PROMPT = "The quick brown fox"
N = 8  # tokens per request: the embedded model runs a few steps a second on 2 cores


@pytest.fixture(scope="module")
def client(stack):
    return stack.openai()


@pytest.fixture(scope="module")
def reference(offline_llm):
    """Greedy offline outputs, one request at a time, for the same prompts."""
    greedy = SamplingParams(max_tokens=N, temperature=0)
    chats = [offline_llm.generate([m], greedy)[0] for m in CHATS]
    completion = offline_llm.generate([PROMPT], greedy)[0]
    return {"chat": [o.text for o in chats], "completion": completion.text}


def test_models_health_ready(stack, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{stack.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{stack.url}/ready", headers={"Authorization": f"Bearer {API_KEY}"}).json()["workers"] == 2


def test_chat_greedy_equals_offline_stream_and_not(client, reference):
    for messages, expected in zip(CHATS, reference["chat"], strict=True):
        resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=N, temperature=0)
        assert resp.choices[0].message.content == expected
        assert resp.choices[0].finish_reason in ("length", "stop")
        assert resp.system_fingerprint.startswith("fp_")  # a string: null is outside the API's schema
        assert resp.usage.completion_tokens <= N and resp.usage.prompt_tokens > 0
        stream = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=N,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == expected
        assert chunks[0].choices[0].delta.role == "assistant"
        assert {c.system_fingerprint for c in chunks} == {resp.system_fingerprint}
        assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == resp.usage.total_tokens


def test_completion_greedy_and_logprobs(client, reference):
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0, logprobs=2)
    choice = resp.choices[0]
    assert choice.text == reference["completion"]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == resp.usage.completion_tokens
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) == 2 for t in lp.top_logprobs)
    # greedy: the chosen token is the most likely one
    assert all(
        lp.token_logprobs[i] == pytest.approx(max(lp.top_logprobs[i].values()), abs=1e-4) for i in range(len(lp.tokens))
    )


def test_completion_echo_with_logprobs_scores_the_prompt(client, offline_llm):
    """Echo with logprobs answers every prompt token's logprob (the first null: nothing comes before it), as
    scoring clients use it (lm-evaluation-harness: max_tokens 0 or 1, then ``token_logprobs[context:]``)."""
    ids = offline_llm.encode(PROMPT)
    [ref] = offline_llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))
    expected = [e.logprob for e in ref.prompt_logprobs]
    assert len(expected) == len(ids) - 1

    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
    choice = resp.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length" and resp.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and "".join(lp.tokens) == PROMPT and lp.text_offset[0] == 0
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    assert all(len(t) == 2 for t in lp.top_logprobs[1:])

    # streamed, with a generated token after the prompt: the first chunk carries the prompt's entries too, and the
    # generated token's text_offset counts the echoed prompt
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=2, echo=True, logprobs=1, temperature=0, stream=True
        )
    )
    entries = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    tokens = [t for e in entries for t in e.tokens]
    offsets = [o for e in entries for o in e.text_offset]
    values = [v for e in entries for v in e.token_logprobs]
    assert len(tokens) == len(ids) + 2 and values[0] is None
    assert values[1 : len(ids)] == pytest.approx(expected, abs=1e-4)
    assert offsets[len(ids)] == len(PROMPT) and "".join(c.choices[0].text for c in chunks if c.choices).startswith(
        PROMPT + ref.text[:1]
    )


def test_best_of_answers_the_candidate_with_the_best_logprob_per_token(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=1.0, seed=5)
    resp = client.completions.create(best_of=3, n=1, logprobs=1, **kw)
    [choice] = resp.choices
    assert choice.index == 0 and resp.usage.completion_tokens >= len(choice.logprobs.tokens)
    # the three candidates are what n=3 with the same seed makes; the answer is the best of them per token
    three = client.completions.create(n=3, logprobs=1, **kw).choices

    def mean(c):
        return sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs)

    best = max(three, key=mean)
    assert choice.text == best.text and mean(choice) == pytest.approx(mean(best))
    assert resp.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in three)
    two = client.completions.create(best_of=3, n=2, logprobs=1, **kw).choices  # the best two, best first
    assert [c.index for c in two] == [0, 1] and [c.text for c in two] == [
        c.text for c in sorted(three, key=mean, reverse=True)[:2]
    ]


def test_chat_logprobs(client):
    resp = client.chat.completions.create(
        model=MODEL, messages=CHATS[0], max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    assert all(len(c.top_logprobs) == 3 and c.logprob <= 0 and c.bytes is not None for c in content)
    assert "".join(c.token for c in content).startswith(resp.choices[0].message.content[:3])


def test_stop_string_ends_the_text_before_it(client, reference):
    full = reference["chat"][0]
    words = full.split(" ")
    assert len(words) >= 3, full
    stop = " " + words[2]
    for stream in (False, True):
        kwargs = dict(model=MODEL, messages=CHATS[0], max_tokens=N, temperature=0, stop=[stop])
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kwargs))
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            resp = client.chat.completions.create(**kwargs)
            text, reason = resp.choices[0].message.content, resp.choices[0].finish_reason
        assert text == full[: full.index(stop)] and reason == "stop"


def test_seed_reproducibility_and_n2(client):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, top_p=0.95, seed=1234)
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert a.choices[0].text == b.choices[0].text
    two = client.completions.create(n=2, **kwargs)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].text == a.choices[0].text  # choice i samples with seed + i
    assert 2 <= two.usage.completion_tokens <= 12
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=CHATS[1], max_tokens=4, temperature=0.8, seed=7, n=2, stream=True
        )
    )
    by_index = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            by_index[ch.index] += ch.delta.content or ""
    assert all(by_index.values())


def test_bad_input_is_4xx_never_5xx(stack, client):
    before = stack.gateway_metrics()
    url = f"{stack.url}/v1/chat/completions"
    auth = {"Authorization": f"Bearer {API_KEY}"}
    good = {"model": MODEL, "messages": CHATS[0], "max_tokens": 2}
    cases = [
        ({"content": b"{nope"}, 400),
        ({"json": {**good, "max_tokens": "many"}}, 400),
        ({"json": {**good, "messages": "hello"}}, 400),
        ({"json": {**good, "max_tokens": -1}}, 400),
        ({"json": {**good, "max_tokens": 0}}, 400),
        ({"json": {**good, "max_tokens": 10**6}}, 400),
        ({"json": {**good, "messages": [{"role": "user", "content": "word " * 9000}]}}, 400),
        ({"json": {**good, "messages": []}}, 400),
        ({"json": {**good, "messages": [{"role": "king", "content": "hi"}]}}, 400),
        ({"json": {**good, "model": "no-such-model"}}, 404),
        ({"content": b'{"model": "' + b"x" * (2 << 20) + b'"}'}, 413),
        ({"json": {**good, "n": 0}}, 400),
        ({"json": {**good, "temperature": -1}}, 400),
        ({"json": {**good, "temperature": 3}}, 400),
        ({"json": {**good, "top_p": 1.5}}, 400),
    ]
    for kwargs, status in cases:
        resp = httpx.post(url, headers=auth, timeout=30, **kwargs)
        assert resp.status_code == status, (kwargs.get("json", "raw"), resp.text)
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        resp = httpx.post(url, headers=headers, json=good, timeout=30)
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-nothing", messages=CHATS[0])
    with pytest.raises(openai.AuthenticationError):
        stack.openai(api_key="bad").models.list()
    after = stack.gateway_metrics()
    five = "kernellab_gateway_http_requests_total"
    assert metric(after, five) > metric(before, five)
    assert sum(v for k, v in after.items() if k.startswith(five) and 'status="5' in k) == sum(
        v for k, v in before.items() if k.startswith(five) and 'status="5' in k
    )


def test_client_disconnect_cancels_and_frees_kv(stack):
    before = metric(stack.gateway_metrics(), "kernellab_gateway_client_disconnects_total")
    body = {"model": MODEL, "messages": CHATS[1], "max_tokens": 400, "stream": True, "temperature": 0, "stop": None}
    got = []
    with (
        httpx.Client(timeout=60) as http,
        http.stream(
            "POST", f"{stack.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}
        ) as resp,
    ):
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                got.append(json.loads(line[6:]))
            if len(got) >= 2:
                break  # leave mid-stream: closing the connection is the disconnect
    assert len(got) == 2

    def idle_and_freed():
        ms = [stack.worker_metrics(i) for i in stack.live_workers()]
        return all(
            metric(m, "kernellab:kv_cache_usage_perc") == 0 and metric(m, "kernellab:num_requests_running") == 0
            for m in ms
        )

    wait_for(idle_and_freed, 30, "the cancelled request's KV blocks to be freed")
    aborted = sum(
        metric(stack.worker_metrics(i), "kernellab:request_success_total", finished_reason="abort")
        for i in stack.live_workers()
    )
    assert aborted >= 1
    wait_for(
        lambda: metric(stack.gateway_metrics(), "kernellab_gateway_client_disconnects_total") > before,
        10,
        "the gateway to count the disconnect",
    )


def test_concurrent_streams_all_complete(client, reference):
    results, errors = {}, []

    def run(i):
        try:
            chunks = client.chat.completions.create(
                model=MODEL, messages=CHATS[i % 2], max_tokens=N, temperature=0, stream=True
            )
            results[i] = "".join(c.choices[0].delta.content or "" for c in chunks)
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors and len(results) == 6, errors
    assert all(results[i] == reference["chat"][i % 2] for i in results), results
    assert time.monotonic() - start < 180
