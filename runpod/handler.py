"""RunPod serverless worker: the kernellab engine in-process, behind the RunPod SDK.

    python runpod/handler.py                                  # on RunPod (the worker image runs this)
    python runpod/handler.py --rp_serve_api --rp_api_port 8011 --rp_api_host 127.0.0.1   # local test API

The handler is an async generator (``return_aggregate_stream``: ``/run`` + ``/stream`` get the pieces as
they come, ``/runsync`` gets them as one list). Jobs run concurrently, up to ``MAX_CONCURRENCY``, and batch
together in the engine (engine_loop.py). Input and output shapes: openai_io.py and runpod/README.md.

Environment: the worker's ``KERNELLAB_*`` settings (KERNELLAB_MODEL, KERNELLAB_DEVICE, KERNELLAB_DTYPE,
KERNELLAB_MAX_MODEL_LEN, KERNELLAB_MAX_NUM_SEQS, ...), HF_HOME, MAX_CONCURRENCY (default 32).

A CUDA fault leaves the device context unusable, so after one the process fails the jobs in flight and exits
with status 1; RunPod then replaces the worker instead of sending it more jobs.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import fields

from engine_loop import EngineLoop
from openai_io import ResponseBuilder, error_output, logprob_entries, models_output, parse_job_input

import runpod
from kernellab.runtime.config import EngineConfig
from kernellab.runtime.request.detokenizer import IncrementalDetokenizer
from kernellab.runtime.request.errors import KernellabError

log = logging.getLogger("kernellab.runpod")

DEFAULT_MAX_CONCURRENCY = 32
FATAL_EXIT_CODE = 1


def max_concurrency() -> int:
    value = os.environ.get("MAX_CONCURRENCY", str(DEFAULT_MAX_CONCURRENCY))
    try:
        number = int(value)
    except ValueError:
        raise SystemExit(f"MAX_CONCURRENCY must be a positive integer, got {value!r}") from None
    if number < 1:
        raise SystemExit(f"MAX_CONCURRENCY must be a positive integer, got {number}")
    return number


def engine_config_from_env() -> EngineConfig:
    """The same KERNELLAB_* variables as `kernellab worker`, mapped onto the engine's fields."""
    from kernellab.services.config import WorkerSettings

    settings = WorkerSettings()
    shared = {f.name for f in fields(EngineConfig)} & set(type(settings).model_fields)
    return EngineConfig(**{name: getattr(settings, name) for name in shared})


def exit_after_fault(error: BaseException, grace_s: float = 2.0) -> None:
    """Runs on the engine thread after a CUDA fault: let the failed jobs report, then leave."""
    log.critical("CUDA fault, exiting so that RunPod replaces this worker: %s", error)
    time.sleep(grace_s)
    os._exit(FATAL_EXIT_CODE)


def make_handler(loop: EngineLoop, tokenizer, served_model: str, max_model_len: int):
    async def handler(job):
        job_id = str(job["id"])
        try:
            request = parse_job_input(job.get("input"), tokenizer, served_model, max_model_len)
        except KernellabError as error:
            yield error_output(error)
            return
        if request.kind == "models":
            yield models_output(served_model)
            return
        builder = ResponseBuilder(request, tokenizer)
        params = request.params
        # The text side of stop strings: the engine ends the request at one, this holds back and cuts the text
        # (runtime/request/detokenizer.py says why both run).
        detokenizer = IncrementalDetokenizer(
            tokenizer, request.prompt_token_ids, params.stop, params.include_stop_str_in_output
        )
        outputs = loop.submit(job_id, request.prompt_token_ids, params)
        last = None
        try:
            opening = builder.opening()
            if opening is not None:
                yield opening
            while last is None:
                # Everything the engine produced since the last yield goes out as one piece.
                items = [await outputs.get()]
                while not outputs.empty():
                    items.append(outputs.get_nowait())
                text, token_ids, logprobs = "", [], []
                for item in items:
                    if isinstance(item, BaseException):
                        last = item
                        break
                    text += detokenizer.push(item.new_token_ids)
                    token_ids += item.new_token_ids
                    logprobs += logprob_entries(item.new_logprobs)
                    if item.finished:
                        last = item
                if isinstance(last, BaseException):
                    yield error_output(last)
                    return
                piece = builder.piece(text, token_ids, logprobs)
                if piece is not None:
                    yield piece
            tail = detokenizer.flush()
            for closing in builder.closing(tail, last.finish_reason, last.num_prompt_tokens, last.num_output_tokens,
                                           last.num_cached_tokens):  # fmt: skip
                yield closing
        finally:
            if last is None:  # the caller went away (or the job was cancelled): free the KV blocks now
                loop.abort(job_id)

    return handler


def main() -> None:
    logging.basicConfig(
        level=os.environ.get("KERNELLAB_LOG_LEVEL", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    from kernellab.runtime.engine import LLMEngine

    concurrency = max_concurrency()
    config = engine_config_from_env()
    engine = LLMEngine(config)
    tokenizer = engine.tokenizer
    from kernellab.services.config import WorkerSettings

    if WorkerSettings().gc_freeze:  # KERNELLAB_GC_FREEZE, as for `kernellab worker`
        from kernellab.services.observability import freeze_heap

        freeze_heap()  # no full collection walks the model and the tokenizer mid-request
    loop = EngineLoop(engine, on_fatal=exit_after_fault)
    loop.start()
    # The registry name, as the gateway reports it; requests may also name the model by its hub id.
    served_model = engine.spec.name
    log.info("serving %s, MAX_CONCURRENCY=%d", served_model, concurrency)
    runpod.serverless.start(
        {
            "handler": make_handler(loop, tokenizer, served_model, engine.max_model_len),
            "return_aggregate_stream": True,
            "concurrency_modifier": lambda current: concurrency,
        }
    )


if __name__ == "__main__":
    main()
