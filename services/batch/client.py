"""The batch job's way into the request queue: the gateway's own client (``Gateway.submit`` → the batch
stream, one ``OutputRouter`` XREAD for every line in flight, ``ResultStream`` → ``collect``), so a batch
line and an API request take the same path through Redis and come back as the same body."""

from __future__ import annotations

import time

from kernellab.services.batch.settings import BatchSettings
from kernellab.services.config import GatewaySettings
from kernellab.services.gateway.generation import collect
from kernellab.services.gateway.requests import Prepared
from kernellab.services.gateway.state import Gateway


class QueueExecutor:
    def __init__(self, settings: BatchSettings, tokenizer, served_model: str, max_model_len: int, *, deadline_s: float):
        # Every request of the batch must finish before the batch expires: that is its deadline.
        gateway_settings = GatewaySettings(
            redis_url=settings.redis_url,
            key_prefix=settings.key_prefix,
            model=served_model,
            heartbeat_interval_s=settings.heartbeat_interval_s,
            worker_dead_after_s=settings.worker_dead_after_s,
            output_ttl_s=settings.output_ttl_s,
            request_timeout_s=max(1.0, deadline_s),
            max_waiting=settings.batch_concurrency,
            max_n=settings.max_n,
            gateway_metrics_port=0,
            api_keys="",
            api_key_file="",
        )
        self.tokenizer = tokenizer
        self.served_model = served_model
        self.max_model_len = max_model_len
        self.gateway = Gateway(gateway_settings, tokenizer, served_model, max_model_len)

    async def __aenter__(self) -> QueueExecutor:
        await self.gateway.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.gateway.stop()

    async def execute(self, p: Prepared) -> dict:
        rs = await self.gateway.submit(p, time.perf_counter())
        try:
            first = await rs.next()
            return await collect(p, rs, first, self.gateway.token_text)
        finally:
            rs.close()  # unfinished choices (cancelled, failed) are cancelled on the worker

    async def cancel(self, request_id: str) -> None:
        """Stop a request an earlier owner of the batch submitted (it may still run on a worker)."""
        self.gateway.cancel(request_id, None, "batch")
