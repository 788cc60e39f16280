"""The Celery app of the batch service: Redis broker (the stack's Redis unless KERNELLAB_CELERY_BROKER_URL),
one task, ``kernellab.batch.run(batch_id)``.

Delivery: ``acks_late`` (the message is acknowledged when the task returns, not when it starts),
``task_reject_on_worker_lost`` (a pool child that dies puts its message back), prefetch 1 (a worker holds
only the batch it runs), and a Redis visibility timeout longer than the longest batch (an unacknowledged
message goes to another worker after that long: this is how a batch whose worker was killed with -9 is
redelivered). The job itself is idempotent and serialized by a lease (``job.py``), so an early or
duplicate delivery costs a retry, never a duplicated line.

Every Redis key Celery writes is under ``{key_prefix}celery:``.
"""

from __future__ import annotations

import logging
from functools import lru_cache

from celery import Celery
from celery.exceptions import Reject

from kernellab.services.batch.settings import BatchSettings, window_seconds
from kernellab.services.queue import aio

log = logging.getLogger("kernellab.batch")

TASK_NAME = "kernellab.batch.run"


def make_celery(settings: BatchSettings) -> Celery:
    app = Celery("kernellab.batch", broker=settings.broker_url, backend=settings.broker_url, set_as_current=False)
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_default_queue=settings.batch_queue,
        task_ignore_result=True,  # the batch object in Redis is the result
        task_serializer="json",
        accept_content=["json"],
        broker_transport_options={
            "visibility_timeout": settings.visibility_timeout_s,
            "global_keyprefix": settings.celery_prefix,
            # An idle worker scans for messages past their visibility timeout this often (not every 10th time).
            "unacked_restore_interval": settings.batch_restore_interval_s,
            "unacked_restore_throttle": 1,
        },
        result_backend_transport_options={"global_keyprefix": settings.celery_prefix},
        broker_connection_retry_on_startup=True,
        worker_enable_remote_control=False,
        worker_send_task_events=False,
        worker_hijack_root_logger=False,
    )
    return app


def register_tasks(app: Celery, settings: BatchSettings):
    """The batch task, bound to ``settings`` (the worker's)."""

    @app.task(
        name=TASK_NAME, bind=True, acks_late=True, reject_on_worker_lost=True, max_retries=None, ignore_result=True
    )
    def run_batch(self, batch_id: str) -> str:
        try:
            outcome = aio.run(run_job(settings, batch_id), what=f"batch {batch_id}")
        except Exception as exc:  # Redis away, a bug: the batch keeps its progress; try again later
            log.exception("batch %s: the job failed; it runs again later", batch_id)
            raise self.retry(exc=exc, countdown=min(60, 2 ** min(self.request.retries, 6))) from None
        if outcome == "busy":  # its previous owner still holds the lease (alive, or dead for < the lease TTL)
            raise self.retry(countdown=settings.batch_lease_ttl_s)
        if outcome == "handed_back":  # this worker is shutting down: the message goes back for another
            raise Reject("worker shutting down", requeue=True)
        return outcome

    return run_batch


def _shutting_down() -> bool:
    from celery.worker import state

    # Celery sets these to an exit code, 0 included, on a warm (cold) shutdown: test identity, as Celery does.
    return any(flag is not None and flag is not False for flag in (state.should_stop, state.should_terminate))


@lru_cache(maxsize=4)
def _serving(model: str, max_model_len: int | None) -> tuple:
    """(tokenizer, served model name, max_model_len), loaded once per process, as the gateway loads them."""
    from kernellab.runtime.request.registry import resolve_model
    from kernellab.services.gateway.tokenizer import load_gateway_tokenizer

    spec = resolve_model(model)
    return load_gateway_tokenizer(spec.name), spec.name, max_model_len or spec.max_model_len


async def run_job(settings: BatchSettings, batch_id: str) -> str:
    from kernellab.services.batch.client import QueueExecutor
    from kernellab.services.batch.files import FileStore
    from kernellab.services.batch.job import BatchJob
    from kernellab.services.batch.store import BatchStore
    from kernellab.services.gateway.state import redis_client

    tokenizer, served, max_len = _serving(settings.model, settings.max_model_len)
    client = redis_client(settings.redis_url, timeout=5.0)
    try:
        job = BatchJob(
            settings,
            BatchStore(client, settings.key_prefix),
            FileStore(settings.files_path),
            lambda deadline_s: QueueExecutor(settings, tokenizer, served, max_len, deadline_s=deadline_s),
            should_stop=_shutting_down,
        )
        return await job.run(batch_id)
    finally:
        await client.aclose()


def serve(settings: BatchSettings, *, loglevel: str = "info", hostname: str | None = None) -> None:
    """``kernellab batch-worker``: one Celery worker, solo pool (the batch job is I/O on Redis; the GPU work
    happens in the engine workers), consuming the batch queue."""
    import os
    import socket

    logging.basicConfig(level=loglevel.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = make_celery(settings)
    register_tasks(app, settings)
    longest = max(window_seconds(w) for w in settings.completion_windows)
    if settings.visibility_timeout_s <= longest:
        log.warning(
            "the visibility timeout (%.0fs) is not longer than the longest completion window (%ds): a "
            "batch still running may be delivered twice (safe: the copy waits on the lease)",
            settings.visibility_timeout_s,
            longest,
        )
    _serving(settings.model, settings.max_model_len)  # load the tokenizer before taking work
    name = hostname or f"batch-{socket.gethostname()}-{os.getpid()}@%h"
    log.info(
        "batch worker: queue %s, broker %s, files %s, %d lines in flight per batch",
        settings.batch_queue,
        settings.broker_url,
        settings.files_path,
        settings.batch_concurrency,
    )
    app.worker_main(
        [
            "worker",
            "--pool=solo",
            "--concurrency=1",
            f"--queues={settings.batch_queue}",
            f"--hostname={name}",
            f"--loglevel={loglevel.upper()}",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ]
    )
