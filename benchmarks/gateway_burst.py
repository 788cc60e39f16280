"""A burst of streaming requests through the gateway tier, on any machine: what admission costs per request and
how the burst reaches the worker.

The interactive TTFT through the stack depends on how fast a burst of requests passes the gateway processes
and Redis (docs/deploy.md, "Where the added TTFT goes"). This measures that part alone, without a GPU: a
private redis-server, one worker whose engine is the test suite's deterministic stand-in
(``tests.support.fake_engine``, fixed-time steps, one token per request per step) writing a step trace, and
the gateway tier under test (``--gateway-processes``). Client processes (``kernellab.bench.stream_clients``)
write ``--clients`` streaming /v1/completions requests (token-id prompts, ``ignore_eos``) at one instant, for
``--rounds`` rounds (the first is a warm-up and not counted).

Per phase (gateway process count × ``--variants``, phases interleaved round by round):
- the gateway tier's CPU per request, from the burst's start to its last byte (``/proc/<pid>/task/*/schedstat``
  of the supervisor and its children: nanoseconds, not clock ticks; the connections' warm-up is outside it),
- when the worker's I/O thread read the burst's requests (first, median, last; ms after the burst's start),
- the TTFT and its parts (``kernellab.bench.timeline``: to the worker, queued, step, delivery), split further with
  the gateway's request trace (``KERNELLAB_GATEWAY_TRACE``): HTTP in, admission, the submit pipeline's wait, Redis
  to the worker; the step's end to the gateway's router, and the router to the client.

Variants: ``base`` (the configuration as shipped), ``slowpath`` (generation routes through FastAPI's
middleware and router, ``KERNELLAB_GATEWAY_FAST_PATH=0``), ``slice16`` / ``slice8`` (the worker's fenced output
writes cut into slices of that many messages, first tokens first, ``KERNELLAB_OUTPUT_WRITE_SLICE``).

    python benchmarks/gateway_burst.py --output results/gateway_burst_cpu.json
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kernellab.bench.stream_clients import completion_request, run_clients
from kernellab.bench.timeline import GATEWAY_SPLIT, read_gateway_trace, read_trace, timeline
from kernellab.services.processes import Processes, free_port, wait_ready

SCHEMA = "kernellab.bench.gateway_burst/v1"
ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m"  # the gateway's tokenizer (detokenizes every token); the engine is the stand-in
API_KEY = "sk-burst"
VARIANTS = {
    "base": {},
    "slowpath": {"KERNELLAB_GATEWAY_FAST_PATH": "0"},
    # the worker's fenced output writes in slices of 16 messages, first tokens first (one write per step: base)
    "slice16": {"KERNELLAB_OUTPUT_WRITE_SLICE": "16"},
    "slice8": {"KERNELLAB_OUTPUT_WRITE_SLICE": "8"},
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def tree_cpu_ns(pid: int) -> int:
    """CPU time (ns) of every thread of ``pid`` and of its descendants."""
    total, todo, seen = 0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/schedstat") as f:
                    total += int(f.read().split()[0])
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


class Tier:
    """redis-server, one stand-in worker with a step trace, and a gateway tier of ``processes``."""

    def __init__(self, workdir: Path, processes: int, env_extra: dict, step_s: float, max_model_len: int):
        self.workdir = workdir
        self.procs = Processes(workdir / "logs")
        self.trace = workdir / "trace.jsonl"
        self.gateway_trace = workdir / "gateway_trace.jsonl"
        self.port = free_port()
        url = self.procs.start_redis(free_port(), shutil.which("redis-server") or "redis-server")
        env = dict(
            os.environ,
            PYTHONUNBUFFERED="1",
            PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            KERNELLAB_REDIS_URL=url,
            KERNELLAB_MODEL=MODEL,
            KERNELLAB_API_KEYS=API_KEY,
            KERNELLAB_METRICS_HOST="127.0.0.1",
            KERNELLAB_MAX_WAITING="100000",
        )
        worker_env = dict(
            env,
            KERNELLAB_ENGINE="tests.support.fake_engine:FakeEngine",
            FAKE_STEP_S=str(step_s),
            FAKE_MAX_MODEL_LEN=str(max_model_len),
            KERNELLAB_STEP_TRACE=str(self.trace),
            **env_extra,  # a variant's settings reach whichever side reads them
        )
        kl = [sys.executable, "-m", "kernellab"]
        self.procs.spawn("worker", [*kl, "worker", "--metrics-port", str(free_port())], worker_env, cwd=ROOT)
        gateway_env = dict(
            env,
            KERNELLAB_GATEWAY_PROCESSES=str(processes),
            KERNELLAB_GATEWAY_TRACE=str(self.gateway_trace),
            **env_extra,
        )
        self.gateway = self.procs.spawn(
            "gateway", [*kl, "gateway", "--port", str(self.port), "--metrics-port", "0"], gateway_env, cwd=ROOT
        )
        wait_ready(
            f"http://127.0.0.1:{self.port}",
            1,
            timeout=300,
            watch=self.procs.procs,
            headers={"Authorization": f"Bearer {API_KEY}"},
        )

    def stop(self) -> None:
        self.procs.stop_all(("gateway", "worker", "redis"), 20)


def burst(tier: Tier, round_id: int, args) -> dict:
    """One burst; its figures."""
    raws = [
        completion_request(
            "127.0.0.1",
            tier.port,
            MODEL,
            # A token unique to the round and request first, so no prompt repeats another.
            [1000 + round_id * args.clients + i] + [(i * 31 + k) % 40000 + 100 for k in range(args.prompt_tokens - 1)],
            args.max_tokens,
            API_KEY,
        )
        for i in range(args.clients)
    ]
    cpu: dict[str, int] = {}
    out = run_clients(
        "127.0.0.1",
        tier.port,
        raws,
        args.client_processes,
        timeout_s=300,
        on_start=lambda: cpu.setdefault("start", tree_cpu_ns(tier.gateway.pid)),
    )
    time.sleep(0.3)  # the last events' bookkeeping; the worker writes its trace when it goes idle
    cpu_ns = tree_cpu_ns(tier.gateway.pid) - cpu["start"]
    t0, recs = out["t0"], out["records"]
    bad = [r.index for r in recs if r.error or r.completion_tokens != args.max_tokens]
    steps, adds, received = read_trace(tier.trace, t0 - 0.5)
    joined = [{"sent": r.sent, "first": r.first, "rid": f"{r.response_id}:0"} for r in recs]
    gateway = read_gateway_trace(tier.gateway_trace, t0 - 0.5)
    tl = timeline(steps, adds, joined, t0, received=received, gateway=gateway)
    ttft = [(r.first - r.sent) * 1e3 for r in recs if r.first is not None]
    return {
        "round": round_id,
        "gateway_cpu_ms_per_request": round(cpu_ns / 1e6 / len(recs), 4),
        "ttft_p50_ms": round(statistics.median(ttft), 3) if ttft else None,
        "received_ms": tl["arrivals"]["received_ms"],
        "parts_median_ms": tl["median_ms"],
        "bad": len(bad),
        "max_client_cpu_util": out["max_client_cpu_util"],
    }


def summarize(rounds: list[dict]) -> dict:
    counted = rounds[1:] or rounds  # the first round warms the tier

    def med(values):
        values = [v for v in values if v is not None]
        return round(statistics.median(values), 3) if values else None

    return {
        "rounds_counted": len(counted),
        "gateway_cpu_ms_per_request": med([r["gateway_cpu_ms_per_request"] for r in counted]),
        "received_first_ms": med([r["received_ms"][0] for r in counted if r["received_ms"]]),
        "received_p50_ms": med([r["received_ms"][1] for r in counted if r["received_ms"]]),
        "received_last_ms": med([r["received_ms"][2] for r in counted if r["received_ms"]]),
        "ttft_p50_ms": med([r["ttft_p50_ms"] for r in counted]),
        "delivery_ms": med([r["parts_median_ms"]["delivery"] for r in counted]),
        "gateway_parts_ms": {k: med([r["parts_median_ms"].get(k) for r in counted]) for k in GATEWAY_SPLIT},
        "bad": sum(r["bad"] for r in rounds),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gateway-processes", default="1,2", help="comma-separated tier sizes")
    ap.add_argument("--variants", default="base,slowpath", help=f"comma-separated, of {sorted(VARIANTS)}")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=6, help="bursts per phase; the first is not counted")
    ap.add_argument("--client-processes", type=int, default=1)
    ap.add_argument("--step-s", type=float, default=0.005, help="the stand-in engine's step time")
    ap.add_argument("--output", default="results/gateway_burst_cpu.json")
    args = ap.parse_args()
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {sorted(VARIANTS)}")
    phases = [(int(g), v) for g in args.gateway_processes.split(",") for v in variants]
    started = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="gateway-burst-"))
    runs: dict[str, list[dict]] = {f"g{g}-{v}": [] for g, v in phases}
    tiers: dict[str, Tier] = {}
    try:
        for g, v in phases:
            name = f"g{g}-{v}"
            t = time.perf_counter()
            tiers[name] = Tier(workdir / name, g, VARIANTS[v], args.step_s, args.prompt_tokens + args.max_tokens + 8)
            log(f"{name}: ready in {time.perf_counter() - t:.1f}s")
        for round_id in range(args.rounds):  # phases interleaved, so drift on the machine hits all alike
            for name, tier in tiers.items():
                r = burst(tier, round_id, args)
                runs[name].append(r)
                log(
                    f"{name} round {round_id}: gateway CPU {r['gateway_cpu_ms_per_request']:.3f} ms/request, "
                    f"received {r['received_ms']} ms, TTFT p50 {r['ttft_p50_ms']} ms, bad {r['bad']}"
                )
    finally:
        for tier in tiers.values():
            tier.stop()
    from kernellab.results import provenance, write

    summary = {name: summarize(rs) for name, rs in runs.items()}
    artifact = {
        "schema": SCHEMA,
        "provenance": provenance("cpu"),
        "workload": {
            "clients": args.clients,
            "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens,
            "rounds": args.rounds,
            "client_processes": args.client_processes,
            "engine": f"tests.support.fake_engine (steps of {args.step_s * 1e3:g} ms)",
            "model_tokenizer": MODEL,
        },
        "phases": [{"name": f"g{g}-{v}", "gateway_processes": g, "variant": v} for g, v in phases],
        "summary": summary,
        "runs": runs,
        "seconds": round(time.perf_counter() - started, 1),
    }
    path = write(args.output, artifact)
    print(f"\n{'phase':<16} {'CPU ms/req':>10} {'recv first':>10} {'recv p50':>9} {'recv last':>9} {'TTFT p50':>9} bad")
    for name, s in summary.items():
        print(
            f"{name:<16} {s['gateway_cpu_ms_per_request']:>10} {s['received_first_ms']:>10} "
            f"{s['received_p50_ms']:>9} {s['received_last_ms']:>9} {s['ttft_p50_ms']:>9} {s['bad']}"
        )
    print(f"\nmedian parts, ms: {', '.join(GATEWAY_SPLIT)}")
    for name, s in summary.items():
        print(f"{name:<16} " + " ".join(f"{s['gateway_parts_ms'][k]}" for k in GATEWAY_SPLIT))
    print(f"wrote {path}")
    return 1 if any(s["bad"] for s in summary.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
