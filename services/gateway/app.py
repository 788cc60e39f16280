"""The OpenAI-compatible gateway (FastAPI). No torch: it tokenizes, validates, enqueues and streams.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, POST /v1/requests/{id}/cancel (API key
when keys are set), GET /health (liveness), GET /ready (Redis + a live worker). Every error is an OpenAI error
object; bad input is always 4xx.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kernellab.runtime.request.errors import InvalidRequestError, KernellabError
from kernellab.runtime.request.registry import resolve_model
from kernellab.services.batch.api import create_batch_router
from kernellab.services.config import GatewaySettings
from kernellab.services.gateway import responses as R
from kernellab.services.gateway.errors import (
    NotFound,
    PayloadTooLarge,
    ServiceUnavailable,
    Unauthorized,
    error_headers,
)
from kernellab.services.gateway.generation import NOT_READY, ClientGone, chat_delta, collect, echo_logprobs, usage_of
from kernellab.services.gateway.metrics import GatewayMetrics, HTTPMetricsMiddleware
from kernellab.services.gateway.middleware import (
    GatewayApp,
    GenerationFastPath,
    InternalErrorMiddleware,
    internal_error,
)
from kernellab.services.gateway.requests import prepare
from kernellab.services.gateway.state import Gateway
from kernellab.services.gateway.utility import detokenize_request, tokenize_request

log = logging.getLogger("kernellab.gateway")

# Bodies larger than this (bytes) are validated and tokenized in a thread so they do not stall other streams.
_THREAD_PREPARE_BYTES = 20_000


class _Stream(StreamingResponse):
    """The SSE response: always runs ``on_close``, even when the client left before the body began. It streams
    without Starlette's per-response task group and second disconnect listener (a task, cancel scopes, a
    ``receive`` waiter per request): the request's own watcher, kept running until the stream ends, ends the
    body by putting ClientGone into its queue (``ResultStream.client_gone``)."""

    def __init__(self, content, on_close, watcher: asyncio.Task, **kwargs):
        super().__init__(content, **kwargs)
        self._on_close = on_close
        self._watcher = watcher

    async def __call__(self, scope, receive, send):
        try:
            await self.stream_response(send)
        except ClientGone:
            pass
        finally:
            self._watcher.cancel()
            self._on_close()


def create_app(settings: GatewaySettings, tokenizer=None, *, freeze_heap: bool = False) -> FastAPI:
    """``freeze_heap``: once started (the tokenizer loaded), freeze this process's objects out of the garbage
    collector's reach (observability.freeze_heap; the server entry passes ``settings.gc_freeze``, tests leave it)."""
    spec = resolve_model(settings.model)
    metrics = GatewayMetrics(spec.name)
    state: dict[str, Gateway] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        tok = tokenizer
        if tok is None:
            from kernellab.services.gateway.tokenizer import load_gateway_tokenizer

            tok = load_gateway_tokenizer(spec.name)
        gw = Gateway(settings, tok, spec.name, settings.max_model_len or spec.max_model_len, metrics)
        app.state.gateway = state["gw"] = gw
        await gw.start()
        if freeze_heap:
            from kernellab.services.observability import freeze_heap as freeze

            freeze()
        metrics_server = None
        if settings.gateway_metrics_port:
            from kernellab.services.observability import MetricsServer

            metrics_server = MetricsServer(
                settings.metrics_host,
                settings.gateway_metrics_port,
                metrics.registry,
                lambda: {"status": "ok", "in_flight": gw.in_flight},
            ).start()
        log.info(
            "gateway %s serving %s (redis %s, auth %s)",
            gw.id,
            spec.name,
            settings.redis_url,
            f"{len(gw.api_keys)} key(s)" if gw.api_keys else "off",
        )
        try:
            yield
        finally:
            gw.draining = True
            await gw.stop()
            if metrics_server is not None:
                metrics_server.stop()

    app = GatewayApp(title="kernellab", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    if settings.gateway_fast_path:  # served ahead of the middleware below, doing their work for its two routes
        app.fast_path = GenerationFastPath(
            {"/v1/chat/completions": "chat", "/v1/completions": "completion"},
            lambda kind, request: generate(kind, request),
            metrics,
        )
    app.add_middleware(HTTPMetricsMiddleware, metrics=metrics)
    app.add_middleware(InternalErrorMiddleware)  # added last: outside the metrics, which count the 500

    def gw() -> Gateway:
        return state["gw"]

    # ----------------------------------------------------------------- errors
    @app.exception_handler(KernellabError)
    async def _kernellab_error(_request: Request, exc: KernellabError):
        return JSONResponse(exc.to_openai(), status_code=exc.status_code, headers=error_headers(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException):
        err = KernellabError(str(exc.detail), code="not_found" if exc.status_code == 404 else None)
        err.error_type = "invalid_request_error"
        return JSONResponse(err.to_openai(), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError):
        return JSONResponse(InvalidRequestError(f"invalid request: {exc.errors()[:1]}").to_openai(), status_code=400)

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception):
        log.exception("unexpected error")
        return JSONResponse(internal_error(exc), status_code=500)

    # ----------------------------------------------------------------- helpers
    def check_auth(request: Request) -> str:
        """The caller's tenant: a digest of its API key ("" without keys), also left in ``request.state.tenant``
        for the batch routes. Requests, files and batches belong to the tenant that created them."""
        request.state.tenant = ""
        keys = gw().api_keys
        if not keys:
            return ""
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        token = token.strip()
        if not any(hmac.compare_digest(token.encode(), k.encode()) for k in keys):
            raise Unauthorized("incorrect API key provided")
        request.state.tenant = hashlib.sha256(token.encode()).hexdigest()[:32]
        return request.state.tenant

    async def read_json(request: Request) -> tuple[object, int]:
        """(the decoded body, its size in bytes)."""
        limit = settings.max_body_bytes
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > limit:
            raise PayloadTooLarge(limit)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise PayloadTooLarge(limit)
        try:
            data = json.loads(body)
            if b"\\u" in body:  # only escapes can make lone surrogates, which no tokenizer or encoder accepts
                json.dumps(data, ensure_ascii=False).encode()
            return data, len(body)
        except (ValueError, RecursionError) as exc:  # ValueError covers UnicodeDecode/EncodeError
            raise InvalidRequestError(f"the body is not valid JSON text: {type(exc).__name__}: {exc}") from None

    async def until_disconnect(request: Request, rs) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        rs.client_gone()

    # ----------------------------------------------------------------- routes
    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready(request: Request):
        """The status code is for probes (no key needed); the details only for a key holder."""
        ok, why = gw().ready()
        try:
            check_auth(request)
            body = {"status": why, "model": spec.name, "workers": len(gw().live_workers)}
        except Unauthorized:
            body = {"status": "ready" if ok else "not ready"}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models(request: Request):
        check_auth(request)
        g = gw()
        return {
            "object": "list",
            "data": [
                {
                    "id": g.model,
                    "object": "model",
                    "created": 0,
                    "owned_by": "kernellab",
                    "root": spec.hub_id or spec.source,
                    "max_model_len": g.max_model_len,
                }
            ],
        }

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM's shape: {prompt} or {messages, ...} → {count, max_model_len, tokens[, token_strs]}."""
        check_auth(request)
        g = gw()
        data, _ = await read_json(request)
        return await asyncio.to_thread(
            tokenize_request, data, g.tokenizer, served_model=g.model, max_model_len=g.max_model_len, options=g.options
        )

    @app.post("/detokenize")
    async def detokenize(request: Request):
        """{tokens} → {prompt}: the text of token ids (special tokens kept, as vLLM does)."""
        check_auth(request)
        g = gw()
        data, _ = await read_json(request)
        return detokenize_request(data, g.tokenizer, served_model=g.model)

    @app.post("/v1/requests/{request_id}/cancel")
    async def cancel(request_id: str, request: Request):
        tenant = check_auth(request)
        if not await gw().cancel_by_id(request_id, tenant):  # another tenant's request: as if unknown
            raise NotFound(f"no request {request_id!r} (unknown or expired)", code="not_found")
        return {"id": request_id, "object": "request.cancel", "cancelled": True}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await generate("chat", request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate("completion", request)

    async def generate(kind: str, request: Request):
        started = time.perf_counter()
        tenant = check_auth(request)
        g = gw()
        if g.draining:
            raise ServiceUnavailable("the gateway is shutting down", code="draining")
        data, size = await read_json(request)  # a large body is tokenized (or validated) off the event loop
        args = (kind, data, g.tokenizer)
        kwargs = {
            "served_model": g.model,
            "max_model_len": g.max_model_len,
            "max_n": settings.max_n,
            "options": g.options,
        }
        if size > _THREAD_PREPARE_BYTES:
            p = await asyncio.to_thread(prepare, *args, **kwargs)
        else:
            p = prepare(*args, **kwargs)
        rs = await g.submit(p, started, owner=tenant)
        watcher = asyncio.ensure_future(until_disconnect(request, rs))
        handed_over = False
        try:
            first = await rs.next()
            if p.stream:
                done = {"ok": False}

                def on_close():
                    if not done["ok"]:
                        metrics.disconnects.inc()
                    rs.close()

                handed_over = True
                return _Stream(
                    stream_body(p, rs, first, done),
                    on_close,
                    watcher,
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                )
            return JSONResponse(await collect(p, rs, first, g_text()))
        except ClientGone:
            metrics.disconnects.inc()
            return Response(status_code=499)
        finally:
            if not handed_over:  # else the stream cancels its watcher and closes it
                watcher.cancel()
                rs.close()

    def chunk_for(p, rs, created: int, u, sent: set, offsets: dict) -> dict | None:
        """The chunk of one update, or None when it has nothing to say yet (a parser holding back a tag)."""
        first = u.index not in sent
        sent.add(u.index)
        text = u.text
        echoed = p.echo_of(u.index) if first else ""
        text = echoed + text
        if p.kind == "chat":
            delta, reason = chat_delta(rs.choices[u.index], u)
            if first:
                delta = {"role": "assistant", "content": "", **delta}
            elif not delta and u.logprobs is None and reason is None:
                return None
            lp = R.chat_logprobs(u.logprobs, g_text()) if u.logprobs is not None else None
            return R.chat_chunk(p, created, u.index, delta, lp, reason, with_usage_field=p.include_usage)
        lp = None
        prompt = echo_logprobs(p, u.index, rs) if u.prompt_logprobs is not None else None
        if u.logprobs is not None or prompt is not None:
            lp = R.completion_logprobs(u.logprobs or [], g_text(), offsets.get(u.index, 0) + len(echoed), prompt)
        offsets[u.index] = offsets.get(u.index, 0) + len(text)
        return R.completion_chunk(p, created, u.index, text, lp, u.finish_reason, with_usage_field=p.include_usage)

    def g_text() -> R.TokenText:
        return gw().token_text

    async def stream_body(p, rs, first, done: dict):
        """The SSE body; ``done["ok"]`` tells the closer that the client got everything (no disconnect)."""
        created = int(time.time())
        sent: set[int] = set()  # choice indices that got their first chunk
        offsets: dict[int, int] = {}  # choice index → characters of text sent (completion logprobs' text_offset)
        update = first
        try:
            while update is not None:
                # Events that queued up while we were busy go out as one write (one ASGI message, one send
                # syscall): a gateway that falls behind catches up instead of paying per event.
                events = []
                while update is not NOT_READY and update is not None:
                    chunk = chunk_for(p, rs, created, update, sent, offsets)
                    if chunk is not None:
                        events.append(R.sse(chunk))
                    update = rs.ready()
                if events:
                    yield b"".join(events) if len(events) > 1 else events[0]
                if update is NOT_READY:
                    update = await rs.next()
            tail = b""
            if p.include_usage:
                tail = R.sse(R.usage_chunk(p, created, usage_of(p, rs)))
        except KernellabError as exc:  # after the 200 went out: an error event, as OpenAI streams do
            tail = R.sse(exc.to_openai())
        done["ok"] = True
        rs.close()
        yield tail + R.SSE_DONE

    # Last: the router tries routes in order, and the generation routes carry the traffic.
    app.include_router(create_batch_router(settings), dependencies=[Depends(check_auth)])
    return app
