"""The Batch API routes of the gateway (an ``APIRouter`` the gateway's app includes, behind its own API-key
dependency and error handlers, so every error here is an OpenAI error object too).

  POST   /v1/files                 multipart: file (JSONL), purpose=batch; size and line-count limits
  GET    /v1/files/{id}            the file object
  GET    /v1/files/{id}/content    the file's bytes
  DELETE /v1/files/{id}
  POST   /v1/batches               {input_file_id, endpoint, completion_window, metadata}: enqueues the job
  GET    /v1/batches               newest first; ?after=<id>&limit=<1..100>
  GET    /v1/batches/{id}
  POST   /v1/batches/{id}/cancel   → cancelling (the job finishes it: cancelled)

Files live on ``KERNELLAB_FILES_DIR`` (shared with the batch workers), batch objects in Redis; the job
runs on a Celery worker (``kernellab batch-worker``).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse
from pydantic import BaseModel, ConfigDict

from kernellab.runtime.request.errors import InvalidRequestError, KernellabError
from kernellab.services.batch.files import FileStore, FileTooLarge
from kernellab.services.batch.lines import ENDPOINTS
from kernellab.services.batch.settings import BatchSettings, window_seconds
from kernellab.services.batch.store import BatchStore, new_batch_id, to_openai
from kernellab.services.config import StackSettings
from kernellab.services.gateway.errors import NotFound, ServiceUnavailable
from kernellab.services.gateway.router import REDIS_DOWN
from kernellab.services.gateway.state import redis_client

log = logging.getLogger("kernellab.batch")

_FORM_OVERHEAD = 64 * 1024  # multipart boundaries and the purpose field, on top of the file itself
MAX_METADATA = 16


class CreateBatch(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA:
        raise InvalidRequestError(f"metadata takes at most {MAX_METADATA} pairs", param="metadata")
    for key, value in metadata.items():
        if len(key) > 64 or len(value) > 512:
            raise InvalidRequestError("metadata keys are at most 64 characters, values at most 512", param="metadata")


def _tenant(request: Request) -> str:
    """The caller's API-key digest, set by the gateway's auth dependency ("" without keys)."""
    return getattr(request.state, "tenant", "")


def _owned(meta: dict | None, request: Request) -> dict | None:
    """``meta`` (a file or batch's stored fields) when the caller owns it, else None: another tenant's file
    or batch is answered exactly like one that does not exist."""
    if meta is None or not hmac.compare_digest(str(meta.get("owner", "")).encode(), _tenant(request).encode()):
        return None
    return meta


def _public_file(meta: dict) -> dict:
    return {k: v for k, v in meta.items() if k != "owner"}


def batch_settings(stack: StackSettings) -> BatchSettings:
    """The batch settings from the environment, with the gateway's own Redis, prefix and model."""
    return BatchSettings(redis_url=stack.redis_url, key_prefix=stack.key_prefix, model=stack.model)


def create_batch_router(stack: StackSettings, settings: BatchSettings | None = None) -> APIRouter:
    settings = settings or batch_settings(stack)
    files = FileStore(settings.files_path)
    state: dict = {}

    @asynccontextmanager
    async def lifespan(_app):
        client = redis_client(settings.redis_url, timeout=2.0)
        state["store"] = BatchStore(client, settings.key_prefix)
        try:
            yield
        finally:
            await client.aclose()

    router = APIRouter(lifespan=lifespan)

    def store() -> BatchStore:
        return state["store"]

    def enqueue(batch_id: str) -> None:
        celery = state.get("celery")
        if celery is None:
            from kernellab.services.batch.celery_app import make_celery

            celery = state["celery"] = make_celery(settings)
        from kernellab.services.batch.celery_app import TASK_NAME

        # ignore_result: nothing waits on a Celery result (the batch object is the result), so the send
        # never touches the result backend; a broker that is down fails the request within a second.
        celery.send_task(
            TASK_NAME,
            args=[batch_id],
            queue=settings.batch_queue,
            ignore_result=True,
            retry_policy={"max_retries": 2, "interval_start": 0, "interval_step": 0.25, "interval_max": 0.5},
        )

    async def redis_call(coro):
        try:
            return await coro
        except REDIS_DOWN as exc:
            raise ServiceUnavailable(f"the batch store is unavailable: {exc}", code="queue_unavailable") from None

    # ----------------------------------------------------------------- files
    @router.post("/v1/files")
    async def upload_file(request: Request):
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise InvalidRequestError("upload a file as multipart/form-data with the fields 'file' and 'purpose'")
        limit = settings.batch_max_file_bytes + _FORM_OVERHEAD
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > limit:
            raise FileTooLarge(settings.batch_max_file_bytes)
        try:
            from starlette.formparsers import MultiPartException, MultiPartParser
        except ImportError:  # pragma: no cover - python-multipart missing
            raise ServiceUnavailable("file uploads need the python-multipart package") from None

        async def limited():
            size = 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise FileTooLarge(settings.batch_max_file_bytes)
                yield chunk

        try:
            form = await MultiPartParser(request.headers, limited(), max_files=1, max_fields=8).parse()
        except MultiPartException as exc:
            raise InvalidRequestError(f"malformed multipart body: {exc.message}") from None
        try:
            purpose = form.get("purpose")
            if purpose != "batch":
                raise InvalidRequestError(f"purpose must be 'batch', got {purpose!r}", param="purpose")
            upload = form.get("file")
            if upload is None or isinstance(upload, str):
                raise InvalidRequestError("the form has no 'file' part", param="file")
            return _public_file(
                await asyncio.to_thread(
                    files.save_upload,
                    upload.file,
                    upload.filename or "input.jsonl",
                    max_bytes=settings.batch_max_file_bytes,
                    max_lines=settings.batch_max_lines,
                    owner=_tenant(request),
                )
            )
        finally:
            await form.close()

    @router.get("/v1/files/{file_id}")
    async def get_file(file_id: str, request: Request):
        meta = _owned(files.get(file_id), request)
        if meta is None:
            raise NotFound(f"no file {file_id!r}", param="file_id", code="not_found")
        return _public_file(meta)

    @router.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str, request: Request):
        path = files.content_path(file_id) if _owned(files.get(file_id), request) else None
        if path is None:
            raise NotFound(f"no file {file_id!r}", param="file_id", code="not_found")
        return FileResponse(path, media_type="application/jsonl")

    @router.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str, request: Request):
        if _owned(files.get(file_id), request) is None or not await asyncio.to_thread(files.delete, file_id):
            raise NotFound(f"no file {file_id!r}", param="file_id", code="not_found")
        return {"id": file_id, "object": "file", "deleted": True}

    # ----------------------------------------------------------------- batches
    @router.post("/v1/batches")
    async def create_batch(body: CreateBatch, request: Request):
        if body.endpoint not in ENDPOINTS:
            raise InvalidRequestError(
                f"endpoint must be one of {', '.join(ENDPOINTS)}, got {body.endpoint!r}", param="endpoint"
            )
        if body.completion_window not in settings.completion_windows:
            raise InvalidRequestError(
                f"completion_window must be one of {', '.join(settings.completion_windows)}", param="completion_window"
            )
        _check_metadata(body.metadata)
        meta = _owned(files.get(body.input_file_id), request)
        if meta is None:
            raise InvalidRequestError(f"no file {body.input_file_id!r}", param="input_file_id")
        if meta.get("purpose") != "batch":
            raise InvalidRequestError(
                f"file {body.input_file_id!r} was not uploaded with purpose 'batch'", param="input_file_id"
            )
        batch_id = new_batch_id()
        batch = await redis_call(
            store().create(
                batch_id,
                endpoint=body.endpoint,
                input_file_id=body.input_file_id,
                completion_window=body.completion_window,
                expires_in_s=window_seconds(body.completion_window),
                metadata=body.metadata,
                model=settings.model,
                owner=_tenant(request),
            )
        )
        try:
            await asyncio.to_thread(enqueue, batch_id)
        except Exception as exc:
            log.error("could not enqueue batch %s: %s", batch_id, exc)
            await redis_call(store().discard(batch_id))
            raise ServiceUnavailable(f"the batch queue is unavailable: {exc}", code="queue_unavailable") from None
        log.info("batch %s created from %s (%s)", batch_id, body.input_file_id, body.endpoint)
        return batch

    @router.get("/v1/batches")
    async def list_batches(request: Request, after: str | None = None, limit: int = Query(20, ge=1, le=100)):
        data, more = await redis_call(store().list(after, limit, owner=_tenant(request)))
        return {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": more,
        }

    @router.get("/v1/batches/{batch_id}")
    async def get_batch(batch_id: str, request: Request):
        fields = _owned(await redis_call(store().fields(batch_id)), request)
        if fields is None:
            raise NotFound(f"no batch {batch_id!r}", param="batch_id", code="not_found")
        return to_openai(fields)

    @router.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str, request: Request):
        if _owned(await redis_call(store().fields(batch_id)), request) is None:
            raise NotFound(f"no batch {batch_id!r}", param="batch_id", code="not_found")
        done, previous = await redis_call(
            store().transition(batch_id, ("validating", "in_progress"), "cancelling", cancelling_at=int(time.time()))
        )
        if not done and previous == "":
            raise NotFound(f"no batch {batch_id!r}", param="batch_id", code="not_found")
        if not done and previous not in ("cancelling", "cancelled"):
            raise _NotCancellable(f"a batch with status {previous!r} cannot be cancelled")
        return await redis_call(store().get(batch_id))

    return router


class _NotCancellable(KernellabError):
    status_code = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str):
        super().__init__(message, code="batch_not_cancellable")
