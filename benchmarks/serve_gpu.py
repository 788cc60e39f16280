"""Serving at engine speed: the whole stack (client processes → gateway tier → Redis → worker(s) on the GPU →
SSE) against the in-process engine, on the same workloads, in one run.

Phases, in this order (each a set of real processes on this machine, torn down after it):
1. ``engine``: a child process holds ``LLMEngine`` with the workers' configuration; each workload's requests are
   all added at t0 (token ids in, as the stack gets them) and stepped to the end. It stays up beside the stack
   (both on GPU 0, fixed KV pools): every stack run is paired with an engine run on the same prompts, in
   alternating order, and the stack-vs-engine figures are medians over those pairs.
2. ``stack-<phase>``, for each phase of ``--phases``: a private redis-server, one ``kernellab worker`` on GPU 0
   and ``kernellab gateway`` with N processes (``g<N>``); suffixes set worker (``VARIANTS``) or gateway
   (``GATEWAY_VARIANTS``) settings, e.g.
   ``-nogather`` runs the worker without the burst gather (the behaviour before it), so the artifact holds the
   before and after of each change. The worker restarts only when its settings change; the gateway tier every phase.
3. ``stack-2gpu-<phase>`` (``--gpus 2``): with the last phase's settings, a second worker on GPU 1 joins the
   same consumer group, and the nano-vllm workload runs at twice the requests (each worker again holds a full
   batch): scale-out. The last phase must then be the product's (``g<N>`` alone).

The product's figures (``figures.product_phase``) are those of the last phase that runs the defaults, ``g<N>``
without a suffix: a phase with a suffix is the before or the alternative of a change, wherever it stands in the
order (the last phase where none runs the defaults). ``--refigure ARTIFACT`` recomputes an artifact's figures
from its runs with this script's rule.

Workloads: ``nanovllm`` (nano-vllm's benchmark: 256 prompts of 100–1,024 random token ids, outputs of 100–1,024
tokens, seed 0) and ``interactive`` (64 clients, 512 → 128 tokens), greedy with ``ignore_eos`` so every request
must return exactly ``max_tokens`` tokens: the artifact counts any request that did not (lost, cut or
duplicated tokens). Each run's prompts start with a token unique to the run, so no run answers from a prefix
cache what an earlier one computed; both sides get the same prompts.

Clients: ``kernellab.bench.stream_clients`` (several processes, raw keep-alive sockets, all requests written at
one instant); each process reports its CPU use, and a client process above 90 % of a core marks the run.

The model: a checkpoint folder written by ``kernellab.bench.synthetic`` (random bf16 weights of the exact
Qwen3-0.6B shape and a byte-level BPE tokenizer of Qwen3's vocabulary size), loaded by the engine, the worker
and the gateway as any local checkpoint. ``--profile ci`` runs the same path on a CPU with a tiny model (CI).

    bash benchmarks/gpu/serve_h200.sh "$OUT" --gpus 2     # on the GPU machine (scripts/gpu-carry.sh first)
    python benchmarks/serve_gpu.py --profile ci --output /tmp/serve_ci.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kernellab.services.config import parse_cpu_list
from kernellab.services.processes import (
    Processes,
    ProcessExited,
    free_port,
    stop_process,
    stop_processes,
    wait_ready,
)

SCHEMA = "kernellab.bench.serve_gpu/v1"
PROFILES = {
    "h200": {
        "shape": "qwen3-0.6b",
        "device": "cuda",
        "dtype": "bfloat16",
        "max_num_seqs": 256,
        "max_num_batched_tokens": 16384,
        "num_kv_blocks": 20480,
        "max_model_len": 4096,
        "nanovllm": {"num_seqs": 256, "min_len": 100, "max_len": 1024},
        "interactive": {"clients": 64, "prompt_tokens": 512, "output_tokens": 128},
        "phases": ["g1-nogather", "g16-nogather", "g16"],
        "client_processes": 4,
        "run_timeout_s": 240,
    },
    "ci": {
        "shape": "tiny-qwen3",
        "device": "cpu",
        "dtype": "float32",
        "max_num_seqs": 16,
        "max_num_batched_tokens": 512,
        "num_kv_blocks": 256,
        "max_model_len": 512,
        "nanovllm": {"num_seqs": 12, "min_len": 8, "max_len": 40},
        "interactive": {"clients": 6, "prompt_tokens": 48, "output_tokens": 12},
        "phases": ["g1-nogather", "g2"],
        "client_processes": 2,
        "run_timeout_s": 240,
    },
}
# Phase suffixes: worker (VARIANTS) or gateway (GATEWAY_VARIANTS) settings for before/after comparisons.
VARIANTS = {
    "nogather": {"KERNELLAB_GATHER_BURST_GAP_S": "0"},  # no burst gather (before it existed)
    "noflush": {"KERNELLAB_FIRST_TOKEN_FLUSH_S": "0"},  # first tokens not awaited before the next step
    "flush": {"KERNELLAB_FIRST_TOKEN_FLUSH_S": "0.005"},
    # the gather's target as it was before gather_tokens: the whole first step budget (capped to it)
    "fullgather": {"KERNELLAB_GATHER_TOKENS": str(1 << 30)},
    # requests prepared by the step loop as it takes them in, not by the I/O thread during the step
    "loopprep": {"KERNELLAB_PREPARE_IN_READER": "0"},
    # steps that prefill run eagerly instead of replaying the piecewise CUDA graphs (the behaviour before them)
    "nopiecewise": {"KERNELLAB_PIECEWISE_GRAPHS": "0"},
    # steps of several fresh prompts through the piecewise graphs, not one whole-step graph (before them)
    "nofreshgraphs": {"KERNELLAB_FRESH_PROMPT_GRAPHS": "0"},
    # every decode window read before the next is launched (the behaviour before asynchronous scheduling)
    "sync": {"KERNELLAB_ASYNC_SCHEDULING": "0"},
    # the gather ends at its quiet gap even while the request reader is busy with a read (the behaviour before)
    "noreaderwait": {"KERNELLAB_GATHER_FOLLOWS_READER": "0"},
    # the request reader decodes and prepares only while the loop waits (runtime/host_gate.py; off by default)
    "gate": {"KERNELLAB_READER_YIELDS_TO_STEP": "1"},
    "nogate": {"KERNELLAB_READER_YIELDS_TO_STEP": "0"},
    # a 0.1 ms GIL switch interval in the worker instead of 0.5 ms
    "si100": {"KERNELLAB_SWITCH_INTERVAL_S": "0.0001"},
    # the worker and the gateway tier leave their startup objects in the garbage collector's generations (before
    # gc_freeze)
    "nogcfreeze": {"KERNELLAB_GC_FREEZE": "0"},
    # the worker collects and re-freezes its heap each time it goes idle (gc_idle_freeze), so a burst's collections
    # walk only what the burst allocates
    "idlefreeze": {"KERNELLAB_GC_IDLE_FREEZE": "1"},
    # diagnosis, not a setting to serve with: each young collection in the worker takes a census of what it walks,
    # and the step trace keeps those of collections of 0.3 ms or more (the phase's timeline ``gc_census``)
    "gcprobe": {"KERNELLAB_GC_PROBE_MS": "0.3"},
    # the plain RMSNorm (the first layer's input norm in steps that prefill) on torch, as before the gate at f611de0
    # accepted its kernel: the interactive mix's TTFT rose between 591b0ef and 56c1be2, in both scheduling modes
    "normtorch": {"KERNELLAB_DISABLED_KERNELS": "rms_norm"},
    # the worker's fenced output writes in slices of 16 messages, first tokens first (no gain on the CI box)
    "slice16": {"KERNELLAB_OUTPUT_WRITE_SLICE": "16"},
    # prefill steps' MLP as cuBLAS's gate/up GEMM + the SwiGLU kernel, not the GEMM with the SwiGLU epilogue
    # (gate_up_swiglu, accepted on 2026-12-06 from engine A/Bs): its effect on the stack's mixed steps
    "noswiglu": {"KERNELLAB_DISABLED_KERNELS": "gate_up_swiglu"},
}
GATEWAY_VARIANTS = {
    "slowpath": {"KERNELLAB_GATEWAY_FAST_PATH": "0"},  # generation routes through FastAPI
    "nogcfreeze": VARIANTS["nogcfreeze"],  # a variant in both sets applies to the worker and the gateway tier
}
# "-pin": the worker on two physical cores of its own (KERNELLAB_CPUS), the gateway tier and the load generator's
# client processes on the rest (split_cores), so a burst's HTTP and Redis work never shares a core with the step
# loop. Both settings are filled in per host at run time.
PINNED = "pin"


def split_cores(all_cpus: set[int]) -> tuple[str, str]:
    """(the worker's cpu list, the rest) of ``all_cpus`` (the benchmark's cores before any phase narrowed them):
    two physical cores with their hyperthread siblings (one on a host of four or fewer), the highest-numbered
    ones (clear of core 0's interrupts)."""
    cpus = sorted(all_cpus)
    siblings: dict[int, tuple[int, ...]] = {}
    for c in cpus:
        path = Path(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list")
        group = tuple(sorted(parse_cpu_list(path.read_text().strip()))) if path.exists() else (c,)
        siblings[c] = tuple(x for x in group if x in cpus) or (c,)
    physical = sorted(set(siblings.values()), key=lambda g: g[0])
    worker_cores = 2 if len(physical) > 4 else 1
    if len(physical) <= worker_cores:
        raise SystemExit(f"-{PINNED} needs more than {worker_cores} physical cores; this host has {len(physical)}")
    worker = {c for g in physical[-worker_cores:] for c in g}
    rest = set(cpus) - worker

    def fmt(s: set[int]) -> str:
        return ",".join(map(str, sorted(s)))

    return fmt(worker), fmt(rest)


# The share of one GPU's memory each KV pool may take: the engine child and the stack's worker share GPU 0, each
# with its own pool, beside two copies of the weights, their CUDA graphs and activations. The h200 profile's
# 20,480 blocks of Qwen3-0.6B (37.6 GB each) fit an H200 twice over; on an 80 GB card two such pools left the
# worker too little, so the pools shrink to fit and the artifact records both numbers.
KV_POOL_SHARE = 0.36


def fit_kv_blocks(requested: int, hf_config: dict, total_bytes: int, block_size: int = 16) -> int:
    """The KV blocks (bf16, ``block_size`` tokens) of one pool for the checkpoint's ``config.json``: ``requested``,
    or fewer where the card's memory (``total_bytes``) cannot hold two pools of it beside the rest
    (``KV_POOL_SHARE``)."""
    from kernellab.runtime.config import ModelConfig

    per_block = block_size * ModelConfig.from_hf(hf_config).kv_bytes_per_token(2)
    return max(1, min(requested, int(KV_POOL_SHARE * total_bytes) // per_block))


TARGETS = {"throughput_ratio_min": 0.90, "interactive_added_ttft_p50_ms_max": 5.0, "two_gpu_scaling_min": 1.85}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------ workloads
def workload(profile: dict, name: str, run_id: int, scale: int = 1) -> list[tuple[list[int], int]]:
    """(prompt token ids, max_tokens) per request; the first token is unique to ``run_id`` (no prefix hits)."""
    from kernellab.bench.workloads import nanovllm

    if name == "nanovllm":
        w = profile["nanovllm"]
        prompts, outs = nanovllm(w["num_seqs"] * scale, w["min_len"], w["max_len"])
    elif name == "interactive":
        w = profile["interactive"]
        rng = random.Random(1000 + scale)
        prompts = [[rng.randint(0, 10000) for _ in range(w["prompt_tokens"])] for _ in range(w["clients"] * scale)]
        outs = [w["output_tokens"]] * len(prompts)
    elif name == "warmup":
        prompts, outs = [[7, 8, 9, 10 + i] for i in range(8)], [4] * 8
    else:
        raise ValueError(name)
    marker = 20000 + run_id  # outside the prompts' id range 0..10000
    return [([marker, *p[1:]], n) for p, n in zip(prompts, outs, strict=True)]


# ------------------------------------------------------------------------------------------------ statistics
def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(records: list[dict], expected: list[int], t0: float) -> dict:
    """records: {sent, first, end, chunk_times, tokens, error} with perf_counter times."""
    ok = [r for r, n in zip(records, expected, strict=True) if r["error"] is None and r["tokens"] == n]
    bad = [
        {"index": i, "tokens": r["tokens"], "expected": n, "error": r["error"]}
        for i, (r, n) in enumerate(zip(records, expected, strict=True))
        if r["error"] is not None or r["tokens"] != n
    ]
    end = max((r["end"] for r in records if r["end"] is not None), default=t0)
    tokens = sum(r["tokens"] for r in records)
    ttft = [(r["first"] - r["sent"]) * 1e3 for r in ok if r["first"] is not None]
    tpot = [(r["end"] - r["first"]) * 1e3 / (r["tokens"] - 1) for r in ok if r["first"] and r["tokens"] > 1]
    itl = [(b - a) * 1e3 for r in ok for a, b in zip(r["chunk_times"], r["chunk_times"][1:], strict=False)]
    e2e = [(r["end"] - r["sent"]) * 1e3 for r in ok]

    def dist(v):
        return {f"p{q}": None if not v else round(pct(v, q), 3) for q in (0, 50, 90, 99)}

    return {
        "requests": len(records),
        "requests_ok": len(ok),
        "bad_requests": bad[:20],
        "num_bad": len(bad),
        "output_tokens": tokens,
        "expected_tokens": sum(expected),
        "wall_s": round(end - t0, 4),
        "throughput_tok_s": round(tokens / (end - t0), 1) if end > t0 else 0.0,
        "ttft_ms": dist(ttft),
        "tpot_ms": dist(tpot),
        "itl_chunk_ms": dist(itl),
        "e2e_ms": dist(e2e),
        "mean_tokens_per_chunk": round(tokens / max(1, sum(len(r["chunk_times"]) for r in ok)), 2),
    }


# ------------------------------------------------------------------------------------------------ engine side
def engine_child(cfg: dict) -> None:
    """Child process: one engine, runs on request (JSON lines on stdin), records as JSON lines on stdout."""
    from kernellab.bench.timeline import timeline
    from kernellab.results import provenance
    from kernellab.runtime.config import EngineConfig
    from kernellab.runtime.engine import LLMEngine
    from kernellab.runtime.request.sampling import SamplingParams

    t = time.perf_counter()
    engine = LLMEngine(EngineConfig(**cfg))
    startup = time.perf_counter() - t
    counter = iter(range(1 << 30))
    print(json.dumps({"ready": True, "startup_s": startup, "provenance": provenance(cfg["device"])}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] != "run":
            break
        tag = f"r{next(counter)}"
        recs = {}
        t0 = time.perf_counter()
        for i, (prompt, n) in enumerate(cmd["requests"]):
            rid = f"{tag}-{i}"
            recs[rid] = {
                "sent": time.perf_counter(),
                "first": None,
                "end": None,
                "chunk_times": [],
                "tokens": 0,
                "error": None,
            }
            engine.add_request(rid, prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        steps = []
        while engine.has_unfinished_requests():
            started = time.perf_counter()
            outs = engine.step()
            now = time.perf_counter()
            first = []
            for out in outs:
                r = recs[out.request_id]
                if out.new_token_ids:
                    r["tokens"] += len(out.new_token_ids)
                    if r["first"] is None:
                        first.append(out.request_id)
                    r["first"] = r["first"] or now
                    r["chunk_times"].append(now)
                if out.finished:
                    r["end"] = now
            rows, tokens = engine.last_schedule
            steps.append({"t": started, "dt": now - started, "rows": rows, "tokens": tokens, "first": first})
        records = [dict(recs[f"{tag}-{i}"], rid=f"{tag}-{i}") for i in range(len(cmd["requests"]))]
        adds = {r["rid"]: r["sent"] for r in records}  # in-process: taken in (and received) when sent
        tl = timeline(steps, adds, records, t0, received=adds)
        print(json.dumps({"t0": t0, "records": records, "timeline": tl}), flush=True)


class EngineChild:
    def __init__(self, cfg: dict, env: dict, cwd: str):
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--engine-child", json.dumps(cfg)],
            env=env,
            cwd=cwd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.hello = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the engine process died")
        return json.loads(line)

    def run(self, requests) -> dict:
        self.proc.stdin.write(json.dumps({"op": "run", "requests": requests}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


# ------------------------------------------------------------------------------------------------ stack side
class StackProcs:
    """A private redis-server, workers (one per GPU) and a gateway tier, as real processes on 127.0.0.1."""

    def __init__(self, args, profile: dict, model_dir: Path, workdir: Path):
        self.workdir, self.args = workdir, args
        self.redis_port, self.port = free_port(), free_port()
        self.host = "127.0.0.1"
        self.env = dict(
            os.environ,
            PYTHONUNBUFFERED="1",
            KERNELLAB_MODEL=str(model_dir),
            KERNELLAB_API_KEYS="",
            KERNELLAB_REDIS_URL=f"redis://127.0.0.1:{self.redis_port}/0",
            KERNELLAB_KEY_PREFIX="klbench:",
            KERNELLAB_DEVICE=profile["device"],
            KERNELLAB_DTYPE=profile["dtype"],
            KERNELLAB_MAX_NUM_SEQS=str(profile["max_num_seqs"]),
            KERNELLAB_MAX_NUM_BATCHED_TOKENS=str(profile["max_num_batched_tokens"]),
            KERNELLAB_MAX_MODEL_LEN=str(profile["max_model_len"]),
            KERNELLAB_MAX_WAITING="8192",
        )
        self.metrics_urls: dict[str, str] = {}
        self.traces: dict[int, Path] = {}  # GPU → the step trace of its current worker
        if profile["num_kv_blocks"]:
            self.env["KERNELLAB_NUM_KV_BLOCKS"] = str(profile["num_kv_blocks"])
        if profile["device"] == "cpu":
            self.env["KERNELLAB_NICE"] = "10"  # as `kernellab up` runs a CPU worker
        self.processes = Processes(workdir)
        self.redis = None
        self.workers: list[subprocess.Popen] = []
        self.gateway = None
        self.gateway_trace: Path | None = None  # the current tier's request trace

    def _spawn(self, name: str, cmd: list[str], env: dict) -> subprocess.Popen:
        return self.processes.spawn(name, cmd, env, cwd=self.workdir)

    def start_redis(self) -> None:
        self.processes.start_redis(self.redis_port, self.args.redis_server, self.env)
        self.redis = self.processes.procs["redis"]

    def start_worker(self, gpu: int, overrides: dict | None = None) -> None:
        port = free_port()
        self.metrics_urls[f"worker{gpu}"] = f"http://127.0.0.1:{port}/metrics"
        self.traces[gpu] = self.workdir / f"trace-w{gpu}-{time.monotonic_ns()}.jsonl"
        env = dict(
            self.env,
            KERNELLAB_WORKER_METRICS_PORT=str(port),
            KERNELLAB_WORKER_ID=f"bench-w{gpu}",
            KERNELLAB_STEP_TRACE=str(self.traces[gpu]),
            **(overrides or {}),
        )
        if self.env["KERNELLAB_DEVICE"] == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = str(gpu)
        self.workers.append(self._spawn(f"worker{gpu}", [sys.executable, "-m", "kernellab.services.worker"], env))

    def start_gateway(self, processes: int, overrides: dict | None = None) -> None:
        port = free_port()
        self.metrics_urls["gateway"] = f"http://127.0.0.1:{port}/metrics"
        self.gateway_trace = self.workdir / f"gateway-trace-g{processes}-{time.monotonic_ns()}.jsonl"
        env = dict(
            self.env,
            KERNELLAB_GATEWAY_TRACE=str(self.gateway_trace),
            KERNELLAB_HOST=self.host,
            KERNELLAB_PORT=str(self.port),
            KERNELLAB_GATEWAY_PROCESSES=str(processes),
            KERNELLAB_GATEWAY_METRICS_PORT=str(port),
            **(overrides or {}),
        )
        self.gateway = self._spawn(f"gateway-g{processes}", [sys.executable, "-m", "kernellab.services.gateway"], env)

    def stop_workers(self) -> None:
        stop_processes(self.workers, 60)
        self.workers, self.traces = [], {}
        self.metrics_urls = {k: v for k, v in self.metrics_urls.items() if not k.startswith("worker")}

    def stop_gateway(self) -> None:
        if self.gateway is not None:
            stop_process(self.gateway, 30)
            self.gateway = None

    def wait_ready(self, workers: int, timeout: float = 900.0) -> None:
        running = [self.redis, *self.workers, self.gateway]
        watch = {name: p for name, p in self.processes.procs.items() if p in running}
        try:
            wait_ready(f"http://{self.host}:{self.port}", workers, timeout=timeout, watch=watch)
        except (ProcessExited, TimeoutError) as e:
            raise RuntimeError(f"{e}; logs in {self.workdir}") from None

    def pids(self) -> dict[str, list[int]]:
        import psutil

        out = {"redis": [self.redis.pid], "workers": [w.pid for w in self.workers], "gateway": []}
        if self.gateway is not None:
            g = psutil.Process(self.gateway.pid)
            out["gateway"] = [g.pid] + [c.pid for c in g.children(recursive=True)]
        return out

    def stop(self) -> None:
        self.processes.stop_all(("gateway", "worker", "redis"), 30)
        self.gateway = None

    def down(self) -> str | None:
        """Which of the stack's current processes (Redis, the workers, the gateway tier's parent) has exited, with
        its exit code; None while every one runs. Asked while the clients run (``run_clients``'s ``server_down``)."""
        names = {id(p): n for n, p in self.processes.procs.items()}
        for p in (self.redis, *self.workers, self.gateway):
            if p is not None and p.poll() is not None:
                name = names.get(id(p), "?")
                return f"{name} exited with code {p.returncode} (its log: {self.workdir / (name + '.log')})"
        return None


def log_tails(workdir: Path, lines: int) -> str:
    """The last ``lines`` lines of every process log in ``workdir`` (the stack's, and Redis's)."""
    parts = []
    for f in sorted(workdir.glob("*.log")):
        tail = f.read_text(errors="replace").splitlines()[-lines:]
        parts.append(f"==> {f.name} (last {len(tail)} lines) <==\n" + "\n".join(tail))
    return "\n\n".join(parts)


class CpuMeter:
    """CPU seconds each component used during a run, in cores (CPU seconds / wall seconds)."""

    def __init__(self, groups: dict[str, list[int]]):
        import psutil

        self.procs = {k: [psutil.Process(p) for p in v] for k, v in groups.items()}

    def _sample(self) -> dict[str, float]:
        import psutil

        out = {}
        for k, procs in self.procs.items():
            total = 0.0
            for p in procs:
                try:
                    t = p.cpu_times()
                    total += t.user + t.system
                except psutil.Error:
                    pass
            out[k] = total
        return out

    def __enter__(self) -> CpuMeter:
        self.start, self.t0 = self._sample(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        end, wall = self._sample(), time.perf_counter() - self.t0
        self.cores = {k: round((end[k] - self.start[k]) / wall, 3) for k in end}


TTFT_METRICS = {
    "gateway": "kernellab_gateway_time_to_first_token_seconds",
    "worker": "kernellab:time_to_first_token_seconds",
}


def scrape(stack: StackProcs) -> dict[str, str]:
    """Each live metrics endpoint's exposition text, one GET each (an endpoint that does not answer is left out)."""
    import httpx

    texts = {}
    for name, url in stack.metrics_urls.items():
        if name == "gateway" and stack.gateway is None:
            continue
        try:
            texts[name] = httpx.get(url, timeout=5).text
        except httpx.HTTPError:
            continue
    return texts


def _total(text: str, prefix: str) -> float | None:
    """The sum of the samples whose line starts with ``prefix`` (every label set); None: no such sample."""
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix)]
    return sum(values) if values else None


def ttft_sums(texts: dict[str, str]) -> dict[str, tuple[float, float]]:
    """(sum, count) of the TTFT histograms the gateway tier and the workers export (``scrape``): where a request's
    wait went (gateway receipt → first token sent; worker receipt → first token out of the engine)."""
    out: dict[str, tuple[float, float]] = {}
    for name, text in texts.items():
        side = "gateway" if name == "gateway" else "workers"
        metric = TTFT_METRICS["gateway" if name == "gateway" else "worker"]
        before = out.get(side, (0.0, 0.0))
        out[side] = (
            before[0] + (_total(text, metric + "_sum") or 0.0),
            before[1] + (_total(text, metric + "_count") or 0.0),
        )
    return out


JIT_METRICS = ("kernellab:triton_jit_compiles_total", "kernellab:triton_jit_compile_seconds_total")


def worker_jit(texts: dict[str, str]) -> tuple[float, float] | None:
    """(compiles, seconds) of Triton compiles the workers met while serving (``runtime/jit_watch.py``): each one
    stalled the step that met it. None when no worker exports the counters."""
    totals = [[_total(text, m) for m in JIT_METRICS] for name, text in texts.items() if name.startswith("worker")]
    found = [t for t in totals if t[0] is not None]
    if not found:
        return None
    return sum(t[0] or 0.0 for t in found), sum(t[1] or 0.0 for t in found)


def jit_log_lines(workdir: Path) -> list[str]:
    """The workers' warnings for each Triton compile while serving (kernel, milliseconds, specialization)."""
    lines: list[str] = []
    for log_file in sorted(workdir.glob("worker*.log")):
        for line in log_file.read_text(errors="replace").splitlines():
            if "Triton compiled" in line:
                lines.append(f"{log_file.stem}: {line.strip()[:1500]}")
    return lines


def stack_run(stack: StackProcs, model: str, requests, processes: int, timeout_s: float) -> dict:
    from kernellab.bench.stream_clients import completion_request, run_clients
    from kernellab.bench.timeline import read_gateway_trace, read_trace, timeline

    raws = [completion_request(stack.host, stack.port, model, p, n) for p, n in requests]
    texts = scrape(stack)
    before, jit_before = ttft_sums(texts), worker_jit(texts)
    with CpuMeter(stack.pids()) as cpu:
        out = run_clients(stack.host, stack.port, raws, processes, timeout_s, server_down=stack.down)
    texts = scrape(stack)
    after, jit_after = ttft_sums(texts), worker_jit(texts)
    layers = {
        k: round((after[k][0] - before.get(k, (0, 0))[0]) / (after[k][1] - before.get(k, (0, 0))[1]) * 1e3, 3)
        for k in after
        if after[k][1] > before.get(k, (0, 0))[1]
    }
    recs = [
        {
            "sent": r.sent,
            "first": r.first,
            "end": r.end,
            "chunk_times": r.chunk_times,
            "tokens": r.completion_tokens,
            "error": r.error,
            "rid": f"{r.response_id}:0",
        }
        for r in out["records"]
    ]
    s = summarize(recs, [n for _p, n in requests], out["t0"])
    if len(stack.traces) == 1:  # one worker: its trace holds every request of the run
        time.sleep(0.3)  # the worker writes its trace when it goes idle
        steps, adds, received = read_trace(next(iter(stack.traces.values())), out["t0"] - 0.5)
        gateway = read_gateway_trace(stack.gateway_trace, out["t0"] - 0.5) if stack.gateway_trace else None
        s["timeline"] = timeline(steps, adds, recs, out["t0"], received=received, gateway=gateway)
    s.update(
        clients=out["clients"],
        max_client_cpu_util=out["max_client_cpu_util"],
        clients_saturated=out["clients_saturated"],
        server_cpu_cores=cpu.cores,
        worker_jit_compiles={
            "compiles": round(jit_after[0] - jit_before[0]),
            "seconds": round(jit_after[1] - jit_before[1], 3),
        }
        if jit_before is not None and jit_after is not None
        else None,
        mean_ttft_ms_by_layer={
            "client": round(statistics.mean((r["first"] - r["sent"]) * 1e3 for r in recs if r["first"] is not None), 3)
            if recs
            else None,
            **layers,
        },
    )
    return s


# ------------------------------------------------------------------------------------------------ driver
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", choices=sorted(PROFILES), default="h200")
    ap.add_argument("--gpus", type=int, default=1, help="2: add the two-GPU scale-out phase")
    ap.add_argument(
        "--phases",
        type=lambda s: s.split(","),
        default=None,
        help="comma-separated stack phases, e.g. g1-nogather,g16 (gN: N gateway processes)",
    )
    ap.add_argument("--client-processes", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=1, help="measured nano-vllm runs per phase")
    ap.add_argument("--interactive-repeats", type=int, default=3, help="measured interactive runs per phase")
    ap.add_argument("--redis-server", default=shutil.which("redis-server") or "redis-server")
    ap.add_argument("--model-dir", default=None, help="reuse a checkpoint folder written by an earlier run")
    ap.add_argument("--output", default="results/gpu/serve_h200.json")
    ap.add_argument("--engine-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument(
        "--refigure", default=None, metavar="ARTIFACT", help="recompute an artifact's figures into --output"
    )
    args = ap.parse_args()
    if args.refigure:
        print_table(refigure(args.refigure, args.output))
        print(f"wrote {args.output}")
        return 0
    if args.engine_child:
        engine_child(json.loads(args.engine_child))
        return 0
    profile = dict(PROFILES[args.profile])
    if args.phases:
        profile["phases"] = args.phases
    if args.gpus > 1 and product_phase(profile["phases"]) != profile["phases"][-1]:
        ap.error(f"--gpus {args.gpus} scales out the last phase: list the product's phase (g<N>) last")
    if args.client_processes:
        profile["client_processes"] = args.client_processes
    from kernellab.bench.synthetic import write_checkpoint

    started = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="serve-gpu-"))
    model_dir = Path(args.model_dir) if args.model_dir else workdir / "model"
    if not (model_dir / "config.json").exists():
        t = time.perf_counter()
        write_checkpoint(model_dir, profile["shape"], device="cuda" if profile["device"] == "cuda" else "cpu")
        log(f"wrote the {profile['shape']} checkpoint to {model_dir} in {time.perf_counter() - t:.1f}s")
    if profile["device"] == "cuda" and profile["num_kv_blocks"]:
        import torch

        total = torch.cuda.get_device_properties(0).total_memory
        fitted = fit_kv_blocks(profile["num_kv_blocks"], json.loads((model_dir / "config.json").read_text()), total)
        if fitted < profile["num_kv_blocks"]:
            log(
                f"{total / 2**30:.1f} GiB on GPU 0 holds two KV pools of {fitted} blocks, not "
                f"{profile['num_kv_blocks']}: both the engine and the worker run with {fitted}"
            )
            profile["num_kv_blocks_requested"], profile["num_kv_blocks"] = profile["num_kv_blocks"], fitted
    engine_cfg = {
        "model": str(model_dir),
        "device": profile["device"],
        "dtype": profile["dtype"],
        "max_num_seqs": profile["max_num_seqs"],
        "max_num_batched_tokens": profile["max_num_batched_tokens"],
        "max_model_len": profile["max_model_len"],
        "num_kv_blocks": profile["num_kv_blocks"],
    }
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if profile["device"] == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = "0"
    runs: list[dict] = []
    prov: dict = {}
    run_id = iter(range(1, 1 << 20))
    timeout = profile["run_timeout_s"]

    def record(phase: str, wl: str, s: dict, **extra) -> None:
        runs.append({"phase": phase, "workload": wl, **extra, **s})
        write_artifact(args, profile, prov, runs, started)  # after every run: a cut-off job keeps what it measured
        log(
            f"{phase:18} {wl:12} {s['throughput_tok_s']:9.1f} tok/s  TTFT p50 {s['ttft_ms']['p50']} ms  "
            f"bad {s['num_bad']}  client cpu {s.get('max_client_cpu_util', '-')}  server {s.get('server_cpu_cores', '')}"
        )

    # The engine child and the stack's worker share GPU 0 (fixed KV pools, one of them idle at a time), so every
    # stack run is paired with an engine run on the same prompts, back to back, in alternating order: drift of
    # the machine between runs hits both sides of a pair alike, and the figures are medians over pairs.
    t = time.perf_counter()
    engine = EngineChild(engine_cfg, env, str(workdir))
    log(f"engine ready in {time.perf_counter() - t:.1f}s")
    prov.update(engine.hello["provenance"])
    stack = StackProcs(args, profile, model_dir, workdir)
    pair = iter(range(1 << 20))

    def engine_run(wl: str, rid: int, phase: str, **extra) -> None:
        reqs = workload(profile, wl, rid)
        out = engine.run(reqs)
        s = summarize(out["records"], [n for _p, n in reqs], out["t0"])
        s["timeline"] = out["timeline"]
        record("engine", wl, s, paired_with=phase, **extra)

    all_cpus = os.sched_getaffinity(0)
    try:
        engine.run(workload(profile, "warmup", next(run_id)))
        engine.run(workload(profile, "interactive", next(run_id)))
        stack.start_redis()
        worker_env: dict | None = None
        for phase in profile["phases"]:
            g, *variants = phase.removeprefix("g").split("-")
            g, env_over, gateway_over = int(g), {}, {}
            for v in variants:
                if v == PINNED:
                    worker_cpus, rest = split_cores(all_cpus)
                    env_over["KERNELLAB_CPUS"], gateway_over["KERNELLAB_CPUS"] = worker_cpus, rest
                    log(f"-{PINNED}: worker on cpus {worker_cpus}; gateway tier and clients on {rest}")
                else:
                    if v in GATEWAY_VARIANTS:
                        gateway_over.update(GATEWAY_VARIANTS[v])
                    if v in VARIANTS or v not in GATEWAY_VARIANTS:
                        env_over.update(VARIANTS[v])
            # the load generator's client processes (spawned per run) inherit this process's binding
            os.sched_setaffinity(0, parse_cpu_list(gateway_over.get("KERNELLAB_CPUS", "")) or all_cpus)
            if env_over != worker_env:
                stack.stop_workers()
                stack.start_worker(0, env_over)
                worker_env = env_over
            t = time.perf_counter()
            stack.start_gateway(g, gateway_over)
            stack.wait_ready(1)
            log(f"stack ready ({phase}) in {time.perf_counter() - t:.1f}s")
            for wl in ("warmup", "interactive"):  # unmeasured: a new worker's first burst meets first-use costs
                stack_run(
                    stack, str(model_dir), workload(profile, wl, next(run_id)), profile["client_processes"], timeout
                )
            for wl, repeats in (("nanovllm", args.repeats), ("interactive", args.interactive_repeats)):
                for rep in range(repeats):
                    rid, k = next(run_id), next(pair)
                    for side in ("engine", "stack") if k % 2 == 0 else ("stack", "engine"):
                        if side == "engine":
                            engine_run(wl, rid, f"stack-{phase}", pair=k, repeat=rep)
                        else:
                            s = stack_run(
                                stack, str(model_dir), workload(profile, wl, rid), profile["client_processes"], timeout
                            )
                            record(f"stack-{phase}", wl, s, gateway_processes=g, gpus=1, repeat=rep, pair=k)
            if args.gpus > 1 and phase == profile["phases"][-1]:
                for i in range(1, args.gpus):
                    stack.start_worker(i, env_over)
                t = time.perf_counter()
                stack.wait_ready(args.gpus)
                log(f"{args.gpus} workers ready in {time.perf_counter() - t:.1f}s")
                stack_run(
                    stack,
                    str(model_dir),
                    workload(profile, "warmup", next(run_id)),
                    profile["client_processes"],
                    timeout,
                )
                clients = profile["client_processes"] * (args.gpus if profile["device"] == "cuda" else 1)
                for rep in range(args.repeats):
                    s = stack_run(
                        stack,
                        str(model_dir),
                        workload(profile, "nanovllm", next(run_id), scale=args.gpus),
                        clients,
                        timeout,
                    )
                    record(
                        f"stack-{args.gpus}gpu-{phase}",
                        f"nanovllm-x{args.gpus}",
                        s,
                        gateway_processes=g,
                        gpus=args.gpus,
                        repeat=rep,
                    )
            stack.stop_gateway()
    except BaseException as exc:
        # what each process said before the stack goes down: into the output folder, so that a run on a lent
        # machine brings back the cause (the workdir goes with the machine), and the last lines to the console
        failure = Path(args.output).with_name(Path(args.output).stem + "_failure_logs.txt")
        failure.parent.mkdir(parents=True, exist_ok=True)
        failure.write_text(f"{type(exc).__name__}: {exc}\n\n{log_tails(workdir, 300)}\n")
        print(log_tails(workdir, 25), flush=True)
        write_artifact(args, profile, prov, runs, started, jit_log_lines(workdir), error=f"{type(exc).__name__}: {exc}")
        log(f"failed: {exc}; the logs' tails are in {failure}, the logs in {workdir}")
        raise
    finally:
        stack.stop()
        engine.stop()

    # what the workers compiled after their startup (the logs go with the workdir below)
    artifact = write_artifact(args, profile, prov, runs, started, jit_log_lines(workdir))
    print_table(artifact)
    print(f"wrote {args.output}")
    if not args.model_dir:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def write_artifact(
    args,
    profile: dict,
    prov: dict,
    runs: list[dict],
    started: float,
    jit_lines: list[str] | None = None,
    error: str | None = None,
) -> dict:
    from importlib import metadata

    prov = dict(prov)
    prov["redis_server"] = subprocess.run(
        [args.redis_server, "--version"], capture_output=True, text=True
    ).stdout.strip()
    for dist in ("redis", "fastapi", "uvicorn", "starlette", "msgpack", "tokenizers", "prometheus-client"):
        try:
            prov[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            prov[dist] = None
    if profile["device"] == "cuda":
        import torch

        prov["gpus_used"] = args.gpus
        prov["gpu_count"] = torch.cuda.device_count()
    artifact = {
        "schema": SCHEMA,
        "provenance": prov,
        "profile": args.profile,
        "model": {
            "shape": profile["shape"],
            "weights": "random bf16 (kernellab.bench.synthetic, seed 0)",
            "tokenizer": "synthetic byte-level BPE, vocabulary = the model's (kernellab.bench.synthetic)",
        },
        "config": {k: v for k, v in profile.items() if k not in ("nanovllm", "interactive")},
        "workloads": {
            "nanovllm": profile["nanovllm"],
            "interactive": profile["interactive"],
            "request": "POST /v1/completions, token-id prompt, stream, temperature 0, ignore_eos, "
            "stream_options.include_usage; all requests of a run written at one instant",
            "engine": "LLMEngine in a child process, same EngineConfig as the workers, all requests added at t0",
        },
        "targets": TARGETS,
        "figures": compute_figures(runs, args.gpus),
        "runs": runs,
        "seconds": round(time.perf_counter() - started, 1),
    }
    if jit_lines is not None:
        artifact["jit_while_serving"] = jit_lines
    if error is not None:  # the run stopped here: its runs so far, and why (the logs' tails beside the artifact)
        artifact["error"] = error
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(artifact, indent=1) + "\n")
    return artifact


def _median(runs: list[dict], key) -> float | None:
    vals = [key(r) for r in runs]
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def median_interval(values: list[float], level: float = 0.9) -> dict | None:
    """A distribution-free interval for the median of ``values`` (paired differences): the order statistics
    ``(k, n + 1 - k)`` with the largest ``k`` whose coverage ``1 - 2·P(Binomial(n, ½) < k)`` is at least ``level``;
    None for fewer than 5 values (no such interval reaches 90 %)."""
    from math import comb

    xs, n = sorted(values), len(values)
    best = None
    for k in range(1, n // 2 + 1):
        coverage = 1 - 2 * sum(comb(n, i) for i in range(k)) / 2**n
        if coverage >= level:
            best = {"lo": round(xs[k - 1], 3), "hi": round(xs[n - k], 3), "coverage": round(coverage, 4)}
    return best


def product_phase(phases: list[str]) -> str | None:
    """The phase whose figures are the product's: the last that runs the defaults (``g<N>``, no suffix), else the
    last."""
    defaults = [ph for ph in phases if re.fullmatch(r"g\d+", ph)]
    return (defaults or phases or [None])[-1]


def refigure(path: str, output: str) -> dict:
    """An artifact's figures recomputed from its runs with this script's rule (``--refigure``), the commit that
    recomputed them recorded beside the run's own provenance."""
    from kernellab.results import git_commit

    artifact = json.loads(Path(path).read_text())
    gpus = max((r.get("gpus", 1) for r in artifact["runs"]), default=1)
    before = artifact["figures"].get("product_phase")
    artifact["figures"] = compute_figures(artifact["runs"], gpus)
    artifact["refigured"] = {
        "commit": git_commit(),
        "rule": "the product's figures are the last phase that runs the defaults (g<N> without a suffix)",
        "product_phase_before": before,
    }
    Path(output).write_text(json.dumps(artifact, indent=1) + "\n")
    return artifact


def compute_figures(runs: list[dict], gpus: int) -> dict:
    def sel(phase, wl):
        return [r for r in runs if r["phase"] == phase and r["workload"] == wl]

    eng_nano = _median(sel("engine", "nanovllm"), lambda r: r["throughput_tok_s"])
    eng_ttft = _median(sel("engine", "interactive"), lambda r: r["ttft_ms"]["p50"])  # all pairs, for reference
    phases = list(dict.fromkeys(r["phase"] for r in runs if r["phase"].startswith("stack-") and r["gpus"] == 1))
    engine_by_pair = {r["pair"]: r for r in runs if r["phase"] == "engine" and "pair" in r}
    per_phase = {}
    for ph in phases:
        pairs = {
            wl: [(engine_by_pair[r["pair"]], r) for r in sel(ph, wl) if r.get("pair") in engine_by_pair]
            for wl in ("nanovllm", "interactive")
        }
        nano = _median(sel(ph, "nanovllm"), lambda r: r["throughput_tok_s"])
        ttft = _median(sel(ph, "interactive"), lambda r: r["ttft_ms"]["p50"])
        ratio = _median(pairs["nanovllm"], lambda er: er[1]["throughput_tok_s"] / er[0]["throughput_tok_s"])
        diffs = [
            er[1]["ttft_ms"]["p50"] - er[0]["ttft_ms"]["p50"]
            for er in pairs["interactive"]
            if None not in (er[1]["ttft_ms"]["p50"], er[0]["ttft_ms"]["p50"])
        ]
        added = statistics.median(diffs) if diffs else None
        per_phase[ph.removeprefix("stack-")] = {
            "nanovllm_tok_s": nano,
            "interactive_ttft_p50_ms": ttft,
            "pairs": {k: len(v) for k, v in pairs.items()},
            "engine_nanovllm_tok_s": _median(pairs["nanovllm"], lambda er: er[0]["throughput_tok_s"]),
            "engine_interactive_ttft_p50_ms": _median(pairs["interactive"], lambda er: er[0]["ttft_ms"]["p50"]),
            "throughput_ratio": round(ratio, 4) if ratio is not None else None,
            "interactive_added_ttft_p50_ms": round(added, 3) if added is not None else None,
            # each pair's added TTFT p50 (stack minus engine, ms), and the median's order-statistic interval
            "interactive_added_ttft_ms_by_pair": sorted(round(d, 3) for d in diffs),
            "interactive_added_ttft_p50_ms_interval": median_interval(diffs),
        }
    best = product_phase([ph.removeprefix("stack-") for ph in phases])
    out = {
        "engine_nanovllm_tok_s": eng_nano,
        "engine_interactive_ttft_p50_ms": eng_ttft,
        "stack_by_phase": per_phase,
        "product_phase": best,
    }
    if best:
        out["throughput_ratio"] = per_phase[best]["throughput_ratio"]
        out["interactive_added_ttft_p50_ms"] = per_phase[best]["interactive_added_ttft_p50_ms"]
        out["interactive_added_ttft_p50_ms_interval"] = per_phase[best]["interactive_added_ttft_p50_ms_interval"]
    two = [r for r in runs if r.get("gpus", 1) > 1]
    if two and best and per_phase[best]["nanovllm_tok_s"]:
        tok = _median(two, lambda r: r["throughput_tok_s"])
        out["two_gpu_nanovllm_x2_tok_s"] = tok
        out["two_gpu_scaling"] = round(tok / per_phase[best]["nanovllm_tok_s"], 4)
    out["all_requests_exact"] = all(r["num_bad"] == 0 for r in runs)
    out["clients_saturated"] = any(r.get("clients_saturated") for r in runs)
    out["max_client_cpu_util"] = max((r.get("max_client_cpu_util") or 0 for r in runs), default=0)
    met = {
        "throughput_ratio": (out.get("throughput_ratio") or 0) >= TARGETS["throughput_ratio_min"],
        "interactive_ttft": out.get("interactive_added_ttft_p50_ms") is not None
        and out["interactive_added_ttft_p50_ms"] <= TARGETS["interactive_added_ttft_p50_ms_max"],
        "exact_tokens": out["all_requests_exact"],
    }
    if gpus > 1:
        met["two_gpu_scaling"] = (out.get("two_gpu_scaling") or 0) >= TARGETS["two_gpu_scaling_min"]
    out["met"] = met
    return out


def print_table(a: dict) -> None:
    from kernellab.bench.timeline import GATEWAY_SPLIT

    f = a["figures"]
    print(
        f"\n{'run':22}{'workload':14}{'tok/s':>10}{'TTFT p50':>10}{'p99':>9}{'TPOT p50':>10}{'E2E p50':>10}"
        f"{'bad':>5}{'cli cpu':>8}"
    )
    for r in a["runs"]:
        print(
            f"{r['phase']:22}{r['workload']:14}{r['throughput_tok_s']:10.1f}{r['ttft_ms']['p50'] or 0:10.1f}"
            f"{r['ttft_ms']['p99'] or 0:9.1f}{r['tpot_ms']['p50'] or 0:10.2f}{r['e2e_ms']['p50'] or 0:10.0f}"
            f"{r['num_bad']:5d}{r.get('max_client_cpu_util') or 0:8.2f}"
        )
    timed = [r for r in a["runs"] if r["workload"] == "interactive" and r.get("timeline")]
    if timed:
        print(
            f"\nTTFT parts, medians in ms (kernellab.bench.timeline; to worker = read + inbox)\n{'run':22}"
            f"{'to worker':>10}{'read':>7}{'inbox':>7}{'queued':>8}{'step':>8}{'delivery':>9}   first steps "
            "[start ms, ms, rows, tokens, first tokens]; worker received / took in [min, p50, max] ms after t0"
        )
        columns = (("to_worker", 10), ("to_worker_read", 7), ("inbox", 7), ("queued", 8), ("step", 8), ("delivery", 9))
        for r in timed:
            m, arrivals = r["timeline"]["median_ms"], r["timeline"].get("arrivals", {})
            print(
                f"{r['phase']:22}"
                + "".join(f"{m[k] if m.get(k) is not None else float('nan'):{w}.2f}" for k, w in columns)
                + f"   {r['timeline']['steps'][:4]}; {arrivals.get('received_ms')} / {arrivals.get('taken_ms')}"
            )
        gated = [r for r in timed if "http_in" in r["timeline"]["median_ms"]]
        if gated:
            print(
                f"\nthe gateway's share (its request trace), medians in ms: read = http in + admit + flush + redis read; "
                f"delivery = to gateway + gateway out\n{'run':22}"
                + "".join(f"{k.replace('_', ' '):>12}" for k in GATEWAY_SPLIT)
            )
            for r in gated:
                m, arrivals = r["timeline"]["median_ms"], r["timeline"].get("arrivals", {})
                print(
                    f"{r['phase']:22}"
                    + "".join(f"{m[k] if m.get(k) is not None else float('nan'):12.2f}" for k in GATEWAY_SPLIT)
                    + f"   routes began / pipelines out {arrivals.get('gateway_in_ms')} / "
                    + f"{arrivals.get('gateway_sent_ms')}; processes, fewest, most requests "
                    + f"{r['timeline'].get('gateway_load')}; the worker's reads [ms, requests] "
                    + f"{(r['timeline'].get('reads') or [])[:10]}"
                    + (
                        f"; first steps' launch / device wait ms {r['timeline']['step_launch_wait_ms'][:4]}"
                        if r["timeline"].get("step_launch_wait_ms")
                        else ""
                    )
                    + (
                        f"; worker GC ms: first steps {r['timeline'].get('step_gc_ms', [])[:4]}, run total / "
                        f"largest {r['timeline']['gc_ms']}, by generation [ms, collections, largest, CPU ms] "
                        f"{r['timeline'].get('gc_by_generation')}"
                        if r["timeline"].get("gc_ms")
                        else ""
                    )
                )
                for c in r["timeline"].get("gc_census", [])[:3]:
                    print(
                        f"{'':22}slow young collection {c['ms']} ms (CPU {c['cpu_ms']}), generation "
                        f"{c['generation']}: {c['objects']} objects, {c['refs']} references, collected "
                        f"{c['collected']}; by count {c['by_count']}; by references {c['by_refs']}"
                    )
    print(
        f"\nstack/engine throughput {f.get('throughput_ratio')} (target ≥ {TARGETS['throughput_ratio_min']}); "
        f"interactive TTFT p50 added {f.get('interactive_added_ttft_p50_ms')} ms "
        f"(pairs' median interval {f.get('interactive_added_ttft_p50_ms_interval')}; ≤ "
        f"{TARGETS['interactive_added_ttft_p50_ms_max']}); 2-GPU scaling {f.get('two_gpu_scaling')} (≥ "
        f"{TARGETS['two_gpu_scaling_min']}); exact tokens {f['all_requests_exact']}; met {f['met']}"
    )


if __name__ == "__main__":
    sys.exit(main())
