"""The RunPod handler's input parsing and output shapes (runpod/openai_io.py) with the embedded model's real
tokenizer, and its CUDA-fault exit. The whole handler through the SDK: tests/integration/deploy."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from kernellab.runtime.request.errors import ContextLengthError, InvalidRequestError, UnknownModelError
from tests.support.deploy import REPO

sys.path.insert(0, str(REPO / "runpod"))  # the handler's modules sit beside handler.py, as in the image
from engine_loop import is_cuda_fault
from openai_io import ParsedRequest, ResponseBuilder, error_output, models_output, parse_job_input

SERVED = "smollm2-135m"
MAX_LEN = 2048


@pytest.fixture(scope="module")
def tokenizer():
    from kernellab.runtime.request.tokenizer import load_tokenizer

    return load_tokenizer("smollm2-135m")


def _chat(**body) -> dict:
    return {"openai_route": "/v1/chat/completions",
            "openai_input": {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}], **body}}  # fmt: skip


def _parse(job_input, tokenizer):
    return parse_job_input(job_input, tokenizer, SERVED, MAX_LEN)


def test_openai_chat_input_goes_through_the_gateway_parser(tokenizer):
    request = _parse(_chat(max_tokens=7, temperature=0.2, stop="\n", stream=True,
                           stream_options={"include_usage": True}), tokenizer)  # fmt: skip
    assert request.kind == "chat" and request.stream and request.prepared.include_usage
    assert request.prompt_token_ids == tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert (request.params.max_tokens, request.params.temperature, request.params.stop) == (7, 0.2, ["\n"])
    assert request.prepared.model == SERVED


def test_openai_completions_input(tokenizer):
    request = _parse({"openai_route": "/v1/completions",
                      "openai_input": {"model": SERVED, "prompt": "Once", "max_tokens": 3}}, tokenizer)  # fmt: skip
    assert request.kind == "completion" and not request.stream
    assert request.prompt_token_ids == tokenizer.encode("Once") and request.params.max_tokens == 3


def test_native_inputs(tokenizer):
    by_prompt = _parse({"prompt": "Once", "sampling_params": {"max_tokens": 4, "seed": 1}, "stream": True}, tokenizer)
    assert by_prompt.kind == "native" and by_prompt.stream and by_prompt.params.seed == 1
    by_messages = _parse({"messages": [{"role": "user", "content": "Hi"}]}, tokenizer)
    assert by_messages.params.max_tokens == 256 and not by_messages.stream


@pytest.mark.parametrize(
    ("job_input", "error", "param"),
    [
        ("text", InvalidRequestError, "input"),
        ({"openai_route": "/v1/embeddings", "openai_input": {}}, InvalidRequestError, "openai_route"),
        (_chat(model="gpt-4"), UnknownModelError, "model"),
        (_chat(n=2), InvalidRequestError, "n"),
        (_chat(temperature=-1), InvalidRequestError, "temperature"),
        (_chat(stream="yes"), InvalidRequestError, "stream"),
        (_chat(max_tokens=MAX_LEN), ContextLengthError, "max_tokens"),
        ({"openai_route": "/v1/completions", "openai_input": {"model": SERVED, "prompt": ["a", "b"]}},
         InvalidRequestError, "prompt"),
        ({"openai_route": "/v1/completions", "openai_input": {"model": SERVED, "prompt": "a", "echo": True}},
         InvalidRequestError, "echo"),
        ({"prompt": "x", "messages": []}, InvalidRequestError, "prompt"),
        ({"prompt": "x", "sampling_params": {"max_tokenz": 3}}, InvalidRequestError, "sampling_params.max_tokenz"),
        ({"prompt": "x", "extra": 1}, InvalidRequestError, "extra"),
        ({"prompt": ""}, InvalidRequestError, "prompt"),
        ({"prompt": "x", "stream": "yes"}, InvalidRequestError, "stream"),
    ],
)  # fmt: skip
def test_bad_inputs_are_clean_errors(tokenizer, job_input, error, param):
    with pytest.raises(error) as caught:
        _parse(job_input, tokenizer)
    assert caught.value.param == param
    out = error_output(caught.value)
    assert out["error"]["type"] == "invalid_request_error" and out["error"]["message"]


def test_models_route():
    assert parse_job_input({"openai_route": "/v1/models"}, None, SERVED, MAX_LEN).kind == "models"
    assert models_output(SERVED)["data"][0]["id"] == SERVED


def _sse_payloads(outputs: list[str]) -> list:
    assert all(o.startswith("data: ") and o.endswith("\n\n") for o in outputs)
    return [o[len("data: ") : -2] for o in outputs]


def test_openai_chat_stream_shape(tokenizer):
    request = _parse(_chat(stream=True, stream_options={"include_usage": True}), tokenizer)
    builder = ResponseBuilder(request, tokenizer)
    outputs = [builder.opening(), builder.piece("Hel", [5]), builder.piece("", [6]), builder.piece("lo", [7])]
    outputs = [o for o in outputs if o is not None]
    outputs += builder.closing("!", "stop", num_prompt=2, num_output=4)
    payloads = _sse_payloads(outputs)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "Hello!"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 6
    assert len({c["id"] for c in chunks}) == 1 and {c["object"] for c in chunks} == {"chat.completion.chunk"}


def test_openai_non_stream_shapes(tokenizer):
    chat = ResponseBuilder(_parse(_chat(), tokenizer), tokenizer)
    assert chat.piece("Hi", [1]) is None
    [full] = chat.closing(" there", "length", 1, 2)
    assert full["object"] == "chat.completion"
    assert full["choices"][0]["message"]["content"] == "Hi there"
    assert full["choices"][0]["finish_reason"] == "length" and full["usage"]["total_tokens"] == 3
    request = _parse({"openai_route": "/v1/completions", "openai_input": {"model": SERVED, "prompt": "a"}}, tokenizer)
    completion = ResponseBuilder(request, tokenizer)
    completion.piece("abc", [1])
    [full] = completion.closing("", "stop", 1, 1)
    assert full["object"] == "text_completion" and full["choices"][0]["text"] == "abc"


def test_chat_logprobs_follow_their_tokens(tokenizer):
    request = _parse(_chat(logprobs=True, top_logprobs=1, stream=True), tokenizer)
    builder = ResponseBuilder(request, tokenizer)
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    entries = [[t, -0.5, [[t, -0.5]]] for t in ids]
    assert builder.piece("", ids[:1], entries[:1]) is None  # no text yet: the entry waits
    chunk = json.loads(_sse_payloads([builder.piece("Hello world", ids[1:], entries[1:])])[0])
    content = chunk["choices"][0]["logprobs"]["content"]
    assert [c["logprob"] for c in content] == [-0.5] * len(ids)
    assert "".join(c["token"] for c in content).strip() == "Hello world"


def test_native_shapes(tokenizer):
    streamed = ResponseBuilder(ParsedRequest("native", [1], None, True), tokenizer)
    assert streamed.piece("a", [4]) == {"text": "a", "token_ids": [4]}
    [last] = streamed.closing("b", "stop", 1, 2)
    assert last == {"text": "b", "finish_reason": "stop",
                    "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}  # fmt: skip
    whole = ResponseBuilder(ParsedRequest("native", [1], None, False), tokenizer)
    assert whole.piece("a", [4]) is None
    [out] = whole.closing("b", "length", 1, 2)
    assert out["text"] == "ab" and out["token_ids"] == [4] and out["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("message", "fault"),
    [
        ("CUDA error: an illegal memory access was encountered", True),
        ("CUDA error: device-side assert triggered", True),
        ("CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx`", True),
        ("CUDA out of memory. Tried to allocate 2.00 GiB", False),
        ("shape mismatch", False),
    ],
)
def test_cuda_fault_classification(message, fault):
    assert is_cuda_fault(RuntimeError(message)) is fault


def test_engine_loop_exits_non_zero_after_a_cuda_fault(tmp_path):
    """A CUDA fault cannot be caused on a CPU machine, so a stand-in engine raises the error text torch
    raises; the real EngineLoop and the handler's exit path then run in a real process."""
    script = tmp_path / "fault.py"
    script.write_text(
        textwrap.dedent(f"""
        import asyncio, sys
        sys.path.insert(0, {str(REPO / "runpod")!r})
        from engine_loop import EngineLoop
        import handler

        class FaultingEngine:
            def __init__(self):
                self.pending = set()
            def add_request(self, request_id, prompt_token_ids, params):
                self.pending.add(request_id)
            def has_unfinished_requests(self):
                return bool(self.pending)
            def step(self):
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            def abort(self, request_id):
                self.pending.discard(request_id)

        async def main():
            loop = EngineLoop(FaultingEngine(), on_fatal=lambda e: handler.exit_after_fault(e, grace_s=0.1))
            loop.start()
            error = await asyncio.wait_for(loop.submit("job-1", [1, 2, 3], None).get(), 10)
            print("job saw:", error, flush=True)
            await asyncio.sleep(30)  # the engine thread ends the process before this

        asyncio.run(main())
    """)
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "job saw: CUDA error: an illegal memory access" in done.stdout


TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CALL_TEXT = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_come_back_parsed_as_the_gateway_parses_them(tokenizer, stream):
    request = _parse(_chat(tools=[TOOL], tool_choice="required", stream=stream), tokenizer)
    assert "lark" in request.params.structured  # forced: the engine decodes under the tool-call grammar
    builder = ResponseBuilder(request, tokenizer)
    outputs = [builder.opening(), builder.piece(CALL_TEXT[:15], [1, 2]), builder.piece(CALL_TEXT[15:], [3])]
    outputs = [o for o in outputs if o is not None] + builder.closing("", "stop", 3, 3)
    if not stream:
        [full] = outputs
        choice = full["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_time"]
        return
    chunks = [json.loads(p) for p in _sse_payloads(outputs)[:-1]]
    calls = [c for ch in chunks for c in ch["choices"][0]["delta"].get("tool_calls", [])]
    assert [c["function"]["name"] for c in calls] == ["get_time"] and calls[0]["index"] == 0
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks) == ""


def test_the_handlers_engine_config_takes_the_workers_kernel_settings(monkeypatch):
    """``engine_config_from_env`` maps the same KERNELLAB_* variables as ``kernellab worker``: the kernel level and
    the comma-separated list of ops kept on torch arrive as the engine's fields."""
    import importlib

    monkeypatch.setenv("KERNELLAB_KERNELS", "experimental")
    monkeypatch.setenv("KERNELLAB_DISABLED_KERNELS", "rms_norm,argmax")
    monkeypatch.setenv("KERNELLAB_ASYNC_SCHEDULING", "false")
    handler = importlib.import_module("handler")
    cfg = handler.engine_config_from_env()
    assert (cfg.kernels, cfg.disabled_kernels, cfg.async_scheduling) == ("experimental", ("rms_norm", "argmax"), False)
