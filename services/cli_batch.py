"""Batch commands: ``kernellab batch-worker`` (the Celery worker behind /v1/batches) and ``kernellab batch``
(the same line format offline: the engine in this process, no stack).

Flags override ``KERNELLAB_*`` environment variables; heavy imports (Celery, torch) stay inside the commands.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from kernellab.services.cli import app

Opt = typer.Option


@app.command("batch-worker", rich_help_panel="Serving stack")
def batch_worker(
    model: Annotated[str | None, Opt(help="registry name or hub id [env KERNELLAB_MODEL]")] = None,
    redis_url: Annotated[str | None, Opt(help="[env KERNELLAB_REDIS_URL]")] = None,
    broker_url: Annotated[
        str | None, Opt(help="Celery broker; default the Redis URL [env KERNELLAB_CELERY_BROKER_URL]")
    ] = None,
    files_dir: Annotated[str | None, Opt(help="shared with the gateway [env KERNELLAB_FILES_DIR]")] = None,
    concurrency: Annotated[
        int | None,
        Opt(min=1, help="lines of a batch in the queue at once [env KERNELLAB_BATCH_CONCURRENCY; default 8]"),
    ] = None,
    key_prefix: Annotated[str | None, Opt(help="Redis key prefix [env KERNELLAB_KEY_PREFIX; default kl:]")] = None,
    loglevel: Annotated[str, Opt(help="debug | info | warning")] = "info",
) -> None:
    """The Celery worker that runs /v1/batches jobs through the batch-priority request queue."""
    from kernellab.services.batch.celery_app import serve
    from kernellab.services.batch.settings import BatchSettings

    flags: dict[str, Any] = {  # pydantic checks each value against its field
        "model": model,
        "redis_url": redis_url,
        "celery_broker_url": broker_url,
        "files_dir": files_dir,
        "batch_concurrency": concurrency,
        "key_prefix": key_prefix,
    }
    serve(BatchSettings(**{k: v for k, v in flags.items() if v is not None}), loglevel=loglevel)


@app.command("batch")
def batch(
    input_file: Annotated[Path, Opt("--input", "-i", exists=True, dir_okay=False, help="requests, JSONL")],
    output_file: Annotated[Path, Opt("--output", "-o", dir_okay=False, help="successful lines, JSONL")],
    model: Annotated[str, Opt(help="registry name or hub id")] = "smollm2-135m",
    errors_file: Annotated[
        Path | None, Opt("--errors", "-e", dir_okay=False, help="failed lines, JSONL; default <output>.errors.jsonl")
    ] = None,
    device: Annotated[str, Opt(help="cpu | cuda | auto")] = "auto",
    dtype: Annotated[str, Opt(help="auto | float32 | bfloat16 | float16")] = "auto",
    max_num_seqs: Annotated[int, Opt(min=1, help="requests the engine runs at once")] = 64,
    num_kv_blocks: Annotated[int | None, Opt(help="KV cache size in blocks (default: sized by the engine)")] = None,
    max_model_len: Annotated[int | None, Opt(help="context length (default: the model's)")] = None,
) -> None:
    """Run a Batch API input file with the engine in this process (no stack): /v1/batches' output and error lines, in input order."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kernellab.runtime.request.errors import KernellabError
    from kernellab.services.batch.offline import run_offline

    errors_file = errors_file or output_file.with_name(output_file.name.removesuffix(".jsonl") + ".errors.jsonl")
    engine_kwargs = {"device": device, "dtype": dtype, "max_num_seqs": max_num_seqs, "num_kv_blocks": num_kv_blocks}
    console = Console(stderr=True)
    with Progress(
        TextColumn("[bold]batch"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as bar:
        task = bar.add_task("lines", total=None)

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        try:
            summary = run_offline(
                input_file,
                output_file,
                errors_file,
                model=model,
                concurrency=max_num_seqs,
                engine_kwargs=engine_kwargs,
                max_model_len=max_model_len,
                progress=progress,
            )
        except KernellabError as exc:
            console.print(f"error: {exc.message}")
            raise typer.Exit(1) from None
    console.print(
        f"{summary.total} lines in {summary.seconds:.1f}s: {summary.completed} completed → {output_file}"
        + (f", {summary.failed} failed → {summary.errors}" if summary.failed else "")
    )
