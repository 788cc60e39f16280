"""The report of ``kernellab stress``: the stack read once idle, the JSON artifact (``summarize``, schema
``SCHEMA``), the Markdown table of docs/reliability.md and ``brief`` for logs."""

from __future__ import annotations

import contextlib
import time
from collections import Counter

from kernellab.services.loadgen.stats import distribution
from kernellab.services.processes import wait_for
from kernellab.services.stress.client import LoadRun, Result
from kernellab.services.stress.faults import FaultEvent
from kernellab.services.stress.processes import LocalStack

SCHEMA = "kernellab.reliability/v1"


# ===================================================================== after the run
def idle_report(stack: LocalStack, timeout: float = 60) -> dict:
    """Wait until every live worker is idle (and has checked its engine since), then read its blocks."""
    workers = []
    for i in stack.live_workers():

        def idle(i=i):
            h = stack.worker_health(i)
            quiet = not (h["running"] or h["waiting"] or h.get("active") or h.get("held"))
            return h if quiet and h.get("integrity") not in (None, "unchecked") else None

        try:
            wait_for(idle, 2.0, "")  # first sight of idle; then one more integrity period
            time.sleep(1.2)
            h = wait_for(idle, timeout, f"worker {i} to be idle")
        except TimeoutError:
            h = stack.worker_health(i)
        workers.append(
            {
                "worker": h["worker_id"],
                "running": h["running"],
                "waiting": h["waiting"],
                "active": h.get("active"),
                "held": h.get("held"),
                "kv_blocks_used": h.get("kv_blocks_used"),
                "kv_blocks_total": h.get("kv_blocks_total"),
                "integrity": h.get("integrity"),
            }
        )
    gw = {}
    with contextlib.suppress(Exception):
        wait_for(lambda: stack.gateway_metric("kernellab_gateway_requests_in_flight") == 0, 30, "gateway idle")
    with contextlib.suppress(Exception):
        gw = {
            "in_flight": stack.gateway_metric("kernellab_gateway_requests_in_flight"),
            "queue_depth": stack.gateway_metric("kernellab_gateway_queue_depth"),
        }
    return {"workers": workers, "gateway": gw}


def _corrupt(results: list[Result]) -> list[dict]:
    """Deterministic requests whose text differs from the first of their kind, or whose token counts disagree."""
    first: dict[tuple, str] = {}
    bad = []
    for r in sorted(results, key=lambda r: r.final.start):
        a = r.final
        if a.outcome != "completed":
            continue
        p = r.plan
        why = None
        if p.ignore_eos and a.completion_tokens != p.max_tokens:
            why = f"{a.completion_tokens} tokens for max_tokens={p.max_tokens} with ignore_eos"
        elif a.tokens_seen is not None and a.tokens_seen != a.completion_tokens:
            why = f"{a.tokens_seen} tokens streamed, usage says {a.completion_tokens}"
        elif p.key is not None and first.setdefault(p.key, a.text) != a.text:
            why = f"text {a.text!r} differs from the first {first[p.key]!r}"
        if why:
            bad.append({"index": p.index, "why": why[:200]})
    return bad


def _fault_figures(ev: FaultEvent, results: list[Result], t0: float) -> dict:
    attempts = [a for r in results for a in r.attempts]
    hit = [a for a in attempts if a.start < ev.at < a.end]
    stalls = []
    for a in hit:
        after = [t for t in a.chunk_times if t > ev.at]
        stalls.append((after[0] if after else a.end) - ev.at)
    later = [a.end for a in attempts if a.outcome == "completed" and a.start >= ev.end]
    if ev.kind == "slow-client":
        later = []  # nothing went down: the figures are the readers' own (read_s, complete_and_equal)
    out = {
        "kind": ev.kind,
        "at_s": round(ev.at - t0, 3),
        "injector_s": round(ev.end - ev.at, 3),
        "in_flight_at_fault": len(hit),
        "stall_s": round(max(stalls), 3) if stalls else 0.0,
        "recovery_s": round(min(later) - ev.at, 3) if later else None,
    }
    out.update(ev.details)
    return out


def summarize(scenario: str, run: LoadRun, events: list[FaultEvent], idle: dict, config: dict) -> dict:
    from kernellab.results import provenance

    outcomes = Counter(r.outcome for r in run.results)
    attempts = [a for r in run.results for a in r.attempts]
    clean = Counter(a.code or "unknown" for a in attempts if a.outcome in ("error", "refused"))
    lost = [{"index": r.plan.index, "detail": a.detail} for r in run.results for a in r.attempts if a.outcome == "lost"]
    corrupt = _corrupt(run.results)
    completed = [r.final for r in run.results if r.outcome == "completed"]
    leaked = sum(int(w["kv_blocks_used"] or 0) for w in idle["workers"])
    stuck = sum(int(w["active"] or 0) + int(w["held"] or 0) for w in idle["workers"])
    integrity_ok = all(w["integrity"] == "ok" for w in idle["workers"])
    gateway_idle = not idle["gateway"] or (
        idle["gateway"].get("in_flight") == 0 and idle["gateway"].get("queue_depth") == 0
    )
    checks = {
        "zero_lost": not lost and run.not_sent == 0,
        "zero_leaked_blocks": leaked == 0 and stuck == 0,
        "engine_integrity": integrity_ok,
        "zero_corrupt": not corrupt,
        "gateway_idle": gateway_idle,
        "all_workers_reported": len(idle["workers"]) == len(run.stack.worker_ports),
        "rejections_say_retry_after": all(a.retry_after for a in attempts if a.code == "rate_limit_exceeded"),
    }
    faults = [_fault_figures(ev, run.results, run.t0) for ev in events]
    checks["faults_injected"] = bool(faults) == (scenario != "load") and not any("error" in f for f in faults)
    if scenario == "slow-client":
        checks["slow_clients_complete"] = all(f.get("complete_and_equal") == f.get("clients") for f in faults)
    if scenario == "vanishing-client":
        checks["vanished_streams_aborted"] = all(f.get("aborted", -1) >= f.get("streams", 0) for f in faults)
    if scenario == "load":
        checks["no_unexpected_failures"] = outcomes.get("failed", 0) == 0
    return {
        "schema": SCHEMA,
        "provenance": provenance("cpu"),
        "scenario": scenario,
        "config": config,
        "duration_s": round(run.duration, 3),
        "requests": {
            "total": run.sent,
            "completed": outcomes.get("completed", 0),
            "cancelled": outcomes.get("cancelled", 0),
            "timed_out": outcomes.get("timed_out", 0),
            "rejected": outcomes.get("rejected", 0),
            "failed": outcomes.get("failed", 0),
            "lost": outcomes.get("lost", 0),
            "not_sent": run.not_sent,
            "attempts": len(attempts),
            "corrupt": len(corrupt),
        },
        "clean_errors": dict(clean.most_common()),
        "lost_details": lost[:20],
        "corrupt_details": corrupt[:20],
        "throughput_rps": round(len(run.results) / max(run.duration, 1e-9), 3),
        "ttft_s": distribution(a.first - a.start for a in completed if a.first is not None),
        "e2e_s": distribution(a.end - a.start for a in completed),
        "faults": faults,
        "workers": idle["workers"],
        "gateway": idle["gateway"],
        "leaked_blocks": leaked,
        "checks": checks,
        "passed": all(checks.values()),
    }


# ===================================================================== reporting
def table(reports: list[dict]) -> str:
    """The Markdown table of docs/reliability.md from reports (one row per scenario)."""
    head = (
        "| scenario | requests | completed | cancelled | timed out | rejected (429) | failed | lost | corrupt "
        "| leaked blocks | req/s | TTFT p50 / p99 (s) | E2E p50 / p99 (s) | clean errors (attempts) | fault figures |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in reports:
        q = r["requests"]

        def pp(d):
            return f"{d['p50']:.3f} / {d['p99']:.3f}" if d.get("count") else "–"

        figs = "; ".join(_fault_text(f) for f in r["faults"]) or "–"
        clean = ", ".join(f"{k} {v}" for k, v in r["clean_errors"].items()) or "–"
        lines.append(
            f"| {r['scenario']} | {q['total']} | {q['completed']} | {q['cancelled']} | {q['timed_out']} | "
            f"{q['rejected']} | {q['failed']} | {q['lost']} | {q['corrupt']} | {r['leaked_blocks']} | "
            f"{r['throughput_rps']:.2f} | {pp(r['ttft_s'])} | {pp(r['e2e_s'])} | {clean} | {figs} |"
        )
    return "\n".join(lines)


def _fault_text(f: dict) -> str:
    parts = [f"{f['kind']} at {f['at_s']:.0f}s: {f['in_flight_at_fault']} in flight, stall {f['stall_s']:.1f}s"]
    if f.get("recovery_s") is not None:
        parts.append(f"recovered {f['recovery_s']:.1f}s")
    for key in (
        "port_closed_s",
        "worker_back_s",
        "duplicate_finishes",
        "aborted",
        "all_aborted_s",
        "read_s",
        "complete_and_equal",
        "error",
    ):
        if key in f:
            parts.append(f"{key} {f[key]}")
    return ", ".join(parts)


def brief(report: dict) -> dict:
    """A small dict for logs and test failure messages."""
    return {
        k: report[k]
        for k in (
            "scenario",
            "requests",
            "clean_errors",
            "lost_details",
            "corrupt_details",
            "faults",
            "workers",
            "gateway",
            "checks",
        )
    }
