"""The gateway's own ASGI layers: ``InternalErrorMiddleware`` (an unexpected exception is an OpenAI 500 on a
connection that stays usable) and ``GenerationFastPath`` with ``GatewayApp`` (the two generation routes are
served ahead of the application's middleware stack and router)."""

from __future__ import annotations

import json
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from kernellab.runtime.request.errors import KernellabError
from kernellab.services.gateway.errors import error_headers

log = logging.getLogger("kernellab.gateway")


def internal_error(exc: Exception) -> dict:
    """The OpenAI error object of an unexpected exception (500): its type, never its message."""
    return KernellabError(f"internal error: {type(exc).__name__}").to_openai()


class InternalErrorMiddleware:
    """An unexpected exception becomes an OpenAI error object (500) on a connection that stays usable.

    Starlette's last-resort handler answers and then re-raises, and uvicorn drops a keep-alive connection
    whose application raised, so the client's next request on it failed with "Server disconnected". Once a
    response has started (a stream), nothing can be answered any more and the exception goes on."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def send_wrapper(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except Exception as exc:
            if started:
                raise
            log.exception("unexpected error")
            body = json.dumps(internal_error(exc)).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 500,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
                }
            )
            await send({"type": "http.response.body", "body": body})


class _Route:
    """What a matched route leaves in ``scope["route"]`` for the metrics' label."""

    def __init__(self, path: str):
        self.path = path


class GenerationFastPath:
    """POST /v1/chat/completions and /v1/completions go straight to their handler, before any of the application's
    middleware (Starlette's error layer, FastAPI's telemetry and body-limit layers, the gateway's metrics and 500
    layers), its router and its exception layers: each is a Python call per request and, wrapping ``send``, one
    more per SSE event, and at GPU speed a burst of requests queues behind that work in every gateway process, so
    its time is added TTFT. This path does what those layers would for these two routes, inline: the HTTP
    metrics (``GatewayMetrics.requests`` / ``latency``, route template and status, timed to the last byte), a
    ``KernellabError`` answered as its OpenAI error object, and an unexpected exception answered as a 500 error
    object on a connection that stays usable (``InternalErrorMiddleware``'s rule) as long as no response has begun.
    Every other request goes through the application. ``GatewayApp`` calls it first."""

    def __init__(self, routes: dict[str, str], handler, metrics):
        self.routes = {path: (kind, _Route(path)) for path, kind in routes.items()}
        self.handler = handler
        self.metrics = metrics

    def match(self, scope) -> tuple[str, _Route] | None:
        if scope["type"] == "http" and scope["method"] == "POST":
            return self.routes.get(scope["path"])
        return None

    async def serve(self, hit: tuple[str, _Route], scope, receive, send) -> None:
        start = time.perf_counter()
        kind, scope["route"] = hit
        status = 500
        try:
            try:
                response = await self.handler(kind, Request(scope, receive, send))
            except KernellabError as exc:
                response = JSONResponse(exc.to_openai(), status_code=exc.status_code, headers=error_headers(exc))
            except Exception as exc:  # nothing was sent yet: an OpenAI 500, and the connection stays usable
                log.exception("unexpected error")
                response = JSONResponse(internal_error(exc), status_code=500)
            status = response.status_code
            await response(scope, receive, send)  # an exception here may follow a sent start: it goes on
        finally:
            self.metrics.http(scope["route"].path, "POST", status, time.perf_counter() - start)


class GatewayApp(FastAPI):
    """The gateway's FastAPI application, with ``fast_path`` (when set) served ahead of its middleware stack."""

    fast_path: GenerationFastPath | None = None

    async def __call__(self, scope, receive, send) -> None:
        fast = self.fast_path
        if fast is not None and (hit := fast.match(scope)) is not None:
            scope["app"] = self
            await fast.serve(hit, scope, receive, send)
            return
        await super().__call__(scope, receive, send)
