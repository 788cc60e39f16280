"""``kernellab batch -i in.jsonl -o out.jsonl``: the Batch API's line format with the engine in this process
and no stack (no Redis, no gateway, no Celery), like vLLM's run-batch.

The lines go through the same ``LineRunner`` as a Batch API job; only the executor differs: instead of the
request queue, ``EngineExecutor`` adds each request to an in-process ``LLMEngine`` and turns its step
outputs into the worker's ``OutputChunk`` messages, which the gateway's ``ResultStream`` and ``collect``
read exactly as they read the queue. So the same input gives the same output lines either way (up to ids,
timestamps and prefix-cache hit counts, which depend on the run).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kernellab.runtime.request.errors import KernellabError
from kernellab.services.batch import lines as L
from kernellab.services.batch.runner import LineRunner, Outcome
from kernellab.services.gateway.generation import ResultStream, collect
from kernellab.services.gateway.requests import Prepared
from kernellab.services.gateway.responses import TokenText
from kernellab.services.gateway.router import Subscription
from kernellab.services.queue.protocol import ErrorMessage, OutputChunk, engine_request_id

_NO_DEADLINE_S = 10 * 365 * 86400.0


@dataclass
class _Active:
    p: Prepared
    sub: Subscription
    index: int
    emitted: int = 0


class EngineExecutor:
    """An ``Executor`` over an in-process engine, stepped by a task of the event loop."""

    def __init__(self, engine, tokenizer, served_model: str, max_model_len: int):
        self.engine = engine
        self.tokenizer = tokenizer
        self.served_model = served_model
        self.max_model_len = max_model_len
        self.token_text = TokenText(tokenizer)
        self._active: dict[str, _Active] = {}
        self._wake = asyncio.Event()
        self._driver: asyncio.Task | None = None
        self._view = _StreamGateway(self)

    async def __aenter__(self) -> EngineExecutor:
        self._driver = asyncio.create_task(self._drive())
        return self

    async def __aexit__(self, *exc) -> None:
        if self._driver is not None:
            self._driver.cancel()
            await asyncio.gather(self._driver, return_exceptions=True)
        for eid in list(self._active):
            self.engine.abort(eid)
        self._active.clear()

    async def execute(self, p: Prepared) -> dict:
        if self._driver is not None and self._driver.done():
            self._driver.result()  # the engine failed: raise its error rather than wait forever
        sub = Subscription({engine_request_id(p.request_id, c.index): c.index for c in p.choices})
        added = []
        try:
            for c in p.choices:
                eid = engine_request_id(p.request_id, c.index)
                self.engine.add_request(eid, p.prompts[c.prompt_index], c.params)
                added.append(eid)
                self._active[eid] = _Active(p, sub, c.index)
        except KernellabError:
            for eid in added:
                self.engine.abort(eid)
                self._active.pop(eid, None)
            raise
        self._wake.set()
        rs = ResultStream(self._view, p, sub, time.time() + _NO_DEADLINE_S, time.perf_counter())
        try:
            first = await rs.next()
            return await collect(p, rs, first, self.token_text)
        finally:
            rs.close()

    async def cancel(self, request_id: str) -> None:
        self.abort_choice(request_id, None)

    def forget_streams(self, engine_ids: list[str]) -> None:
        for eid in engine_ids:
            if self._active.pop(eid, None) is not None:
                self.engine.abort(eid)

    def abort_choice(self, request_id: str, index: int | None) -> None:
        for eid, a in list(self._active.items()):
            if a.p.request_id == request_id and index in (None, a.index):
                self.engine.abort(eid)
                del self._active[eid]

    # ----------------------------------------------------------------- the step loop
    async def _drive(self) -> None:
        """Steps the engine while it has work; between steps the line tasks collect and add requests."""
        try:
            while True:
                if not self.engine.has_unfinished_requests():
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                self._deliver(self.engine.step())
                await asyncio.sleep(0)
        except Exception as exc:  # the engine failed: end every waiting line, and let execute() raise it
            for a in self._active.values():
                a.sub.queue.put_nowait((a.index, ErrorMessage(a.p.request_id, a.index, 500, f"engine error: {exc}")))
            self._active.clear()
            raise

    def _deliver(self, outputs) -> None:
        """Step outputs → the worker's ``OutputChunk`` messages, as the worker writes them to Redis."""
        for out in outputs:
            a = self._active.get(out.request_id)
            if a is None:
                continue
            tokens = list(out.new_token_ids)
            if not tokens and not out.finished:
                continue
            logprobs = None
            if out.new_logprobs:  # the wire format: [token_id, logprob, [[top_id, top_logprob], ...]]
                logprobs = [
                    [lp.token_id, float(lp.logprob), [[int(t), float(v)] for t, v in lp.top]] for lp in out.new_logprobs
                ]
            chunk = OutputChunk(
                a.p.request_id,
                a.index,
                a.emitted,
                tokens,
                logprobs,
                out.finished,
                out.finish_reason,
                out.stop_reason,
                out.num_prompt_tokens,
                a.emitted + len(tokens),
                out.num_cached_tokens,
            )
            a.emitted += len(tokens)
            a.sub.queue.put_nowait((a.index, chunk))
            if out.finished:
                del self._active[out.request_id]


class _StreamGateway:
    """What a ``ResultStream`` calls on its gateway (counts, cancels on a stop string, cleanup), mapped
    onto the in-process engine."""

    def __init__(self, ex: EngineExecutor):
        self._ex = ex
        self.tokenizer = ex.tokenizer

    def first_token(self, rs) -> None:
        pass

    def release(self, rs) -> None:
        pass

    def cancel(self, request_id: str, index: int | None, reason: str) -> None:
        self._ex.abort_choice(request_id, index)

    def forget_streams(self, engine_ids: list[str]) -> None:
        self._ex.forget_streams(engine_ids)


@dataclass
class OfflineSummary:
    total: int
    completed: int
    failed: int
    seconds: float
    output: Path
    errors: Path | None


def run_offline(
    input_path: Path,
    output_path: Path,
    errors_path: Path,
    *,
    model: str,
    concurrency: int,
    engine_kwargs: dict,
    max_model_len: int | None = None,
    max_n: int = 16,
    progress: Callable[[int, int], None] | None = None,
) -> OfflineSummary:
    """Run every line of ``input_path``; successes to ``output_path``, failures to ``errors_path`` (only
    written when there are failures), both in input order. ``progress(done, total)`` after each line."""
    from kernellab.runtime.config import EngineConfig
    from kernellab.runtime.engine import LLMEngine

    total = L.count_lines(input_path)
    engine = LLMEngine(EngineConfig(model=model, max_model_len=max_model_len, **engine_kwargs))
    tokenizer = engine.tokenizer
    served = engine.spec.name
    limit = max_model_len or engine.spec.max_model_len or engine.max_model_len
    results: dict[int, tuple[bool, str]] = {}
    started = time.perf_counter()

    async def record(o: Outcome) -> None:
        results[o.index] = (o.ok, L.dumps(o.line))
        if progress is not None:
            progress(len(results), total)

    async def main() -> None:
        async with EngineExecutor(engine, tokenizer, served, limit) as ex:
            await LineRunner(ex, record, concurrency=concurrency, max_n=max_n).run(L.iter_input(input_path))

    asyncio.run(main())
    ok_lines = [results[i][1] for i in sorted(results) if results[i][0]]
    error_lines = [results[i][1] for i in sorted(results) if not results[i][0]]
    output_path.parent.mkdir(parents=True, exist_ok=True)
    output_path.write_text("".join(f"{line}\n" for line in ok_lines), encoding="utf-8")
    if error_lines:
        errors_path.parent.mkdir(parents=True, exist_ok=True)
        errors_path.write_text("".join(f"{line}\n" for line in error_lines), encoding="utf-8")
    return OfflineSummary(
        total,
        len(ok_lines),
        len(error_lines),
        time.perf_counter() - started,
        output_path,
        errors_path if error_lines else None,
    )
