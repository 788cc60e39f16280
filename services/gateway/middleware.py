"""The gateway's own ASGI middleware: ``InternalErrorMiddleware`` (an unexpected exception is an OpenAI 500 on a
connection that stays usable) and ``GenerationFastPath`` (the two generation routes skip FastAPI's router)."""

from __future__ import annotations

import json
import logging

from fastapi import Request
from fastapi.responses import JSONResponse

from kernellab.runtime.request.errors import KernellabError
from kernellab.services.gateway.errors import error_headers

log = logging.getLogger("kernellab.gateway")


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
            body = json.dumps(KernellabError(f"internal error: {type(exc).__name__}").to_openai()).encode()
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
    """POST /v1/chat/completions and /v1/completions go straight to their handler, past FastAPI's router,
    dependency and exception layers, which cost a large share of a request's gateway CPU: at GPU speed a burst of
    requests queues behind that Python work in every gateway process, and its time is added TTFT. Errors are
    answered as the exception handlers would (KernellabError → its OpenAI error object; anything else reaches
    InternalErrorMiddleware); every other request, and every other method, goes through FastAPI."""

    def __init__(self, app, routes: dict, handler):
        self.app = app
        self.routes = {path: (kind, _Route(path)) for path, kind in routes.items()}
        self.handler = handler

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST":
            hit = self.routes.get(scope["path"])
            if hit is not None:
                kind, scope["route"] = hit
                try:
                    response = await self.handler(kind, Request(scope, receive, send))
                except KernellabError as exc:
                    response = JSONResponse(exc.to_openai(), status_code=exc.status_code, headers=error_headers(exc))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
