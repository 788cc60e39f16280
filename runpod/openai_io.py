"""RunPod job input → (prompt token ids, SamplingParams), and engine output → the job's output objects.

Two input shapes (runpod/README.md):

- OpenAI, as RunPod's OpenAI-compatible endpoint sends it:
  ``{"openai_route": "/v1/chat/completions" | "/v1/completions" | "/v1/models", "openai_input": {...}}``.
  Streaming outputs are Server-Sent-Event strings (``"data: {chunk}\\n\\n"``, ending with ``data: [DONE]``),
  which RunPod's proxy passes to the client unchanged; a non-streaming request yields one response object.
- Native: ``{"prompt": str | "messages": [...], "sampling_params": {...}, "stream": bool}``. Outputs are
  ``{"text", "token_ids"}`` pieces and a last piece with ``finish_reason`` and ``usage``.

Errors come back as OpenAI error objects (``{"error": {...}}``), which the SDK turns into a failed job.
No torch here: the handler's tests exercise this module on its own.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, fields

from kernellab.runtime.errors import InvalidRequestError, KernellabError, UnknownModelError
from kernellab.runtime.sampling import SamplingParams

CHAT_ROUTE = "/v1/chat/completions"
COMPLETIONS_ROUTE = "/v1/completions"
MODELS_ROUTE = "/v1/models"
ROUTES = (CHAT_ROUTE, COMPLETIONS_ROUTE, MODELS_ROUTE)
# A native request without max_tokens stops here; an OpenAI request follows OpenAI (the rest of the context).
NATIVE_DEFAULT_MAX_TOKENS = 256

# OpenAI request fields → SamplingParams fields, for fields that carry over as they are.
_OPENAI_SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "include_stop_str_in_output",
)
# Accepted and ignored: they change nothing in what we generate.
_OPENAI_IGNORED = (
    "model",
    "messages",
    "prompt",
    "stream",
    "stream_options",
    "n",
    "user",
    "metadata",
    "store",
    "max_tokens",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "echo",
    "suffix",
    "response_format",
    "service_tier",
    "parallel_tool_calls",
)


@dataclass
class ParsedRequest:
    kind: str  # "chat" | "completion" | "native" | "models"
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool  # OpenAI stream_options.include_usage; native outputs always carry usage


def parse_job_input(job_input, tokenizer, served_models: tuple[str, ...]) -> ParsedRequest:
    """Validate one job's input; raise KernellabError with a message meant for the caller."""
    if not isinstance(job_input, dict):
        raise InvalidRequestError("the job input must be a JSON object", param="input")
    if "openai_route" in job_input:
        return _parse_openai(job_input, tokenizer, served_models)
    return _parse_native(job_input, tokenizer)


def _parse_openai(job_input: dict, tokenizer, served_models: tuple[str, ...]) -> ParsedRequest:
    route = job_input["openai_route"]
    if route not in ROUTES:
        raise InvalidRequestError(
            f"openai_route must be one of {', '.join(ROUTES)}, got {route!r}", param="openai_route"
        )
    body = job_input.get("openai_input") or {}
    if not isinstance(body, dict):
        raise InvalidRequestError("openai_input must be a JSON object", param="openai_input")
    if route == MODELS_ROUTE:
        return ParsedRequest("models", [], SamplingParams(), False, False)
    model = body.get("model")
    if model is not None and model not in served_models:
        raise UnknownModelError(
            f"model {model!r} is not served here; this endpoint serves {served_models[0]!r}"
        )
    if body.get("n", 1) != 1:
        raise InvalidRequestError("n must be 1", param="n")
    if body.get("logprobs") or body.get("top_logprobs") or body.get("echo"):
        raise InvalidRequestError(
            "logprobs and echo are served by the gateway, not by the RunPod handler", param="logprobs"
        )
    unknown = sorted(set(body) - set(_OPENAI_SAMPLING) - set(_OPENAI_IGNORED))
    if unknown:
        raise InvalidRequestError(f"unsupported field(s): {', '.join(unknown)}", param=unknown[0])
    sampling = {name: body[name] for name in _OPENAI_SAMPLING if body.get(name) is not None}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        sampling["max_tokens"] = max_tokens
    params = SamplingParams(**sampling)
    stream = _flag(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise InvalidRequestError("stream_options must be an object", param="stream_options")
    include_usage = stream and bool(options.get("include_usage"))
    if route == CHAT_ROUTE:
        ids = tokenizer.apply_chat_template(body.get("messages"))
        return ParsedRequest("chat", ids, params, stream, include_usage)
    return ParsedRequest(
        "completion", _encode_prompt(body.get("prompt"), tokenizer), params, stream, include_usage
    )


def _parse_native(job_input: dict, tokenizer) -> ParsedRequest:
    allowed = {"prompt", "messages", "sampling_params", "stream"}
    unknown = sorted(set(job_input) - allowed)
    if unknown:
        raise InvalidRequestError(
            f"unsupported field(s): {', '.join(unknown)}; expected prompt or messages, "
            "sampling_params, stream (or openai_route and openai_input)",
            param=unknown[0],
        )
    if ("prompt" in job_input) == ("messages" in job_input):
        raise InvalidRequestError("give exactly one of prompt and messages", param="prompt")
    sampling = job_input.get("sampling_params") or {}
    if not isinstance(sampling, dict):
        raise InvalidRequestError("sampling_params must be an object", param="sampling_params")
    known = {f.name for f in fields(SamplingParams)}
    bad = sorted(set(sampling) - known)
    if bad:
        raise InvalidRequestError(
            f"unknown sampling_params field(s): {', '.join(bad)}; known: {', '.join(sorted(known))}",
            param=f"sampling_params.{bad[0]}",
        )
    params = SamplingParams(**{"max_tokens": NATIVE_DEFAULT_MAX_TOKENS, **sampling})
    if "messages" in job_input:
        ids = tokenizer.apply_chat_template(job_input["messages"])
    else:
        ids = _encode_prompt(job_input["prompt"], tokenizer)
    return ParsedRequest("native", ids, params, _flag(job_input, "stream"), True)


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be true or false", param=name)
    return value


def _encode_prompt(prompt, tokenizer) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        return tokenizer.encode(prompt)
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return list(prompt)
    raise InvalidRequestError("prompt must be a string or a list of token ids", param="prompt")


def error_output(error: BaseException) -> dict:
    """An OpenAI error object; the RunPod SDK fails the job with it."""
    if isinstance(error, KernellabError):
        return error.to_openai()
    return {
        "error": {
            "message": f"{type(error).__name__}: {error}",
            "type": "server_error",
            "param": None,
            "code": None,
        }
    }


def models_output(served_model: str) -> dict:
    return {
        "object": "list",
        "data": [{"id": served_model, "object": "model", "created": 0, "owned_by": "kernellab"}],
    }


def _sse(payload) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class ResponseBuilder:
    """Turns text deltas of one request into that request's outputs, in its shape."""

    def __init__(self, request: ParsedRequest, request_id: str, served_model: str):
        self.request = request
        self.served_model = served_model
        self.created = int(time.time())
        prefix = {"chat": "chatcmpl", "completion": "cmpl"}.get(request.kind, "kl")
        self.id = f"{prefix}-{request_id}"
        self._object = "chat.completion" if request.kind == "chat" else "text_completion"
        self.text: list[str] = []
        self.token_ids: list[int] = []

    # ---- streaming pieces
    def opening(self) -> str | None:
        """The first chunk of an OpenAI chat stream announces the role."""
        if self.request.kind == "chat" and self.request.stream:
            return _sse(self._chunk({"role": "assistant", "content": ""}, None))
        return None

    def piece(self, text: str, token_ids: list[int]):
        """Output for newly generated tokens, or None when nothing goes out yet (non-streaming)."""
        self.text.append(text)
        self.token_ids.extend(token_ids)
        if not self.request.stream or not (text or token_ids):
            return None
        if self.request.kind == "native":
            return {"text": text, "token_ids": list(token_ids)}
        if not text:  # OpenAI chunks carry text; token ids without text yet (a split character) wait
            return None
        delta = {"content": text} if self.request.kind == "chat" else text
        return _sse(self._chunk(delta, None))

    def closing(self, tail: str, finish_reason: str | None, num_prompt: int, num_output: int) -> list:
        """What ends the request: the last pieces of a stream, or the whole non-streaming response."""
        self.text.append(tail)
        reason = finish_reason or "stop"  # the engine's "stop" | "length" | "deadline" | "abort"
        usage = {
            "prompt_tokens": num_prompt,
            "completion_tokens": num_output,
            "total_tokens": num_prompt + num_output,
        }
        kind, stream = self.request.kind, self.request.stream
        if kind == "native":
            out = {"text": tail if stream else "".join(self.text), "finish_reason": reason, "usage": usage}
            if not stream:
                out["token_ids"] = self.token_ids
            return [out]
        if not stream:
            return [self._full(reason, usage)]
        delta = ({"content": tail} if tail else {}) if kind == "chat" else tail
        outputs = [_sse(self._chunk(delta, reason))]
        if self.request.include_usage:
            outputs.append(
                _sse(
                    {
                        "id": self.id,
                        "object": self._object + ("" if kind == "completion" else ".chunk"),
                        "created": self.created,
                        "model": self.served_model,
                        "choices": [],
                        "usage": usage,
                    }
                )
            )
        outputs.append("data: [DONE]\n\n")
        return outputs

    def _chunk(self, delta, finish_reason: str | None) -> dict:
        if self.request.kind == "chat":
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return {
                "id": self.id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.served_model,
                "choices": [choice],
            }
        choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish_reason}
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.served_model,
            "choices": [choice],
        }

    def _full(self, reason: str, usage: dict) -> dict:
        text = "".join(self.text)
        if self.request.kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": reason,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        return {
            "id": self.id,
            "object": self._object,
            "created": self.created,
            "model": self.served_model,
            "choices": [choice],
            "usage": usage,
        }
