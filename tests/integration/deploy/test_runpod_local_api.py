"""runpod/handler.py through the RunPod SDK's local test API (`--rp_serve_api`), against the embedded model:
both input shapes, streaming and not, concurrent jobs, and clean errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from kernellab.services.loadgen.sse import StreamResult, iter_sse_data
from kernellab.services.processes import free_port, stop_process
from tests.support.deploy import REPO, http_json, wait_until

pytestmark = pytest.mark.integration

MODEL = "smollm2-135m"
MESSAGES = [{"role": "user", "content": "What is a hash table?"}]


@pytest.fixture(scope="module")
def handler_api(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("runpod")
    port = free_port()
    env = dict(os.environ, KERNELLAB_MODEL=MODEL, KERNELLAB_DEVICE="cpu", MAX_CONCURRENCY="4")
    log_path = workdir / "handler.log"
    process = subprocess.Popen(
        [sys.executable, str(REPO / "runpod" / "handler.py"), "--rp_serve_api", "--rp_api_port", str(port),
         "--rp_api_host", "127.0.0.1"],
        env=env, cwd=workdir, stdout=log_path.open("w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: urllib.request.urlopen(f"{url}/docs", timeout=5).status == 200, 240,
                   f"the handler's local API (log: {log_path})", interval_s=1.0, process=process)  # fmt: skip
        yield url
    finally:
        stop_process(process, 15)
    assert process.returncode is not None


def runsync(url: str, job_input: dict) -> dict:
    answer = http_json(f"{url}/runsync", {"input": job_input}, timeout=120)
    assert answer["status"] == "COMPLETED", answer
    return answer


def _openai(route: str, **body) -> dict:
    return {"openai_route": route, "openai_input": {"model": MODEL, "temperature": 0, **body}}


@pytest.mark.timeout(600)
def test_openai_chat_streaming_and_not_agree(handler_api):
    streamed = runsync(handler_api, _openai("/v1/chat/completions", messages=MESSAGES, max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}))["output"]  # fmt: skip
    assert all(isinstance(piece, str) for piece in streamed)
    result = StreamResult(start=0.0)
    lines = "".join(streamed).split("\n")
    for payload in iter_sse_data(lines):
        result.feed(payload)
    result.finish()
    assert result.error is None, streamed
    assert streamed[-1] == "data: [DONE]\n\n"
    assert result.completion_tokens == 12 and result.finish_reason == "length"

    [whole] = runsync(handler_api, _openai("/v1/chat/completions", messages=MESSAGES, max_tokens=12))["output"]
    assert whole["object"] == "chat.completion" and whole["model"] == MODEL
    assert whole["choices"][0]["message"]["content"] == "".join(result.text)  # greedy: the same text
    assert whole["usage"]["completion_tokens"] == 12


@pytest.mark.timeout(600)
def test_openai_chat_logprobs(handler_api):
    [whole] = runsync(handler_api, _openai("/v1/chat/completions", messages=MESSAGES, max_tokens=6, logprobs=True,
                                           top_logprobs=2))["output"]  # fmt: skip
    content = whole["choices"][0]["logprobs"]["content"]
    assert len(content) == whole["usage"]["completion_tokens"] == 6
    assert all(c["logprob"] <= 0 and len(c["top_logprobs"]) == 2 for c in content)
    # Greedy: the chosen token is the most likely one.
    assert all(c["top_logprobs"][0]["logprob"] == pytest.approx(c["logprob"], abs=1e-4) for c in content)


@pytest.mark.timeout(600)
def test_openai_completions_with_a_stop_string(handler_api):
    [out] = runsync(handler_api, _openai("/v1/completions", prompt="1, 2, 3, 4,", max_tokens=24, stop=[" 7"]))["output"]
    text = out["choices"][0]["text"]
    assert out["object"] == "text_completion" and " 7" not in text
    assert out["choices"][0]["finish_reason"] == "stop", text


@pytest.mark.timeout(600)
def test_native_prompt_streaming_and_not_agree(handler_api):
    params = {"max_tokens": 10, "temperature": 0}
    pieces = runsync(handler_api, {"prompt": "The capital of France is", "sampling_params": params,
                                   "stream": True})["output"]  # fmt: skip
    *body, last = pieces
    assert body and all(set(p) == {"text", "token_ids"} for p in body)
    assert last["usage"]["completion_tokens"] == sum(len(p["token_ids"]) for p in body) == 10
    [whole] = runsync(handler_api, {"prompt": "The capital of France is", "sampling_params": params})["output"]
    assert whole["text"] == "".join(p["text"] for p in body) + last["text"]
    assert whole["token_ids"] == [t for p in body for t in p["token_ids"]]


@pytest.mark.timeout(600)
def test_native_messages(handler_api):
    [out] = runsync(handler_api, {"messages": MESSAGES, "sampling_params": {"max_tokens": 8, "temperature": 0}})[
        "output"
    ]
    assert out["text"] and out["usage"]["completion_tokens"] == 8 and out["finish_reason"] == "length"


@pytest.mark.timeout(600)
def test_concurrent_jobs_all_complete(handler_api):
    prompts = ["Once upon a time", "The best way to learn", "In 1969, the first", "A recipe for bread:"]

    def one(prompt):
        return runsync(handler_api, {"prompt": prompt, "sampling_params": {"max_tokens": 8, "temperature": 0}})

    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(one, prompts))
    for answer in answers:
        [out] = answer["output"]
        assert out["usage"]["completion_tokens"] == 8 and out["text"]
    assert len({a["id"] for a in answers}) == len(prompts)


@pytest.mark.timeout(600)
def test_models_route_and_clean_errors(handler_api):
    [models] = runsync(handler_api, {"openai_route": "/v1/models"})["output"]
    assert models["data"][0]["id"] == MODEL
    [error] = runsync(handler_api, {"prompt": "x", "sampling_params": {"max_tokenz": 3}})["output"]
    assert error["error"]["param"] == "sampling_params.max_tokenz"
    [error] = runsync(handler_api, _openai("/v1/chat/completions", messages=MESSAGES, max_tokens=100_000))["output"]
    assert error["error"]["code"] == "context_length_exceeded", json.dumps(error)
