"""Parse and validate OpenAI request bodies into a ``Prepared`` request: tokenized, checked against the context.

Every problem raises a ``KernellabError`` subclass with the OpenAI ``param`` it concerns, so the gateway answers
4xx with an OpenAI error object and never 5xx for bad input. Unknown fields are ignored, as OpenAI does;
known fields are type-checked strictly (``"max_tokens": "5"`` is an error, not 5).
"""

from __future__ import annotations

import functools
import uuid
from dataclasses import dataclass, field, replace

from pydantic import BaseModel, ConfigDict, ValidationError

from kernellab.runtime.errors import ContextLengthError, InvalidRequestError, UnknownModelError
from kernellab.runtime.registry import resolve_model
from kernellab.runtime.sampling import MAX_SEED, SamplingParams

_TEXT_PART_TYPES = ("text", "input_text")


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: dict | None = None
    user: str | None = None
    service_tier: str | None = None  # "flex" → the batch-priority stream
    ignore_eos: bool | None = None


class ChatBody(_Common):
    messages: list
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class CompletionBody(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None


@dataclass
class Choice:
    index: int
    prompt_index: int
    params: SamplingParams


@dataclass
class Prepared:
    kind: str  # "chat" | "completion"
    request_id: str
    model: str  # the served model's name (what responses report)
    prompts: list[list[int]]
    choices: list[Choice]
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # top-k per token; None: no logprobs
    priority: str = "interactive"
    echo_text: list[str] = field(default_factory=list)  # completions with echo: the prompt text per prompt

    @property
    def n_choices(self) -> int:
        return len(self.choices)


def _validation_error(exc: ValidationError) -> InvalidRequestError:
    err = exc.errors()[0]
    loc = [str(p) for p in err.get("loc", ())]
    param = loc[0] if loc else None
    where = ".".join(loc) or "body"
    if err.get("type") == "missing":
        return InvalidRequestError(f"missing required field '{where}'", param=param)
    return InvalidRequestError(f"invalid value for '{where}': {err.get('msg')}", param=param)


@functools.lru_cache(maxsize=16)
def _served_names(served_name: str) -> tuple[str, str | None]:
    spec = resolve_model(served_name)  # configuration, not client input
    return spec.name, spec.hub_id.lower() if spec.hub_id else None


def check_model(requested: str, served_name: str) -> str:
    """The served model's name when ``requested`` names it (registry name or hub id); 404 otherwise.
    Compared by name only: a client's string never reaches the registry's local-path lookup, which would
    probe the gateway's filesystem (and raised RuntimeError for '~unknownuser', a 500)."""
    name, hub_id = _served_names(served_name)
    wanted = requested.strip()
    if wanted != name and (hub_id is None or wanted.lower() != hub_id):
        raise UnknownModelError(f"model {requested!r} is not served here; this gateway serves {served_name!r}")
    return served_name


def _normalize_messages(messages: list) -> list[dict]:
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequestError(f"messages[{i}] must be an object", param=f"messages[{i}]")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") not in _TEXT_PART_TYPES \
                        or not isinstance(part.get("text"), str):
                    raise InvalidRequestError(f"messages[{i}].content[{j}]: only text parts are supported",
                                              param=f"messages[{i}].content")
                texts.append(part["text"])
            m = {**m, "content": "".join(texts)}
        out.append(m)
    return out


def _params(body: _Common, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    kwargs = {"max_tokens": max_tokens, "logprobs": logprobs}
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "seed", "ignore_eos"):
        value = getattr(body, name)
        if value is not None:
            kwargs[name] = value
    if body.stop is not None:
        kwargs["stop"] = [body.stop] if isinstance(body.stop, str) else list(body.stop)
    return SamplingParams(**kwargs)


def _check_context(prompt_len: int, max_tokens: int | None, max_model_len: int, param: str) -> None:
    if prompt_len == 0:
        raise InvalidRequestError("the prompt is empty", param=param)
    if prompt_len >= max_model_len:
        raise ContextLengthError(f"this model's maximum context length is {max_model_len} tokens; the prompt has "
                                 f"{prompt_len} tokens, which leaves no room to generate", param=param)
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        raise ContextLengthError(f"this model's maximum context length is {max_model_len} tokens; you requested "
                                 f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for "
                                 "the completion)", param="max_tokens")


# OpenAI parameters that would change the answer and that this server does not honour yet: a request that sets
# one gets a 400 naming it, never a 200 that silently ignored it. Each maps to the values that ask for nothing
# (an empty or "off" value is accepted).
_UNSUPPORTED = {
    "chat": {"tools": ([], None), "tool_choice": ("none", None), "functions": ([], None), "function_call": ("none", None),
             "response_format": ({"type": "text"}, None), "logit_bias": ({}, None), "audio": (None,),
             "modalities": (["text"], None), "prediction": (None,), "web_search_options": (None,)},
    "completion": {"logit_bias": ({}, None), "suffix": (None, "")},
}


def _refuse_unsupported(kind: str, data: dict) -> None:
    for name, neutral in _UNSUPPORTED[kind].items():
        if name in data and data[name] not in neutral:
            raise InvalidRequestError(f"'{name}' is not supported by this server; leave it out", param=name,
                                      code="unsupported_parameter")
    if kind == "completion" and data.get("best_of") not in (None, data.get("n", 1) or 1):
        raise InvalidRequestError("'best_of' is supported only equal to n (no server-side candidates)",
                                  param="best_of", code="unsupported_parameter")


def prepare(kind: str, data, tokenizer, *, served_model: str, max_model_len: int, max_n: int) -> Prepared:
    """Validate a decoded JSON body of /v1/chat/completions (``kind="chat"``) or /v1/completions."""
    if not isinstance(data, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    _refuse_unsupported(kind, data)
    try:
        body = (ChatBody if kind == "chat" else CompletionBody).model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    model = check_model(body.model, served_model)
    n = 1 if body.n is None else body.n
    if not 1 <= n <= max_n:
        raise InvalidRequestError(f"n must be between 1 and {max_n}, got {n}", param="n")
    if body.seed is not None and not 0 <= body.seed <= MAX_SEED - max_n:
        raise InvalidRequestError(f"seed must be in [0, {MAX_SEED - max_n}]", param="seed")
    echo: list[str] = []
    if kind == "chat":
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if body.top_logprobs is not None and not body.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs=true", param="top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        if not isinstance(body.messages, list) or not body.messages:
            raise InvalidRequestError("messages must be a non-empty list", param="messages")
        prompts = [tokenizer.apply_chat_template(_normalize_messages(body.messages))]
        prefix = "chatcmpl"
        param = "messages"
    else:
        max_tokens = body.max_tokens
        logprobs = body.logprobs
        prompt = body.prompt
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if isinstance(prompt[0], int):
            prompt = [prompt]
        prompts = []
        vocab = tokenizer.vocab_size
        for p in prompt:
            ids = tokenizer.encode(p) if isinstance(p, str) else list(p)
            if ids and (min(ids) < 0 or max(ids) >= vocab):  # ints already (the body model checked them)
                raise InvalidRequestError(f"token ids must be in [0, {vocab})", param="prompt")
            prompts.append(ids)
            if body.echo:
                echo.append(p if isinstance(p, str) else tokenizer.decode(ids))
        prefix = "cmpl"
        param = "prompt"
    base = _params(body, max_tokens, logprobs)
    for ids in prompts:
        _check_context(len(ids), base.max_tokens, max_model_len, param)
    choices = []
    for p in range(len(prompts)):
        for i in range(n):
            params = replace(base, seed=base.seed + i) if base.seed is not None else base
            choices.append(Choice(p * n + i, p, params))
    include_usage = bool(body.stream and isinstance(body.stream_options, dict)
                         and body.stream_options.get("include_usage"))
    priority = "batch" if body.service_tier == "flex" else "interactive"
    return Prepared(kind, f"{prefix}-{uuid.uuid4().hex}", model, prompts, choices, bool(body.stream), include_usage,
                    logprobs, priority, echo)
