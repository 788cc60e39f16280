"""Client side of an OpenAI streaming response: SSE events in, timings and usage out.

Timings come from the arrival of chunks that carry text; token counts come only from the ``usage`` object
of the final chunk (the request sets ``stream_options.include_usage``). Counting chunks would be wrong: a
chunk can carry several tokens, or none (a multi-byte character waits for its next token).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field


class SSEDecoder:
    """Assembles Server-Sent Events from lines (given without their newline)."""

    def __init__(self) -> None:
        self._data: list[str] = []
        self.done = False  # saw ``data: [DONE]``

    def feed_line(self, raw: bytes | str) -> str | None:
        """The event's data when this line completes an event; None otherwise (and for ``[DONE]``)."""
        line = (raw.decode("utf-8") if isinstance(raw, bytes) else raw).rstrip("\r")
        if not line:  # a blank line ends an event
            return self._dispatch()
        if line.startswith(":"):  # a comment (keep-alive)
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None

    def close(self) -> str | None:
        """At the end of the stream: an event left without its blank line, if any."""
        return self._dispatch()

    def _dispatch(self) -> str | None:
        if not self._data:
            return None
        payload = "\n".join(self._data)
        self._data = []
        if payload == "[DONE]":
            self.done = True
            return None
        return payload


def iter_sse_data(lines: Iterable[bytes | str]) -> Iterator[str]:
    """The ``data`` of each event, in order, up to ``[DONE]``."""
    decoder = SSEDecoder()
    for line in lines:
        payload = decoder.feed_line(line)
        if payload is not None:
            yield payload
        if decoder.done:
            return
    payload = decoder.close()
    if payload is not None:
        yield payload


@dataclass
class StreamResult:
    """One streamed request as the client saw it. Times are seconds, from ``perf_counter``."""

    start: float
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk that carried text
    end: float | None = None
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]

    @property
    def e2e(self) -> float | None:
        return None if self.end is None else self.end - self.start

    def feed(self, payload: str, now: float | None = None) -> None:
        """One event's data (a JSON chunk)."""
        now = time.perf_counter() if now is None else now
        try:
            chunk = json.loads(payload)
        except json.JSONDecodeError:
            self.error = f"malformed SSE data: {payload[:120]!r}"
            return
        if not isinstance(chunk, dict):
            self.error = f"SSE data is not an object: {payload[:120]!r}"
            return
        if "error" in chunk:
            error = chunk["error"]
            self.error = f"error event: {error.get('message') if isinstance(error, dict) else error}"
            return
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.prompt_tokens = usage.get("prompt_tokens")
            self.completion_tokens = usage.get("completion_tokens")
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta")
            text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            if text:
                self.chunk_times.append(now)
                self.text.append(text)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]

    def finish(self, now: float | None = None) -> None:
        """The stream ended; check that it ended properly."""
        self.end = time.perf_counter() if now is None else now
        if self.error:
            return
        if self.finish_reason is None:
            self.error = "stream ended without a finish_reason"
        elif self.completion_tokens is None:
            self.error = "no usage in the stream (the server ignored stream_options.include_usage)"
