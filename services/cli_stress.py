"""``kernellab stress``: the stack under load, faults and hostile clients; one JSON artifact per scenario.

    kernellab stress                                   # 5,000 mixed requests (the `load` scenario)
    kernellab stress --scenario all --requests 5000 --fault-requests 300
    kernellab stress --table                           # the Markdown table of the artifacts in --output-dir

Each scenario runs on one private stack (redis-server, 2 workers with the embedded model, 2 gateways) on
127.0.0.1 free ports, started and stopped by the command. The exit code is 1 when a scenario fails a check
(a lost request, a leaked KV block, a corrupt stream, a fault that did not happen).
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Annotated

import typer

from kernellab.services.cli import app

Opt = typer.Option


@app.command(rich_help_panel="Serving stack")
def stress(
    scenario: Annotated[
        list[str] | None,
        Opt(
            "--scenario",
            "-s",
            help="load | worker-kill | worker-pause | "
            "redis-restart | gateway-restart | slow-client | vanishing-client | "
            "all (repeatable)",
        ),
    ] = None,
    requests: Annotated[int, Opt(min=1, help="requests of the `load` scenario")] = 5000,
    fault_requests: Annotated[int, Opt(min=1, help="requests of each fault scenario")] = 300,
    concurrency: Annotated[int, Opt(min=1, help="clients sending at once")] = 32,
    workers: Annotated[int, Opt(min=1, help="worker processes")] = 2,
    max_tokens: Annotated[str, Opt(help="min:max tokens of ordinary requests")] = "4:8",
    max_waiting: Annotated[int, Opt(help="the gateway's 429 threshold (KERNELLAB_MAX_WAITING)")] = 256,
    seed: Annotated[int, Opt(help="seed of the request mix")] = 0,
    time_limit: Annotated[float, Opt(help="seconds per scenario after which no new request starts")] = 1800.0,
    output_dir: Annotated[Path, Opt(help="where {scenario}.json go")] = Path("results/reliability"),
    table_only: Annotated[bool, Opt("--table", help="print the Markdown table of output-dir's artifacts")] = False,
) -> None:
    """Stress, fault injection and hostile clients through the real stack; figures and a pass/fail verdict."""
    from kernellab import results
    from kernellab.services import stress as S

    if table_only:
        reports = [
            r for p in sorted(output_dir.glob("*.json")) if (r := json.loads(p.read_text()))["schema"] == S.SCHEMA
        ]
        order = {name: i for i, name in enumerate(S.SCENARIOS)}
        typer.echo(S.table(sorted(reports, key=lambda r: order.get(r["scenario"], 99))))
        return
    chosen = list(S.SCENARIOS) if not scenario or "all" in scenario else scenario
    if not scenario:
        chosen = ["load"]
    unknown = [s for s in chosen if s not in S.SCENARIOS]
    if unknown:
        raise typer.BadParameter(f"unknown scenario(s) {unknown}; choose from {', '.join(S.SCENARIOS)} or all")
    low, _, high = max_tokens.partition(":")
    tokens = (int(low), int(high or low))
    command = "kernellab stress " + shlex.join(sys.argv[2:] if sys.argv[1:2] == ["stress"] else sys.argv[1:])
    failed = []
    import tempfile

    for name in chosen:
        with (
            tempfile.TemporaryDirectory(prefix=f"kernellab-stress-{name}-") as workdir,
            S.LocalStack(Path(workdir), workers=workers, max_waiting=max_waiting) as stack,
        ):
            n = requests if name == "load" else fault_requests
            typer.echo(f"[{name}] {n} requests, concurrency {concurrency}, {workers} worker(s) …")
            report = S.run_scenario(
                stack,
                name,
                requests=n,
                concurrency=concurrency,
                seed=seed,
                max_tokens=tokens,
                time_limit_s=time_limit,
                command=command,
            )
            path = results.write(output_dir / f"{name}.json", report)
            if not report["passed"]:
                failed.append(name)
                typer.echo(json.dumps(S.brief(report), indent=1)[:4000])
                typer.echo(stack.log_tail())
            typer.echo(S.table([report]))
            typer.echo(f"[{name}] {'passed' if report['passed'] else 'FAILED'}: {path}")
    if failed:
        typer.echo(f"failed: {', '.join(failed)}")
        raise typer.Exit(1)
