"""The utility endpoints, in vLLM's shapes: ``POST /tokenize`` (a prompt, or chat messages rendered through the
chat template exactly as a chat request would be) and ``POST /detokenize``."""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from kernellab.runtime.request.errors import InvalidRequestError
from kernellab.services.gateway.constraints import validate_tools
from kernellab.services.gateway.options import ServingOptions
from kernellab.services.gateway.requests import (
    check_model,
    normalize_messages,
    template_kwargs,
    validation_error,
)


class TokenizeBody(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None
    tools: list | None = None
    return_token_strs: bool = False


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    tokens: list[int]


Body = TypeVar("Body", TokenizeBody, DetokenizeBody)


def _utility_body(model: type[Body], data, served_model: str) -> Body:
    """A /tokenize or /detokenize body, validated; its optional model must be the served one."""
    if not isinstance(data, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    try:
        body = model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None
    if body.model is not None:
        check_model(body.model, served_model)
    return body


def tokenize_request(data, tokenizer, *, served_model: str, max_model_len: int, options: ServingOptions) -> dict:
    """POST /tokenize: a prompt, or chat messages rendered by the chat template as a chat request would be."""
    body = _utility_body(TokenizeBody, data, served_model)
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequestError("give exactly one of prompt and messages", param="prompt")
    if body.prompt is not None:
        ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
    else:
        assert body.messages is not None  # exactly one of the two, checked above
        kwargs = template_kwargs(options, body.chat_template_kwargs)  # reserved names are a 400 here too
        text = tokenizer.render_chat(
            normalize_messages(body.messages),
            body.add_generation_prompt,
            tools=validate_tools(body.tools) or None,
            **kwargs,
        )
        ids = tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))
    out = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": None}
    if body.return_token_strs:
        out["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
    return out


def detokenize_request(data, tokenizer, *, served_model: str) -> dict:
    """POST /detokenize."""
    body = _utility_body(DetokenizeBody, data, served_model)
    vocab = tokenizer.vocab_size
    if body.tokens and (min(body.tokens) < 0 or max(body.tokens) >= vocab):
        raise InvalidRequestError(f"token ids must be in [0, {vocab})", param="tokens")
    return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}
