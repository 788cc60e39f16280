"""The batch line formats (OpenAI's): input lines, and the output and error lines a batch writes.

Input, one JSON object per line (blank lines are skipped and not counted)::

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": {...the API request...}}

Output and error lines::

    {"id": "batch_req_…", "custom_id": "q1", "response": {"status_code": 200, "request_id": "req_…",
     "body": {...the API response...}}, "error": null}

A request the API would have refused (invalid parameters, unknown model, context too long) is an error
line with its HTTP status and the OpenAI error object as the body, as OpenAI writes it. A line that is
not a request at all (bad JSON, missing or duplicate ``custom_id``, unknown endpoint or method) is an error
line with ``response: null`` and ``error: {code, message}``; so is a line the batch could not run before
it expired (``batch_expired``).

Structural checks are pure functions of the file, so a redelivered job re-reads the file and reaches the
same verdict for every line; which occurrence of a duplicated ``custom_id`` wins (the first) is fixed too.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kernellab.runtime.request.errors import KernellabError

# The URLs a line may name (and a batch's ``endpoint`` may be): the API routes a batch can run. Lines of
# both kinds may share a file, as in vLLM's run-batch; OpenAI would require all to match ``endpoint``.
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
MAX_CUSTOM_ID = 512

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def dumps(obj) -> str:
    """One compact JSON line (no newline)."""
    return _dumps(obj)


@dataclass(frozen=True)
class LineError:
    code: str
    message: str


@dataclass
class InputLine:
    index: int  # position among the file's non-blank lines: the order of the output
    lineno: int  # 1-based line number in the file, for messages
    custom_id: str | None  # None only on a line with an error
    kind: str | None = None  # "chat" | "completion"; None only on a line with an error
    body: object = None
    error: LineError | None = None


def parse_line(text: str, index: int, lineno: int, seen: set[str]) -> InputLine:
    """Check one non-blank line's envelope; ``seen`` collects the custom_ids accepted so far."""
    try:
        obj = json.loads(text)
    except ValueError as exc:
        return InputLine(
            index, lineno, None, error=LineError("invalid_json_line", f"line {lineno} is not valid JSON: {exc}")
        )
    if not isinstance(obj, dict):
        return InputLine(
            index, lineno, None, error=LineError("invalid_json_line", f"line {lineno} is not a JSON object")
        )
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
        why = "is missing" if custom_id is None else f"must be a non-empty string of at most {MAX_CUSTOM_ID} characters"
        return InputLine(
            index,
            lineno,
            None if not isinstance(custom_id, str) else custom_id,
            error=LineError("invalid_custom_id", f"line {lineno}: custom_id {why}"),
        )
    if custom_id in seen:
        return InputLine(
            index,
            lineno,
            custom_id,
            error=LineError(
                "duplicate_custom_id", f"line {lineno}: custom_id {custom_id!r} was already used by an earlier line"
            ),
        )
    seen.add(custom_id)
    method = obj.get("method", "POST")
    if method != "POST":
        return InputLine(
            index,
            lineno,
            custom_id,
            error=LineError("invalid_method", f"line {lineno}: method must be 'POST', got {method!r}"),
        )
    url = obj.get("url")
    kind = ENDPOINTS.get(url) if isinstance(url, str) else None
    if kind is None:
        return InputLine(
            index,
            lineno,
            custom_id,
            error=LineError(
                "invalid_url", f"line {lineno}: unknown endpoint {url!r}; supported: {', '.join(ENDPOINTS)}"
            ),
        )
    if "body" not in obj:
        return InputLine(
            index,
            lineno,
            custom_id,
            error=LineError("missing_body", f"line {lineno}: the request needs a 'body' object"),
        )
    return InputLine(index, lineno, custom_id, kind, obj["body"])


def _nonblank(path: Path) -> Iterator[tuple[int, str]]:
    # Lines end at "\n" only (a stray "\r" is whitespace to JSON), as the upload counted them.
    with path.open(encoding="utf-8", errors="replace", newline="\n") as f:
        for lineno, raw in enumerate(f, start=1):
            if raw.strip():
                yield lineno, raw


def count_lines(path: Path) -> int:
    """The number of requests ``iter_input`` yields."""
    return sum(1 for _ in _nonblank(path))


def iter_input(path: Path) -> Iterator[InputLine]:
    """The file's non-blank lines in order, each checked. Blank lines are skipped and not counted."""
    seen: set[str] = set()
    for index, (lineno, raw) in enumerate(_nonblank(path)):
        yield parse_line(raw, index, lineno, seen)


def _line_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


def request_id() -> str:
    return f"req_{uuid.uuid4().hex}"


def success_line(custom_id: str | None, req_id: str, body: dict) -> dict:
    return {
        "id": _line_id(),
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": req_id, "body": body},
        "error": None,
    }


def http_error_line(custom_id: str | None, req_id: str, exc: KernellabError) -> dict:
    """A request refused as the API would refuse it: its status and OpenAI error object."""
    return {
        "id": _line_id(),
        "custom_id": custom_id,
        "response": {"status_code": int(exc.status_code), "request_id": req_id, "body": exc.to_openai()},
        "error": None,
    }


def envelope_error_line(custom_id: str | None, error: LineError) -> dict:
    return {
        "id": _line_id(),
        "custom_id": custom_id,
        "response": None,
        "error": {"code": error.code, "message": error.message},
    }


EXPIRED = LineError("batch_expired", "this request could not be executed before the batch's completion window expired")


def is_success(line: dict) -> bool:
    response = line.get("response")
    return isinstance(response, dict) and response.get("status_code") == 200 and line.get("error") is None
