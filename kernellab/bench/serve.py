"""``kernellab bench serve``: a fixed number of streaming requests at a fixed concurrency, then a report.

    python -m kernellab.bench.serve --url http://127.0.0.1:8000 --concurrency 8 \\
        --num-requests 64 --slo-ttft-ms 500 --slo-tpot-ms 50 --output results/bench_serve.json

Writes a JSON report (request and token throughput; TTFT, ITL, TPOT, E2E at p50/p90/p99; goodput under
the given SLOs; failures; each request; provenance) and a PNG of the latency distributions. Definitions:
``kernellab.services.loadgen.stats`` (shared with the Locust load generator). Every request streams with
``stream_options.include_usage``; token counts come from ``usage``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import importlib.metadata
import json
import os
import platform
import random
import socket
import sys
import time
from dataclasses import asdict
from pathlib import Path

import httpx

from kernellab.services.loadgen.sse import SSEDecoder, StreamResult
from kernellab.services.loadgen.stats import PERCENTILES, SLO, RequestRecord, format_table, summarize
from kernellab.services.loadgen.workload import RequestSpec, Workload

DEFAULT_MIX = "128:128:1"
SCHEMA = "kernellab.bench.serve/v1"  # artifact convention of kernellab.results


def run_bench_serve(
    url: str,
    model: str | None = None,
    concurrency: int = 8,
    num_requests: int = 64,
    *,
    api_key: str | None = None,
    mix: str = DEFAULT_MIX,
    endpoint: str = "chat",
    temperature: float = 0.0,
    ignore_eos: bool = False,
    request_rate: float | None = None,
    seed: int = 0,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    slo_e2e_ms: float | None = None,
    timeout_s: float = 300.0,
    output: str | Path | None = "bench_serve.json",
    plot: str | Path | None = "bench_serve.png",
) -> dict:
    """Run the benchmark and return the report (also written to ``output`` and plotted to ``plot``).

    ``request_rate`` (req/s): Poisson arrivals, still capped by ``concurrency``; None sends as fast as the
    concurrency allows (a closed loop).
    """
    if concurrency < 1 or num_requests < 1:
        raise ValueError("concurrency and num_requests must be at least 1")
    if endpoint not in ("chat", "completions"):
        raise ValueError("endpoint must be 'chat' or 'completions'")
    workload = Workload(mix, seed)
    specs = [workload.next() for _ in range(num_requests)]
    slo = SLO(slo_ttft_ms, slo_tpot_ms, slo_e2e_ms)
    started_at = dt.datetime.now(dt.UTC)
    served_model, records, duration = asyncio.run(
        _run(url, model, concurrency, specs, api_key, endpoint, temperature, ignore_eos, request_rate, seed,
             timeout_s)
    )  # fmt: skip
    report = {"schema": SCHEMA, **summarize(records, duration, slo)}
    report["config"] = {
        "url": url,
        "model": served_model,
        "concurrency": concurrency,
        "num_requests": num_requests,
        "mix": mix,
        "endpoint": endpoint,
        "temperature": temperature,
        "ignore_eos": ignore_eos,
        "request_rate": request_rate,
        "seed": seed,
    }
    report["provenance"] = _provenance(started_at)
    report["records"] = [asdict(r) | {"tpot": r.tpot} for r in records]
    if output:
        path = Path(output)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
    if plot:
        plot_latencies(records, report, plot)
    return report


async def _run(url, model, concurrency, specs, api_key, endpoint, temperature, ignore_eos, request_rate, seed,
               timeout_s) -> tuple[str, list[RequestRecord], float]:  # fmt: skip
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(timeout_s, connect=10.0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout, headers=headers) as client:
        if model is None:
            response = await client.get("/v1/models")
            response.raise_for_status()
            model = response.json()["data"][0]["id"]
        gate = asyncio.Semaphore(concurrency)
        arrivals = random.Random(seed + 1)

        async def one(spec: RequestSpec) -> RequestRecord:
            async with gate:
                return await _stream_one(client, model, spec, endpoint, temperature, ignore_eos)

        start = time.perf_counter()
        tasks = []
        for spec in specs:
            tasks.append(asyncio.create_task(one(spec)))
            if request_rate:
                await asyncio.sleep(arrivals.expovariate(request_rate))
        records = await asyncio.gather(*tasks)
        return model, list(records), time.perf_counter() - start


async def _stream_one(client: httpx.AsyncClient, model: str, spec: RequestSpec, endpoint: str,
                      temperature: float, ignore_eos: bool) -> RequestRecord:  # fmt: skip
    body: dict = {
        "model": model,
        "max_tokens": spec.max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True
    if endpoint == "chat":
        path, body["messages"] = "/v1/chat/completions", spec.messages
    else:
        path, body["prompt"] = "/v1/completions", spec.prompt
    result = StreamResult(start=time.perf_counter())
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode("utf-8", "replace")
                result.error = f"HTTP {response.status_code}: {text[:200]}"
            else:
                decoder = SSEDecoder()
                async for line in response.aiter_lines():
                    payload = decoder.feed_line(line)
                    if payload is not None:
                        result.feed(payload)
                    if result.error or decoder.done:
                        break
                else:
                    payload = decoder.close()
                    if payload is not None:
                        result.feed(payload)
    except httpx.HTTPError as error:
        result.error = f"{type(error).__name__}: {error}"
    result.finish()
    return RequestRecord(
        ok=result.error is None,
        error=result.error,
        ttft=result.ttft,
        itls=result.itls,
        e2e=result.e2e,
        prompt_tokens=result.prompt_tokens or 0,
        completion_tokens=result.completion_tokens or 0,
    )


def _provenance(started_at: dt.datetime) -> dict:
    """The keys of kernellab.results.provenance that a torch-free client can fill in."""
    from kernellab.results import git_commit

    try:
        version = importlib.metadata.version("kernellab")
    except importlib.metadata.PackageNotFoundError:
        version = None
    return {
        "date": started_at.isoformat(timespec="seconds"),
        "commit": git_commit(),
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "kernellab": version,
        "httpx": httpx.__version__,
        "tool": "kernellab bench serve",
    }


def plot_latencies(records: list[RequestRecord], report: dict, path: str | Path) -> None:
    """Histograms of TTFT, ITL, TPOT and E2E (ms) with their p50/p90/p99 marked, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if r.ok]
    series = {
        "TTFT": [r.ttft for r in ok if r.ttft is not None],
        "ITL": [gap for r in ok for gap in r.itls],
        "TPOT": [r.tpot for r in ok if r.tpot is not None],
        "E2E": [r.e2e for r in ok if r.e2e is not None],
    }
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), constrained_layout=True)
    for ax, (name, values) in zip(axes.flat, series.items(), strict=True):
        dist = report[f"{name.lower()}_s"]
        ax.set_title(f"{name} (n={dist['count']})")
        ax.set_xlabel("ms")
        if not values:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
            continue
        ax.hist([v * 1000 for v in values], bins=min(50, max(5, len(values) // 2)), color="#4c72b0", alpha=0.8)
        for q, style in zip(PERCENTILES, (":", "--", "-"), strict=True):
            ax.axvline(
                dist[f"p{q}"] * 1000,
                color="#c44e52",
                linestyle=style,
                label=f"p{q} {dist[f'p{q}'] * 1000:.1f}",
            )
        ax.legend(fontsize=8)
    config = report.get("config", {})
    fig.suptitle(
        f"{config.get('model')} — concurrency {config.get('concurrency')}, {report['requests']['completed']}/"
        f"{report['requests']['total']} requests, {report['output_token_throughput_tps']:.1f} output tok/s"
    )
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_serve", description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--model")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--api-key", help="default: $KERNELLAB_API_KEY")
    parser.add_argument("--mix", default=DEFAULT_MIX, help="prompt_words:max_tokens:weight, comma-separated")
    parser.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--request-rate", type=float)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slo-ttft-ms", type=float)
    parser.add_argument("--slo-tpot-ms", type=float)
    parser.add_argument("--slo-e2e-ms", type=float)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--output", default="bench_serve.json")
    parser.add_argument("--plot", default="bench_serve.png")
    args = parser.parse_args(argv)
    report = run_bench_serve(
        args.url, args.model, args.concurrency, args.num_requests,
        api_key=args.api_key or os.environ.get("KERNELLAB_API_KEY"), mix=args.mix, endpoint=args.endpoint,
        temperature=args.temperature, ignore_eos=args.ignore_eos, request_rate=args.request_rate, seed=args.seed,
        slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms, slo_e2e_ms=args.slo_e2e_ms,
        timeout_s=args.timeout_s, output=args.output, plot=args.plot,
    )  # fmt: skip
    print(format_table(report))
    return 0 if report["requests"]["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
