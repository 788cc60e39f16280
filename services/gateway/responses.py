"""OpenAI response shapes: chat.completion(.chunk), text_completion, usage and logprobs, as plain dicts."""

from __future__ import annotations

import functools
import hashlib
import json
from importlib import metadata
from typing import Any

from kernellab.services.gateway.requests import Prepared

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def sse(obj) -> bytes:
    return b"data: " + _dumps(obj).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def _release() -> str:
    try:
        return metadata.version("kernellab")
    except metadata.PackageNotFoundError:
        return "dev"


_RELEASE = _release()  # read once at import: the metadata scan takes ~20 ms, not for a request's event loop


@functools.cache
def system_fingerprint(model: str) -> str:
    """The ``system_fingerprint`` of every response: the serving software's release and the model, hashed (the API
    documents it as a string that changes when the backend configuration does; null is not in its schema)."""
    return "fp_" + hashlib.sha256(f"kernellab {_RELEASE} {model}".encode()).hexdigest()[:10]


class TokenText:
    """The text of single tokens for logprobs (cached: a vocabulary is small next to a long serving life)."""

    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tok.decode([token_id], skip_special_tokens=False)
            if len(self._cache) < 200_000:
                self._cache[token_id] = text
        return text


def chat_logprobs(entries: list, text: TokenText) -> dict:
    """``entries``: [token_id, logprob, [[top_id, top_logprob], ...]] per token (the wire format)."""
    content = []
    for token_id, logprob, top in entries:
        s = text(token_id)
        content.append(
            {
                "token": s,
                "logprob": logprob,
                "bytes": list(s.encode()),
                "top_logprobs": [{"token": text(t), "logprob": lp, "bytes": list(text(t).encode())} for t, lp in top],
            }
        )
    return {"content": content, "refusal": None}


def completion_logprobs(
    entries: list, text: TokenText, offset: int, prompt: tuple[list[int], list] | None = None
) -> dict:
    """``entries``: the generated tokens' (the wire format), the first of them at ``offset`` characters into the
    choice's text. ``prompt``: (the prompt's token ids, their wire entries from the second token on), for echo
    with logprobs: the prompt's tokens come first, at offsets from 0, the first one with a null logprob and top
    logprobs (nothing comes before it to condition on), as the API answers and as scoring clients (e.g.
    lm-evaluation-harness, which slices ``token_logprobs[context_len:]``) expect."""
    tokens: list = []
    token_logprobs: list = []
    tops: list = []
    offsets: list = []
    if prompt is not None:
        ids, scored = prompt
        at = 0
        for i, token_id in enumerate(ids[: len(scored) + 1]):
            s = text(token_id)
            tokens.append(s)
            offsets.append(at)
            at += len(s)
            if i == 0:
                token_logprobs.append(None)
                tops.append(None)
            else:
                _, logprob, top = scored[i - 1]
                token_logprobs.append(logprob)
                tops.append({text(t): lp for t, lp in top})
    for token_id, logprob, top in entries:
        s = text(token_id)
        tokens.append(s)
        token_logprobs.append(logprob)
        tops.append({text(t): lp for t, lp in top})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, reasoning_tokens: int | None = None
) -> dict:
    u = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if reasoning_tokens is not None:
        u["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return u


def chat_chunk(
    p: Prepared, created: int, index: int, delta: dict, logprobs, finish_reason, *, with_usage_field: bool = False
) -> dict:
    chunk = {
        "id": p.request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": p.model,
        "system_fingerprint": system_fingerprint(p.model),
        "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
    }
    if with_usage_field:
        chunk["usage"] = None
    return chunk


def completion_chunk(
    p: Prepared, created: int, index: int, text: str, logprobs, finish_reason, *, with_usage_field: bool = False
) -> dict:
    chunk = {
        "id": p.request_id,
        "object": "text_completion",
        "created": created,
        "model": p.model,
        "system_fingerprint": system_fingerprint(p.model),
        "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}],
    }
    if with_usage_field:
        chunk["usage"] = None
    return chunk


def usage_chunk(p: Prepared, created: int, u: dict) -> dict:
    obj = "chat.completion.chunk" if p.kind == "chat" else "text_completion"
    return {
        "id": p.request_id,
        "object": obj,
        "created": created,
        "model": p.model,
        "system_fingerprint": system_fingerprint(p.model),
        "choices": [],
        "usage": u,
    }


def final_response(p: Prepared, created: int, choices: list[dict], u: dict) -> dict:
    obj = "chat.completion" if p.kind == "chat" else "text_completion"
    return {
        "id": p.request_id,
        "object": obj,
        "created": created,
        "model": p.model,
        "system_fingerprint": system_fingerprint(p.model),
        "choices": choices,
        "usage": u,
    }


def chat_choice(index: int, text: str, logprobs, finish_reason, parsed=None) -> dict:
    """``parsed``: the output parser's ParsedMessage (reasoning / content / tool calls), or None: all content."""
    if parsed is None:
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
    else:
        message = {"role": "assistant", "content": parsed.content, "refusal": None}
        if parsed.reasoning is not None:
            message["reasoning"] = message["reasoning_content"] = parsed.reasoning
        if parsed.tool_calls:
            message["tool_calls"] = [{k: v for k, v in call.items() if k != "index"} for call in parsed.tool_calls]
        if parsed.function_call is not None:
            message["function_call"] = parsed.function_call
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_choice(index: int, text: str, logprobs, finish_reason) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
