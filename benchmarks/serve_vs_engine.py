"""Serving overhead: the same prompts through the whole stack (HTTP/SSE → gateway → Redis → worker → Redis →
gateway) against the engine driven directly in one process, on the same machine.

Workload: ``--clients`` chat prompts (distinct topics, the model's chat template), greedy, ``--max-tokens``
tokens each with EOS ignored, so both sides generate exactly the same tokens.
- engine: a child process holds ``LLMEngine`` with the worker's configuration; a run submits every request
  at t0 (chat template + tokenize + ``add_request``: text in, as the gateway gets it) and steps until all
  finish. TTFT = first token − the request's submission; throughput = tokens / wall time.
- stack: a private redis-server, one ``kernellab worker`` and one ``kernellab gateway`` (real processes, the
  same engine configuration); ``--clients`` SSE clients on fresh, warmed keep-alive connections write their
  requests at t0. TTFT = first content chunk − the moment the request's bytes were written; tokens from
  ``usage``.
Runs come in pairs (engine and stack, alternating which goes first), so drift on the machine hits both sides
of a pair alike; the figures are medians over pairs of the per-pair ratio and difference. The machine may be
shared: each run records the CPU other processes used, and only pairs where both runs saw less than 0.1 core
of it count, until ``--pairs`` clean pairs or ``--max-pairs`` in all. ``--single`` lone requests per side
(alternating) give the TTFT overhead of the path itself. Writes a JSON artifact with provenance.

    python benchmarks/serve_vs_engine.py --output results/serve_vs_engine.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

from kernellab.bench.stream_clients import RequestRecord, SSEConnection, post_request
from kernellab.services.processes import Processes, ProcessExited, free_port, wait_ready

TOPICS = [
    "the sea",
    "volcanoes",
    "bees",
    "the moon",
    "bread",
    "trains",
    "chess",
    "rivers",
    "owls",
    "glass",
    "deserts",
    "music",
    "coffee",
    "maps",
    "bridges",
    "rain",
    "paper",
    "clocks",
    "whales",
    "salt",
    "kites",
    "tea",
    "forests",
    "copper",
    "snow",
    "bicycles",
    "honey",
    "lighthouses",
    "cotton",
    "ants",
    "ice",
    "wind",
    "mountains",
    "gardens",
    "libraries",
    "stars",
]
SERVE_CONFIG = {"device": "cpu", "dtype": "auto", "max_num_seqs": 64, "max_num_batched_tokens": 2048}
QUIET_CORES = 0.1  # a run during which other processes used more CPU than this (in cores) is disturbed


def chats(n: int, run: int) -> list[list[dict]]:
    """The prompts of one run. ``run`` makes every run's prompts new past the system prompt, so neither side
    answers from its prefix cache what an earlier run computed."""
    return [
        [{"role": "user", "content": f"[run {run}] Tell me a few facts about {TOPICS[i % len(TOPICS)]}."}]
        for i in range(n)
    ]


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


class CpuMeter:
    """CPU seconds the whole machine was busy vs. what our own processes used: the rest is interference."""

    def __init__(self, pids: list[int]):
        import psutil

        self.procs = [psutil.Process(p) for p in pids]
        self._psutil = psutil

    def _sample(self) -> tuple[float, float, float]:
        t = self._psutil.cpu_times()
        own = sum(sum(p.cpu_times()[:2]) for p in self.procs)
        return t.user + t.nice + t.system + t.irq + t.softirq, own, getattr(t, "steal", 0.0)

    def __enter__(self) -> CpuMeter:
        self.start, self.t0 = self._sample(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        end, wall = self._sample(), time.perf_counter() - self.t0
        busy, own, steal = (e - s for e, s in zip(end, self.start, strict=True))
        foreign = max(0.0, busy - own)
        self.result = {
            "busy_cpu_s": busy,
            "own_cpu_s": own,
            "foreign_cpu_s": foreign,
            "steal_s": steal,
            "foreign_cores": foreign / wall,
        }


# --------------------------------------------------------------------------------------------- engine side
def engine_server(model: str, clients: int, max_tokens: int) -> None:
    """Child process: one engine; runs on request (JSON lines on stdin), results as JSON lines on stdout."""
    from kernellab.results import provenance
    from kernellab.runtime.engine import EngineConfig, LLMEngine
    from kernellab.runtime.request.sampling import SamplingParams

    engine = LLMEngine(EngineConfig(model=model, **SERVE_CONFIG))
    counter = iter(range(1 << 30))

    def run(batch: list[list[dict]], tokens: int) -> dict:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        tag = f"r{next(counter)}"
        t0 = time.perf_counter()
        first: dict[str, float] = {}
        submitted: dict[str, float] = {}
        for i, messages in enumerate(batch):  # text in: template and tokenization are timed, as in the stack
            submitted[f"{tag}-{i}"] = time.perf_counter()
            engine.add_request(f"{tag}-{i}", engine.tokenizer.apply_chat_template(messages), params)
        n = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.new_token_ids:
                    n += len(out.new_token_ids)
                    first.setdefault(out.request_id, time.perf_counter() - submitted[out.request_id])
        return {
            "ttft_s": [first[f"{tag}-{i}"] for i in range(len(batch))],
            "tokens": n,
            "wall_s": time.perf_counter() - t0,
        }

    run(chats(clients, -1), 4)  # warm-up, as the stack gets one
    print(json.dumps({"ready": True, "provenance": provenance("cpu")}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "concurrent":
            out = run(chats(clients, cmd["run"]), max_tokens)
        elif cmd["op"] == "single":
            out = run(chats(1, cmd["run"]), 2)
        else:
            break
        print(json.dumps(out), flush=True)


class EngineChild:
    def __init__(self, args):
        cmd = [
            sys.executable,
            __file__,
            "--engine-server",
            "--model",
            args.model,
            "--clients",
            str(args.clients),
            "--max-tokens",
            str(args.max_tokens),
        ]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.provenance = self._read()["provenance"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the engine process died")
        return json.loads(line)

    def call(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(30)


# --------------------------------------------------------------------------------------------- stack side
class Stack:
    def __init__(self, model: str, workdir: Path):
        self.redis_port, self.port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.workdir = workdir
        self.env = dict(
            os.environ,
            PYTHONUNBUFFERED="1",
            KERNELLAB_MODEL=model,
            KERNELLAB_API_KEYS="",
            KERNELLAB_REDIS_URL=f"redis://127.0.0.1:{self.redis_port}/0",
            KERNELLAB_KEY_PREFIX="klbench:",
            KERNELLAB_DEVICE=SERVE_CONFIG["device"],
            KERNELLAB_DTYPE=SERVE_CONFIG["dtype"],
            KERNELLAB_MAX_NUM_SEQS=str(SERVE_CONFIG["max_num_seqs"]),
            KERNELLAB_MAX_NUM_BATCHED_TOKENS=str(SERVE_CONFIG["max_num_batched_tokens"]),
            KERNELLAB_MAX_WAITING="1024",
            KERNELLAB_NICE="10",
        )  # as `kernellab up` runs a CPU worker
        self.processes = Processes(workdir)

    def start(self) -> None:
        self.processes.start_redis(self.redis_port, env=self.env)
        kl = [sys.executable, "-m", "kernellab"]
        self.processes.spawn("worker", [*kl, "worker", "--metrics-port", str(free_port())], self.env)
        gateway = [*kl, "gateway", "--port", str(self.port), "--metrics-port", str(free_port())]
        self.processes.spawn("gateway", gateway, self.env)
        try:
            wait_ready(self.url, timeout=600, watch=self.processes.procs)
        except (ProcessExited, TimeoutError) as e:
            raise RuntimeError(f"{e}; logs in {self.workdir}") from None

    def stop(self) -> None:
        self.processes.stop_all(("gateway", "worker", "redis"), 30)


def chat_request(host: str, port: int, messages, max_tokens: int) -> bytes:
    return post_request(
        host,
        port,
        "/v1/chat/completions",
        {
            "model": "smollm2-135m",
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )


async def stream(conn: SSEConnection, raw: bytes) -> tuple[float, float | None, int]:
    """(send time, TTFT from it, completion tokens) of one request on an open connection."""
    rec = RequestRecord(0)
    await conn.stream(raw, rec)
    if rec.error is not None:
        raise RuntimeError(rec.error)
    return rec.sent, None if rec.first is None else rec.first - rec.sent, rec.completion_tokens


class StackClient:
    def __init__(self, url: str, clients: int, max_tokens: int):
        host, port = url.removeprefix("http://").split(":")
        self.host, self.port, self.clients, self.max_tokens = host, int(port), clients, max_tokens
        self.conns: list[SSEConnection] = []

    async def fresh(self, n: int) -> None:
        """New connections, warmed with a GET (uvicorn drops keep-alive connections idle for 5 s)."""
        for c in self.conns:
            c.close()
        self.conns = [await SSEConnection(self.host, self.port).open() for _ in range(n)]
        await asyncio.gather(*(c.warm() for c in self.conns))

    async def concurrent(self, run: int) -> dict:
        raws = [chat_request(self.host, self.port, m, self.max_tokens) for m in chats(self.clients, run)]
        await self.fresh(self.clients)
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(stream(c, r) for c, r in zip(self.conns, raws, strict=True)))
        return {
            "ttft_s": [o[1] for o in outs],
            "tokens": sum(o[2] for o in outs),
            "wall_s": time.perf_counter() - t0,
            "send_spread_s": max(o[0] for o in outs) - t0,
        }

    async def single(self, run: int) -> dict:
        raw = chat_request(self.host, self.port, chats(1, run)[0], 2)
        await self.fresh(1)
        _sent, ttft, _n = await stream(self.conns[0], raw)
        return {"ttft_s": [ttft]}


# --------------------------------------------------------------------------------------------- driver
async def measure(args, engine: EngineChild, stack: Stack) -> dict:
    pids = [os.getpid(), engine.proc.pid, *(p.pid for p in stack.processes.procs.values())]
    client = StackClient(stack.url, args.clients, args.max_tokens)
    await client.concurrent(-1)  # warm-up of the stack side (the engine child warmed itself)

    async def timed(side: str, op: str, run: int) -> dict:
        """Both sides of a pair get the same prompts (``run``), new to both prefix caches."""
        with CpuMeter(pids) as cpu:
            if side == "engine":
                out = engine.call(op=op, run=run)
            else:
                out = await (client.concurrent(run) if op == "concurrent" else client.single(run))
        return {**out, "cpu": cpu.result}

    pairs = []
    while len(pairs) < args.max_pairs and sum(p["clean"] for p in pairs) < args.pairs:
        order = ("engine", "stack") if len(pairs) % 2 == 0 else ("stack", "engine")
        pair = {side: await timed(side, "concurrent", len(pairs)) for side in order}
        pair["clean"] = all(pair[s]["cpu"]["foreign_cores"] < QUIET_CORES for s in order)
        pairs.append(pair)
        print(
            f"pair {len(pairs)}: engine {tput(pair['engine']):.1f} tok/s, stack {tput(pair['stack']):.1f} tok/s"
            f"{'' if pair['clean'] else '  (disturbed: other processes were busy)'}",
            file=sys.stderr,
        )
    singles = {"engine": [], "stack": []}
    for i in range(args.single):
        for side in ("engine", "stack") if i % 2 == 0 else ("stack", "engine"):
            singles[side].append(await timed(side, "single", 1000 + i))
    return {"pairs": pairs, "singles": singles}


def tput(run: dict) -> float:
    return run["tokens"] / run["wall_s"]


def figures(m: dict) -> dict:
    clean = [p for p in m["pairs"] if p["clean"]]
    use = clean or m["pairs"]
    p50 = {s: [pct(p[s]["ttft_s"], 50) * 1e3 for p in use] for s in ("engine", "stack")}
    single = {
        s: [r["ttft_s"][0] * 1e3 for r in m["singles"][s] if r["cpu"]["foreign_cores"] < QUIET_CORES]
        or [r["ttft_s"][0] * 1e3 for r in m["singles"][s]]
        for s in ("engine", "stack")
    }
    return {
        "pairs_used": len(use),
        "pairs_run": len(m["pairs"]),
        "only_disturbed_pairs": not clean,
        "engine_throughput_tok_s": statistics.median(tput(p["engine"]) for p in use),
        "stack_throughput_tok_s": statistics.median(tput(p["stack"]) for p in use),
        "throughput_ratio": statistics.median(tput(p["stack"]) / tput(p["engine"]) for p in use),
        "engine_ttft_p50_ms": statistics.median(p50["engine"]),
        "stack_ttft_p50_ms": statistics.median(p50["stack"]),
        "added_ttft_p50_ms": statistics.median(s - e for s, e in zip(p50["stack"], p50["engine"], strict=True)),
        "engine_single_ttft_p50_ms": pct(single["engine"], 50),
        "stack_single_ttft_p50_ms": pct(single["stack"], 50),
        "added_single_ttft_p50_ms": pct(single["stack"], 50) - pct(single["engine"], 50),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--pairs", type=int, default=5, help="clean (undisturbed) pairs to collect")
    ap.add_argument("--max-pairs", type=int, default=20, help="give up after this many pairs in all")
    ap.add_argument("--single", type=int, default=10, help="lone requests per side")
    ap.add_argument("--output", default="results/serve_vs_engine.json")
    ap.add_argument("--engine-server", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine_server:
        engine_server(args.model, args.clients, args.max_tokens)
        return
    engine = EngineChild(args)
    stack = Stack(args.model, Path(tempfile.mkdtemp(prefix="serve-bench-")))
    try:
        stack.start()
        m = asyncio.run(measure(args, engine, stack))
    finally:
        stack.stop()
        engine.stop()
    f = figures(m)
    prov = engine.provenance
    prov["redis_server"] = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.strip()
    for dist in ("redis", "fastapi", "uvicorn", "starlette", "msgpack", "tokenizers"):
        prov[dist] = metadata.version(dist)
    artifact = {
        "schema": "kernellab.bench.serve_vs_engine/v1",
        "provenance": prov,
        "model": args.model,
        "workload": {
            "clients": args.clients,
            "max_tokens": args.max_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "prompts": "chat template + '[run <k>] Tell me a few facts about <topic>.' (new to the prefix "
            "cache in every run; the same on both sides of a pair)",
            "single_requests": args.single,
            "stack": "1 worker, 1 gateway, private redis-server, raw-socket SSE clients, all on this machine",
            "engine_config": SERVE_CONFIG,
            "quiet_cores": QUIET_CORES,
        },
        "figures": f,
        "targets": {"throughput_ratio_min": 0.90, "added_ttft_p50_ms_max": 5.0},
        "pairs": m["pairs"],
        "singles": m["singles"],
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(artifact, indent=2) + "\n")
    print(f"{'':28}{'engine':>10}{'stack':>10}")
    print(
        f"{'throughput tok/s':28}{f['engine_throughput_tok_s']:10.1f}{f['stack_throughput_tok_s']:10.1f}"
        f"   ratio {f['throughput_ratio']:.3f}"
    )
    label = f"TTFT p50 ms ({args.clients} clients)"
    print(
        f"{label:28}{f['engine_ttft_p50_ms']:10.1f}{f['stack_ttft_p50_ms']:10.1f}   added {f['added_ttft_p50_ms']:+.1f}"
    )
    print(
        f"{'TTFT p50 ms (lone request)':28}{f['engine_single_ttft_p50_ms']:10.1f}"
        f"{f['stack_single_ttft_p50_ms']:10.1f}   added {f['added_single_ttft_p50_ms']:+.1f}"
    )
    print(
        f"{f['pairs_used']} of {f['pairs_run']} pairs used"
        + ("  WARNING: every pair was disturbed by other processes" if f["only_disturbed_pairs"] else "")
    )
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
