"""The scenarios of ``kernellab stress``: ``SCENARIOS`` and ``run_scenario``, which runs the load with one
fault beside it on a started stack, then reads the idle stack and returns the report."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

from kernellab.services.stress.client import LoadRun, make_plans
from kernellab.services.stress.faults import FAULTS, FaultEvent
from kernellab.services.stress.processes import MODEL, LocalStack
from kernellab.services.stress.report import idle_report, summarize

SCENARIOS = (
    "load",
    "worker-kill",
    "worker-pause",
    "redis-restart",
    "gateway-restart",
    "slow-client",
    "vanishing-client",
)


async def _scenario(stack: LocalStack, scenario: str, run: LoadRun, fault_kwargs: dict) -> list[FaultEvent]:
    events: list[FaultEvent] = []
    load = asyncio.ensure_future(run.run())
    if scenario != "load":
        fault = asyncio.ensure_future(FAULTS[scenario](stack, run, events, **fault_kwargs))
        try:
            await asyncio.wait({fault}, timeout=run.time_limit_s + 60)
            run.stop_at = run.sent + 2 * run.concurrency  # a tail after the last fault, then stop
            if fault.done() and fault.exception() is not None:
                now = time.perf_counter()
                events.append(FaultEvent(scenario, now, now, {"error": repr(fault.exception())[:300]}))
        finally:
            fault.cancel()
    await load
    return events


def run_scenario(
    stack: LocalStack,
    scenario: str,
    *,
    requests: int,
    concurrency: int,
    seed: int = 0,
    max_tokens: tuple[int, int] = (4, 8),
    time_limit_s: float = 1800.0,
    guard_s: float = 120.0,
    fault_kwargs: dict | None = None,
    command: str = "",
) -> dict:
    """One scenario against a started stack; returns the report (not yet written)."""
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}; one of {', '.join(SCENARIOS)}")
    mixed = scenario == "load"
    plans = make_plans(
        requests, seed, max_tokens=max_tokens, cancel_frac=0.03 if mixed else 0.0, deadline_frac=0.02 if mixed else 0.0
    )
    # Fault scenarios retry clean, retryable errors with backoff 0.25 s doubling to 2 s: 8 retries wait ~12 s.
    run = LoadRun(
        stack, plans, concurrency=concurrency, retries=0 if mixed else 8, guard_s=guard_s, time_limit_s=time_limit_s
    )
    load_before = os.getloadavg()
    finishes_before = _finishes(stack) if scenario == "worker-pause" else None
    events = asyncio.run(_scenario(stack, scenario, run, fault_kwargs or {}))
    for name in [n for n, p in stack.procs.items() if n.startswith("worker") and p.poll() is None]:
        with contextlib.suppress(ProcessLookupError):
            stack.procs[name].send_signal(signal.SIGCONT)  # a fault that failed half-way must not leave one paused
    idle = idle_report(stack)
    config = {
        "requests": requests,
        "concurrency": concurrency,
        "seed": seed,
        "max_tokens": list(max_tokens),
        "workers": len(stack.worker_ports),
        "model": MODEL,
        "retries": run.retries,
        "guard_s": guard_s,
        "deadline_gateway_timeout_s": stack.deadline_s,
        "worker_dead_after_s": stack.dead_after_s,
        "max_waiting": int(stack.env["KERNELLAB_MAX_WAITING"]),
        "fault": fault_kwargs or {},
        "command": command,
        # The machine is shared: its load average before and after says how quiet the run was.
        "load_average": [round(x, 2) for x in (*load_before, *os.getloadavg())],
    }
    report = summarize(scenario, run, events, idle, config)
    if finishes_before is not None and report["faults"]:
        # Each completed request finishes once on some worker; more finishes mean a request ran twice (the
        # paused worker went on with requests another worker had reclaimed from it).
        extra = int(_finishes(stack) - finishes_before - report["requests"]["completed"])
        report["faults"][0]["duplicate_finishes"] = extra
        report["checks"]["no_duplicate_work"] = extra == 0
        report["passed"] = all(report["checks"].values())
    return report


def _finishes(stack: LocalStack) -> float:
    return sum(stack.worker_metric(i, "kernellab:request_success_total") for i in stack.live_workers())
