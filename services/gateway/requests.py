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

from kernellab.runtime.request.errors import ContextLengthError, InvalidRequestError, UnknownModelError
from kernellab.runtime.request.registry import resolve_model
from kernellab.runtime.request.sampling import MAX_SEED, SamplingParams
from kernellab.services.gateway.constraints import (
    forced_tool_names,
    parse_logit_bias,
    structured_spec,
    structured_with_think,
    tool_call_grammar,
    validate_tools,
)
from kernellab.services.gateway.options import ServingOptions, default_options
from kernellab.services.gateway.output_parsers import ParserConfig

_TEXT_PART_TYPES = ("text", "input_text")
# /v1/completions without max_tokens (or with null) generates 16 tokens, the API's documented default; chat
# requests without one generate to the end of the context (or the model's generation_config limit).
COMPLETION_DEFAULT_MAX_TOKENS = 16
# /v1/completions with "prompt": null: the API's documented default prompt, a document boundary (a special token
# in Qwen3's and SmolLM2's vocabularies, plain text in others)
COMPLETION_DEFAULT_PROMPT = "<|endoftext|>"
# OpenAI's documented upper bound for temperature (both endpoints)
MAX_TEMPERATURE = 2.0


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
    logit_bias: dict[str, int | float] | None = None
    stop_token_ids: list[int] | None = None
    response_format: dict | None = None


class ChatBody(_Common):
    messages: list
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict | None = None
    reasoning_effort: str | None = None


class CompletionBody(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None


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
    parser: ParserConfig | None = None  # chat: how the output splits into reasoning / content / tool calls
    # completions with max_tokens 0 (the API's minimum: the prompt echoed and scored, nothing generated): the engine
    # still makes one token per choice, which the answer leaves out
    discard_output: bool = False
    # completions with best_of > n: the engine makes best_of candidates per prompt (``choices``) and the answer
    # keeps the ``best_of_keep`` (= n) with the highest mean token logprob of each prompt
    best_of_keep: int | None = None

    @property
    def n_choices(self) -> int:
        return len(self.choices)

    def echo_of(self, index: int) -> str:
        """The prompt text choice ``index`` echoes ("" without echo)."""
        return self.echo_text[self.choices[index].prompt_index] if self.echo_text else ""


# Fields of several accepted shapes: pydantic reports the first shape's complaint ("prompt.str: Input should be a
# valid string"), which names a branch of the union rather than what the field takes.
_UNION_FIELDS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "a string or a list of strings",
    "tool_choice": "'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
}


def validation_error(exc: ValidationError) -> InvalidRequestError:
    err = exc.errors()[0]
    loc = [str(p) for p in err.get("loc", ())]
    param = loc[0] if loc else None
    where = ".".join(loc) or "body"
    if err.get("type") == "missing":
        return InvalidRequestError(f"missing required field '{where}'", param=param)
    if param in _UNION_FIELDS:
        got = "null" if err.get("input", ...) is None else type(err.get("input")).__name__
        return InvalidRequestError(f"'{param}' must be {_UNION_FIELDS[param]} (got {got})", param=param)
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


def normalize_messages(messages: list) -> list[dict]:
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequestError(f"messages[{i}] must be an object", param=f"messages[{i}]")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if (
                    isinstance(part, dict)
                    and part.get("type") == "refusal"
                    and isinstance(part.get("refusal"), str)
                    and m.get("role") == "assistant"
                ):
                    texts.append(part["refusal"])  # an earlier assistant turn's refusal: its text
                    continue
                if (
                    not isinstance(part, dict)
                    or part.get("type") not in _TEXT_PART_TYPES
                    or not isinstance(part.get("text"), str)
                ):
                    raise InvalidRequestError(
                        f"messages[{i}].content[{j}]: only text parts are supported", param=f"messages[{i}].content"
                    )
                texts.append(part["text"])
            m = {**m, "content": "".join(texts)}
        if m.get("role") == "assistant" and "reasoning_content" not in m and isinstance(m.get("reasoning"), str):
            m = {**m, "reasoning_content": m["reasoning"]}  # templates read the older name
        out.append(m)
    return out


def _params(
    body: _Common,
    max_tokens: int | None,
    logprobs: int | None,
    opts: ServingOptions,
    vocab: int,
    structured: dict | None,
) -> SamplingParams:
    kwargs = {"max_tokens": max_tokens, "logprobs": logprobs, **opts.sampling_defaults}
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "seed",
        "ignore_eos",
    ):
        value = getattr(body, name)
        if value is not None:
            kwargs[name] = value
    t = body.temperature  # a float or None: the body model validated it
    if t is not None and t > MAX_TEMPERATURE:
        # the API's documented range; the engine itself takes any t >= 0 (offline use), but over HTTP a value past
        # 2 is a client error, and without max_tokens it samples near-uniform noise to the end of the context
        raise InvalidRequestError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {t}", param="temperature")
    if body.stop is not None:
        kwargs["stop"] = [body.stop] if isinstance(body.stop, str) else list(body.stop)
    if body.stop_token_ids:
        if any(t < 0 or t >= vocab for t in body.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be token ids in [0, {vocab})", param="stop_token_ids")
        kwargs["stop_token_ids"] = list(body.stop_token_ids)
    if body.logit_bias:
        kwargs["logit_bias"] = parse_logit_bias(body.logit_bias, vocab)
    kwargs["structured"] = structured
    return SamplingParams(**kwargs)


_RESERVED_TEMPLATE_ARGS = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "tools"})


def template_kwargs(opts: ServingOptions, requested: dict | None) -> dict:
    """The server's default template switches, overridden key by key by the request's."""
    reserved = _RESERVED_TEMPLATE_ARGS & (requested or {}).keys()
    if reserved:
        raise InvalidRequestError(
            f"chat_template_kwargs cannot set {', '.join(sorted(reserved))}", param="chat_template_kwargs"
        )
    return {**opts.chat_template_kwargs, **(requested or {})}


def _check_context(prompt_len: int, max_tokens: int | None, max_model_len: int, param: str) -> None:
    if prompt_len == 0:
        raise InvalidRequestError("the prompt is empty", param=param)
    if prompt_len >= max_model_len:
        raise ContextLengthError(
            f"this model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{prompt_len} tokens, which leaves no room to generate",
            param=param,
        )
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        raise ContextLengthError(
            f"this model's maximum context length is {max_model_len} tokens; you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for "
            "the completion)",
            param="max_tokens",
        )


# OpenAI parameters that would change the answer and that this server does not honour: a request that sets one
# gets a 400 naming it, never a 200 that silently ignored it. Each maps to the values that ask for nothing (an
# empty or "off" value is accepted). The deprecated functions/function_call are served as the tools they became
# (``_from_functions``).
_UNSUPPORTED: dict[str, dict[str, tuple]] = {
    "chat": {
        "audio": (None,),
        "modalities": (["text"], [], None),
        "prediction": (None,),
        "web_search_options": (None,),
    },
    "completion": {"suffix": (None, "")},
}


def _refuse_unsupported(kind: str, data: dict) -> None:
    for name, neutral in _UNSUPPORTED[kind].items():
        if name in data and data[name] not in neutral:
            raise InvalidRequestError(
                f"'{name}' is not supported by this server; leave it out", param=name, code="unsupported_parameter"
            )


def _from_functions(data: dict) -> tuple[dict, bool]:
    """A chat body using OpenAI's deprecated function calling, as the tools it became: ``functions`` → ``tools``,
    ``function_call`` ("none", "auto" or {"name": ...}) → ``tool_choice``, an assistant turn's ``function_call``
    → one ``tool_calls`` entry, a ``function`` turn → a ``tool`` turn answering the call before it. Returns the
    body and whether the answer must speak the old form too (``functions`` given: a ``function_call`` in the
    message, ``finish_reason`` "function_call", at most one call)."""
    functions, call, messages = data.get("functions"), data.get("function_call"), data.get("messages")
    old_turns = isinstance(messages, list) and any(
        isinstance(m, dict) and (m.get("role") == "function" or m.get("function_call") is not None) for m in messages
    )
    if functions is None and call is None and not old_turns:
        return data, False
    data = {k: v for k, v in data.items() if k not in ("functions", "function_call")}
    legacy = bool(functions)
    if functions is not None:
        if not isinstance(functions, list) or not all(isinstance(f, dict) for f in functions):
            raise InvalidRequestError("functions must be a list of function objects", param="functions")
        if functions and data.get("tools"):
            raise InvalidRequestError("give tools or the deprecated functions, not both", param="functions")
        if functions:
            data["tools"] = [{"type": "function", "function": f} for f in functions]
    if call is not None:
        if call in ("none", "auto"):
            choice = call if legacy else None  # without functions, neither asks for anything
        elif isinstance(call, dict) and isinstance(call.get("name"), str) and legacy:
            choice = {"type": "function", "function": {"name": call["name"]}}
        else:
            raise InvalidRequestError(
                "function_call must be 'none', 'auto' or {'name': ...} naming one of the functions",
                param="function_call",
            )
        if choice is not None:
            if data.get("tool_choice") not in (None, choice):
                raise InvalidRequestError(
                    "give tool_choice or the deprecated function_call, not both", param="function_call"
                )
            data["tool_choice"] = choice
    if old_turns and isinstance(messages, list):
        turns, last_id = [], None
        for i, m in enumerate(messages):
            if isinstance(m, dict) and m.get("function_call") is not None and m.get("role") == "assistant":
                fc = m["function_call"]
                if not isinstance(fc, dict) or not isinstance(fc.get("name"), str):
                    raise InvalidRequestError(
                        f"messages[{i}].function_call must be {{'name': str, 'arguments': str}}",
                        param=f"messages[{i}].function_call",
                    )
                last_id = f"call_{i}"
                args = fc.get("arguments", "{}")
                m = {k: v for k, v in m.items() if k != "function_call"}
                m["tool_calls"] = [
                    {"id": last_id, "type": "function", "function": {"name": fc["name"], "arguments": args}}
                ]
            elif isinstance(m, dict) and m.get("role") == "function":  # its content may be null (a call with no result)
                content = "" if m.get("content") is None else m["content"]
                m = {**m, "role": "tool", "tool_call_id": last_id or f"call_{i}", "content": content}
            turns.append(m)
        data["messages"] = turns
    return data, legacy


def _chat_prompt(
    body: ChatBody, tokenizer, opts: ServingOptions, legacy_functions: bool = False
) -> tuple[list[int], ParserConfig, dict | None]:
    """(prompt ids, output parser config, structured-output spec). ``legacy_functions``: the tools came as the
    deprecated ``functions``, whose answer holds one ``function_call``."""
    if not isinstance(body.messages, list) or not body.messages:
        raise InvalidRequestError("messages must be a non-empty list", param="messages")
    structured = structured_spec(body.response_format)
    tools = validate_tools(body.tools)
    choice = body.tool_choice
    if choice not in (None, "none") and not tools:
        raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
    forced = forced_tool_names(tools, choice)
    use_tools = bool(tools) and choice != "none"
    if use_tools and not opts.tools:
        raise InvalidRequestError(
            "tool calling is turned off on this server (KERNELLAB_TOOL_PARSER=none)",
            param="tools",
            code="unsupported_parameter",
        )
    if forced and structured:
        raise InvalidRequestError(
            "response_format cannot be combined with a tool_choice that forces a call", param="response_format"
        )
    kwargs = template_kwargs(opts, body.chat_template_kwargs)
    if (
        opts.reasoning
        and body.reasoning_effort is not None
        and "enable_thinking" not in (body.chat_template_kwargs or {})
    ):
        kwargs["enable_thinking"] = body.reasoning_effort not in ("none", "minimal")
    text = tokenizer.render_chat(normalize_messages(body.messages), tools=tools if use_tools else None, **kwargs)
    think = ""
    if opts.reasoning:
        tail = text.rstrip()
        think = "" if tail.endswith("</think>") else "open" if tail.endswith("<think>") else "optional"
    parser = ParserConfig(
        reasoning=opts.reasoning,
        reasoning_open=think == "open",
        tools=use_tools,
        think_end_id=opts.think_end_id,
        legacy_functions=legacy_functions and use_tools,
    )
    if forced:
        parallel = body.parallel_tool_calls is not False and not legacy_functions
        structured = {"lark": tool_call_grammar(tools, forced, parallel, think)}
    elif structured is not None:
        structured = structured_with_think(structured, think)
    return tokenizer.encode(text, add_special_tokens=False), parser, structured


def prepare(
    kind: str,
    data,
    tokenizer,
    *,
    served_model: str,
    max_model_len: int,
    max_n: int,
    options: ServingOptions | None = None,
) -> Prepared:
    """Validate a decoded JSON body of /v1/chat/completions (``kind="chat"``) or /v1/completions."""
    if not isinstance(data, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    legacy_functions = False
    if kind == "chat":
        data, legacy_functions = _from_functions(data)
    elif "prompt" in data and data["prompt"] is None:
        data = {**data, "prompt": COMPLETION_DEFAULT_PROMPT}
    _refuse_unsupported(kind, data)
    try:
        body = (ChatBody if kind == "chat" else CompletionBody).model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None
    opts = options or default_options(tokenizer)
    model = check_model(body.model, served_model)
    n = 1 if body.n is None else body.n
    if not 1 <= n <= max_n:
        raise InvalidRequestError(f"n must be between 1 and {max_n}, got {n}", param="n")
    if body.seed is not None and not 0 <= body.seed <= MAX_SEED - max_n:
        raise InvalidRequestError(f"seed must be in [0, {MAX_SEED - max_n}]", param="seed")
    echo: list[str] = []
    parser = None
    discard = False
    if isinstance(body, ChatBody):  # kind == "chat"
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        default_max_tokens = opts.default_max_tokens
        if body.top_logprobs is not None and not body.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs=true", param="top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        ids, parser, structured = _chat_prompt(body, tokenizer, opts, legacy_functions)
        prompts = [ids]
        prefix = "chatcmpl"
        param = "messages"
    else:
        structured = structured_spec(body.response_format)
        max_tokens = body.max_tokens
        default_max_tokens = COMPLETION_DEFAULT_MAX_TOKENS
        logprobs = body.logprobs
        if max_tokens == 0:
            max_tokens, discard = 1, True
        # the body model made it one str, or a list of all str, all int or all list[int]
        prompt: list = [body.prompt] if isinstance(body.prompt, str) else body.prompt
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
    if structured is not None:
        from kernellab.runtime.request.structured import check

        check(structured, tokenizer)  # a schema or grammar the engine cannot use is the client's 400, here
    base = _params(body, max_tokens, logprobs, opts, tokenizer.vocab_size, structured)
    if isinstance(body, CompletionBody) and body.echo and logprobs is not None:
        base = replace(base, prompt_logprobs=logprobs)  # the echoed prompt's tokens are scored too, as the API does
    for ids in prompts:
        _check_context(len(ids), base.max_tokens, max_model_len, param)
    if base.max_tokens is None and default_max_tokens is not None:
        base = replace(base, max_tokens=max(1, min(default_max_tokens, max_model_len - max(map(len, prompts)))))
    keep = None
    if isinstance(body, CompletionBody) and body.best_of is not None and body.best_of != n:
        if not n < body.best_of <= max_n:
            raise InvalidRequestError(
                f"best_of must be between n ({n}) and {max_n}, got {body.best_of}", param="best_of"
            )
        if body.stream:
            raise InvalidRequestError("best_of greater than n cannot be streamed", param="best_of")
        keep, n = n, body.best_of
        if base.logprobs is None:
            base = replace(base, logprobs=0)  # the candidates are ranked by their tokens' logprobs
    choices = []
    for p in range(len(prompts)):
        for i in range(n):
            params = replace(base, seed=base.seed + i) if base.seed is not None else base
            choices.append(Choice(p * n + i, p, params))
    include_usage = bool(
        body.stream and isinstance(body.stream_options, dict) and body.stream_options.get("include_usage")
    )
    priority = "batch" if body.service_tier == "flex" else "interactive"
    return Prepared(
        kind,
        f"{prefix}-{uuid.uuid4().hex}",
        model,
        prompts,
        choices,
        bool(body.stream),
        include_usage,
        logprobs,
        priority,
        echo,
        parser,
        discard,
        keep,
    )
