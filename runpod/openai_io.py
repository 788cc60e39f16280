"""RunPod job input → (prompt token ids, SamplingParams), and engine output → the job's output objects.

Two input shapes (runpod/README.md):

- OpenAI, as RunPod's OpenAI-compatible endpoint sends it:
  ``{"openai_route": "/v1/chat/completions" | "/v1/completions" | "/v1/models", "openai_input": {...}}``.
  The body is validated and tokenized by the gateway's own code (services/gateway/requests.py) and answered
  in the gateway's shapes (responses.py), so both front ends accept and return the same things. Streaming
  outputs are Server-Sent-Event strings (``"data: {chunk}\\n\\n"``, ending with ``data: [DONE]``), which
  RunPod's proxy passes to the client unchanged; a non-streaming request yields one response object.
- Native: ``{"prompt": str | "messages": [...], "sampling_params": {...}, "stream": bool}``. Outputs are
  ``{"text", "token_ids"}`` pieces and a last piece with ``finish_reason`` and ``usage``.

Errors come back as OpenAI error objects (``{"error": {...}}``), which the SDK turns into a failed job.
One job is one engine request: ``n`` > 1 and several prompts per completion request go to the gateway.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields

from kernellab.runtime.request.errors import InvalidRequestError, KernellabError
from kernellab.runtime.request.sampling import SamplingParams
from kernellab.services.gateway import responses
from kernellab.services.gateway.output_parsers import ChatOutputParser, finish_delta, with_alias
from kernellab.services.gateway.requests import Prepared, prepare

CHAT_ROUTE = "/v1/chat/completions"
COMPLETIONS_ROUTE = "/v1/completions"
MODELS_ROUTE = "/v1/models"
ROUTES = (CHAT_ROUTE, COMPLETIONS_ROUTE, MODELS_ROUTE)
# A native request without max_tokens stops here; an OpenAI request follows OpenAI (the rest of the context).
NATIVE_DEFAULT_MAX_TOKENS = 256


@dataclass
class ParsedRequest:
    kind: str  # "chat" | "completion" | "native" | "models"
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    prepared: Prepared | None = None  # the gateway's view of an OpenAI request


def parse_job_input(job_input, tokenizer, served_model: str, max_model_len: int) -> ParsedRequest:
    """Validate one job's input; raise KernellabError with a message meant for the caller."""
    if not isinstance(job_input, dict):
        raise InvalidRequestError("the job input must be a JSON object", param="input")
    if "openai_route" in job_input:
        return _parse_openai(job_input, tokenizer, served_model, max_model_len)
    return _parse_native(job_input, tokenizer)


def _parse_openai(job_input: dict, tokenizer, served_model: str, max_model_len: int) -> ParsedRequest:
    route = job_input["openai_route"]
    if route not in ROUTES:
        raise InvalidRequestError(f"openai_route must be one of {', '.join(ROUTES)}, got {route!r}",
                                  param="openai_route")  # fmt: skip
    if route == MODELS_ROUTE:
        return ParsedRequest("models", [], SamplingParams(), False)
    body = job_input.get("openai_input")
    kind = "chat" if route == CHAT_ROUTE else "completion"
    prepared = prepare(kind, body, tokenizer, served_model=served_model, max_model_len=max_model_len, max_n=1)
    if len(prepared.prompts) != 1:
        raise InvalidRequestError("one prompt per job; send several prompts as several jobs", param="prompt")
    if prepared.echo_text:
        raise InvalidRequestError("echo is served by the gateway, not by the RunPod handler", param="echo")
    if prepared.discard_output:
        raise InvalidRequestError(
            "max_tokens 0 is served by the gateway, not by the RunPod handler", param="max_tokens"
        )
    params = prepared.choices[0].params
    return ParsedRequest(kind, prepared.prompts[0], params, prepared.stream, prepared)


def _parse_native(job_input: dict, tokenizer) -> ParsedRequest:
    allowed = {"prompt", "messages", "sampling_params", "stream"}
    unknown = sorted(set(job_input) - allowed)
    if unknown:
        raise InvalidRequestError(f"unsupported field(s): {', '.join(unknown)}; expected prompt or messages, "
                                  "sampling_params, stream (or openai_route and openai_input)", param=unknown[0])  # fmt: skip
    if ("prompt" in job_input) == ("messages" in job_input):
        raise InvalidRequestError("give exactly one of prompt and messages", param="prompt")
    sampling = job_input.get("sampling_params") or {}
    if not isinstance(sampling, dict):
        raise InvalidRequestError("sampling_params must be an object", param="sampling_params")
    known = {f.name for f in fields(SamplingParams)}
    bad = sorted(set(sampling) - known)
    if bad:
        raise InvalidRequestError(f"unknown sampling_params field(s): {', '.join(bad)}; known: "
                                  f"{', '.join(sorted(known))}", param=f"sampling_params.{bad[0]}")  # fmt: skip
    params = SamplingParams(**{"max_tokens": NATIVE_DEFAULT_MAX_TOKENS, **sampling})
    stream = job_input.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequestError("stream must be true or false", param="stream")
    if "messages" in job_input:
        ids = tokenizer.apply_chat_template(job_input["messages"])
    else:
        prompt = job_input["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise InvalidRequestError("prompt must be a non-empty string", param="prompt")
        ids = tokenizer.encode(prompt)
    return ParsedRequest("native", ids, params, stream)


def error_output(error: BaseException) -> dict:
    """An OpenAI error object; the RunPod SDK fails the job with it."""
    if isinstance(error, KernellabError):
        return error.to_openai()
    return {"error": {"message": f"{type(error).__name__}: {error}", "type": "server_error", "param": None,
                      "code": None}}  # fmt: skip


def models_output(served_model: str) -> dict:
    return {"object": "list",
            "data": [{"id": served_model, "object": "model", "created": 0, "owned_by": "kernellab"}]}  # fmt: skip


def logprob_entries(new_logprobs) -> list:
    """The engine's TokenLogprob objects in the gateway's wire format: [token_id, logprob, [[id, lp], ...]]."""
    return [[lp.token_id, lp.logprob, [[t, v] for t, v in lp.top]] for lp in new_logprobs or ()]


class ResponseBuilder:
    """Turns the text deltas of one request into that request's outputs, in its shape."""

    def __init__(self, request: ParsedRequest, tokenizer):
        self.request = request
        self.created = int(time.time())
        self.token_text = responses.TokenText(tokenizer)
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list = []  # every entry so far (non-streaming answers)
        self._unsent_logprobs: list = []  # entries not yet in a chunk
        self._text_offset = 0  # completion logprobs' text_offset
        cfg = request.prepared.parser if request.prepared is not None else None
        # Chat: reasoning / content / tool calls split as the gateway splits them.
        self.parser = ChatOutputParser(cfg) if cfg is not None and (cfg.reasoning or cfg.tools) else None

    # ---- streaming pieces
    def opening(self) -> str | None:
        """The first chunk of an OpenAI chat stream announces the role."""
        if self.request.kind == "chat" and self.request.stream:
            return self._sse(responses.chat_chunk(self.request.prepared, self.created, 0,
                                                  {"role": "assistant", "content": ""}, None, None))  # fmt: skip
        return None

    def piece(self, text: str, token_ids: list[int], logprobs: list | None = None):
        """Output for newly generated tokens, or None when nothing goes out yet."""
        self.text.append(text)
        self.token_ids.extend(token_ids)
        self.logprobs.extend(logprobs or ())
        self._unsent_logprobs.extend(logprobs or ())
        if not self.request.stream or not (text or token_ids):
            return None
        if self.request.kind == "native":
            return {"text": text, "token_ids": list(token_ids)}
        if self.parser is not None:
            delta = with_alias(self.parser.feed(text, token_ids))
            return self._sse(self._chunk(text, None, delta)) if delta else None
        if not text:  # tokens of a character that is not complete yet: they go out with the next text
            return None
        return self._sse(self._chunk(text, None))

    def closing(self, tail: str, finish_reason: str | None, num_prompt: int, num_output: int,
                num_cached: int = 0) -> list:  # fmt: skip
        """What ends the request: the last pieces of a stream, or the whole non-streaming response."""
        self.text.append(tail)
        reason = finish_reason or "stop"  # the engine's "stop" | "length" | "deadline" | "abort"
        kind, stream = self.request.kind, self.request.stream
        if kind == "native":
            usage = {"prompt_tokens": num_prompt, "completion_tokens": num_output,
                     "total_tokens": num_prompt + num_output}  # fmt: skip
            out = {"text": tail if stream else "".join(self.text), "finish_reason": reason, "usage": usage}
            if not stream:
                out["token_ids"] = self.token_ids
            return [out]
        prepared = self.request.prepared
        delta = None
        if self.parser is not None:
            # A stream fed the parser piece by piece; a whole response parses its text once, here.
            pending = self.parser.feed(tail, []) if stream else self.parser.feed("".join(self.text), self.token_ids)
            delta, reason = finish_delta(self.parser, pending, reason)
        reasoning = self.parser.reasoning_tokens if self.parser is not None and prepared.parser.reasoning else None
        usage = responses.usage(num_prompt, num_output, num_cached, reasoning)
        if not stream:
            text = "".join(self.text)
            logprobs = self._format_logprobs(self.logprobs, offset=0)
            if kind == "chat":
                parsed = self.parser.result() if self.parser is not None else None
                choice = responses.chat_choice(0, text, logprobs, reason, parsed)
            else:
                choice = responses.completion_choice(0, text, logprobs, reason)
            return [responses.final_response(prepared, self.created, [choice], usage)]
        outputs = [self._sse(self._chunk(tail, reason, with_alias(delta) if delta is not None else None))]
        if prepared.include_usage:
            outputs.append(self._sse(responses.usage_chunk(prepared, self.created, usage)))
        outputs.append(responses.SSE_DONE.decode())
        return outputs

    def _chunk(self, text: str, finish_reason: str | None, delta: dict | None = None) -> dict:
        logprobs = self._format_logprobs(self._unsent_logprobs, self._text_offset)
        self._unsent_logprobs = []
        self._text_offset += len(text)
        with_usage = self.request.prepared.include_usage
        if self.request.kind == "chat":
            if delta is None:
                delta = {"content": text} if text else {}
            return responses.chat_chunk(self.request.prepared, self.created, 0, delta, logprobs, finish_reason,
                                        with_usage_field=with_usage)  # fmt: skip
        return responses.completion_chunk(self.request.prepared, self.created, 0, text, logprobs, finish_reason,
                                          with_usage_field=with_usage)  # fmt: skip

    def _format_logprobs(self, entries: list, offset: int):
        if self.request.prepared.logprobs is None:
            return None
        if self.request.kind == "chat":
            return responses.chat_logprobs(entries, self.token_text)
        return responses.completion_logprobs(entries, self.token_text, offset)

    @staticmethod
    def _sse(chunk: dict) -> str:
        return responses.sse(chunk).decode()
