"""Summaries of a load run: throughput, latency percentiles, goodput under SLOs, failures.

Shared by ``kernellab.bench.serve`` and the Locust file so that both report the same numbers the same way.
Definitions (as in vLLM's serving benchmark):

- TTFT: request sent → first chunk with text.
- ITL: gap between consecutive text chunks (one token each when the server streams token by token).
- TPOT: (E2E − TTFT) / (output tokens − 1), output tokens from ``usage``; requests with one token have none.
- E2E: request sent → end of the stream.
- Goodput: completed requests per second that met every given SLO (TTFT, TPOT, E2E).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    ok: bool
    error: str | None = None
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    e2e: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.completion_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.completion_tokens - 1)


@dataclass(frozen=True)
class SLO:
    """Service-level objectives in milliseconds; None: not part of the goal."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def met_by(self, record: RequestRecord) -> bool:
        if not record.ok:
            return False
        for bound, value in (
            (self.ttft_ms, record.ttft),
            (self.tpot_ms, record.tpot),
            (self.e2e_ms, record.e2e),
        ):
            if bound is not None and value is not None and value * 1000.0 > bound:
                return False
        return True


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), on already sorted values."""
    if not sorted_values:
        raise ValueError("no values")
    rank = (len(sorted_values) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low)


def distribution(values: Iterable[float]) -> dict:
    """count, mean, min, max and p50/p90/p99 in seconds; only count when there are no values."""
    data = sorted(values)
    if not data:
        return {"count": 0}
    out = {"count": len(data), "mean": sum(data) / len(data), "min": data[0], "max": data[-1]}
    out.update({f"p{q}": percentile(data, q) for q in PERCENTILES})
    return out


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: SLO = SLO()) -> dict:
    completed = [r for r in records if r.ok]
    failures = Counter(r.error or "unknown error" for r in records if not r.ok)
    output_tokens = sum(r.completion_tokens for r in completed)
    prompt_tokens = sum(r.prompt_tokens for r in completed)
    good = sum(1 for r in completed if slo.met_by(r))
    duration = max(duration_s, 1e-9)
    return {
        "duration_s": duration_s,
        "requests": {
            "total": len(records),
            "completed": len(completed),
            "failed": len(records) - len(completed),
            "failures": dict(failures.most_common(10)),
        },
        "request_throughput_rps": len(completed) / duration,
        "output_token_throughput_tps": output_tokens / duration,
        "total_token_throughput_tps": (output_tokens + prompt_tokens) / duration,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "ttft_s": distribution(r.ttft for r in completed if r.ttft is not None),
        "itl_s": distribution(gap for r in completed for gap in r.itls),
        "tpot_s": distribution(r.tpot for r in completed if r.tpot is not None),
        "e2e_s": distribution(r.e2e for r in completed if r.e2e is not None),
        "goodput": {
            "slo_ms": asdict(slo),
            "requests_meeting_slo": good,
            "fraction": good / len(records) if records else 0.0,
            "goodput_rps": good / duration,
        },
    }


def format_table(summary: dict) -> str:
    """A short plain-text table of a summary, for terminals and logs."""
    req = summary["requests"]
    lines = [
        f"requests  {req['completed']}/{req['total']} completed, {req['failed']} failed, {summary['duration_s']:.1f} s",
        f"throughput  {summary['request_throughput_rps']:.2f} req/s, "
        f"{summary['output_token_throughput_tps']:.1f} output tok/s, "
        f"goodput {summary['goodput']['goodput_rps']:.2f} req/s",
        f"{'ms':<6}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for name in ("ttft", "itl", "tpot", "e2e"):
        dist = summary[f"{name}_s"]
        if dist["count"]:
            lines.append(f"{name:<6}" + "".join(f"{dist[f'p{q}'] * 1000:>10.1f}" for q in PERCENTILES))
        else:
            lines.append(f"{name:<6}{'-':>10}{'-':>10}{'-':>10}")
    for error, count in req["failures"].items():
        lines.append(f"failure x{count}: {error}")
    return "\n".join(lines)
