"""``kernellab stress``: the real stack (Redis, gateway, workers with the embedded model) under a request mix,
faults and hostile clients, with a JSON artifact (schema ``kernellab.reliability/v1``).

- ``LocalStack``: a private redis-server, N workers and two gateways as real processes on 127.0.0.1 free
  ports. The second gateway shares the queue but stamps a short deadline (``KERNELLAB_REQUEST_TIMEOUT_S``):
  the API has no per-request deadline field, so requests meant to expire are sent there.
- ``run_scenario``: a closed-loop load (``concurrency`` clients, ``requests`` in all) plus, per scenario, a
  fault: ``worker-kill`` (kill -9, restart, repeated), ``worker-pause`` (SIGSTOP past the reclaim timeout,
  then SIGCONT), ``redis-restart`` (stopped, started empty), ``gateway-restart`` (SIGTERM drain, new process),
  ``slow-client`` (raw sockets that read their streams slowly), ``vanishing-client`` (many streams, then
  every socket reset). Then it waits until the stack is idle and reads each worker's KV blocks.

Every attempt ends as exactly one of: ``completed``; ``cancelled`` (the client closed it on purpose);
``error`` (a clean error: an HTTP status with an OpenAI error object, or an SSE error event); ``refused``
(no HTTP response at all: connection refused or closed before a status line, so nothing was accepted);
``lost`` (anything else: a stream cut without an error event, a body that is not an OpenAI object, a hang).
Fault scenarios retry ``error``/``refused`` attempts whose code is retryable, as an OpenAI client does;
``lost`` is never retried and must stay 0. Deterministic requests (greedy, or seeded) of the same input
must produce the same text every time: a duplicated, skipped or mixed token shows up as ``corrupt``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kernellab.services.loadgen.sse import SSEDecoder
from kernellab.services.loadgen.stats import distribution

SCHEMA = "kernellab.reliability/v1"
MODEL = "smollm2-135m"
SCENARIOS = ("load", "worker-kill", "worker-pause", "redis-restart", "gateway-restart", "slow-client",
             "vanishing-client")
PROMPTS = (
    "What is the capital of France?", "Name three colors.", "Why is the sky blue?", "What does a CPU do?",
    "Write a haiku about the ocean.", "List three uses of copper.", "What is 12 times 12?",
    "Describe a cat in one sentence.", "Suggest a name for a bakery.", "What is photosynthesis?",
    "How do vaccines work?", "Give me a tip for learning to cook.",
)
RETRYABLE = frozenset({"refused", "queue_unavailable", "service_unavailable", "draining", "no_worker",
                       "rate_limit_exceeded", "dead_lettered", "protocol_gap"})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(cond, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(Exception):
            result = cond()
            if result:
                return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


# ===================================================================== the stack
class LocalStack:
    """Redis + ``workers`` workers + a gateway + a short-deadline gateway, all ours, on 127.0.0.1."""

    def __init__(self, workdir: Path, *, workers: int = 2, api_key: str = "sk-stress", deadline_s: float = 1.0,
                 max_waiting: int = 256, env: dict | None = None):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.api_key, self.deadline_s = api_key, deadline_s
        self.redis_port, self.port, self.deadline_port = free_port(), free_port(), free_port()
        self.gateway_metrics_port = free_port()
        self.worker_ports = [free_port() for _ in range(workers)]
        self.url, self.deadline_url = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{self.deadline_port}"
        self.redis_url = f"redis://127.0.0.1:{self.redis_port}/0"
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", KERNELLAB_REDIS_URL=self.redis_url, KERNELLAB_MODEL=MODEL,
                        KERNELLAB_KEY_PREFIX=f"kls-{uuid.uuid4().hex[:8]}:", KERNELLAB_API_KEYS=api_key,
                        KERNELLAB_API_KEY_FILE="",
                        KERNELLAB_HEARTBEAT_INTERVAL_S="0.5", KERNELLAB_WORKER_DEAD_AFTER_S="2.5",
                        KERNELLAB_DEVICE="cpu", KERNELLAB_DTYPE="float32", KERNELLAB_NUM_KV_BLOCKS="512",
                        KERNELLAB_MAX_NUM_SEQS="32", KERNELLAB_DRAIN_TIMEOUT_S="20",
                        KERNELLAB_MAX_WAITING=str(max_waiting), KERNELLAB_FILES_DIR=str(self.workdir / "files"))
        self.env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))
        self.env.pop("KERNELLAB_METRICS_HOST", None)  # the default (127.0.0.1), which the security tests check
        self.env.update(env or {})
        self.procs: dict[str, subprocess.Popen] = {}
        self.redis_binary = shutil.which("redis-server")
        if self.redis_binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")

    @property
    def dead_after_s(self) -> float:
        return float(self.env["KERNELLAB_WORKER_DEAD_AFTER_S"])

    def _spawn(self, name: str, cmd: list[str], env: dict | None = None) -> None:
        log = (self.workdir / f"{name}.log").open("ab")
        self.procs[name] = subprocess.Popen(cmd, env=env or self.env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        log.close()

    def start_redis(self) -> None:
        self._spawn("redis", [self.redis_binary, "--port", str(self.redis_port), "--bind", "127.0.0.1",
                              "--save", "", "--appendonly", "no", "--dir", str(self.workdir)])
        import redis

        wait_for(lambda: redis.Redis.from_url(self.redis_url, socket_connect_timeout=0.2).ping(), 10, "redis-server")

    def stop_redis(self) -> None:
        self._stop("redis", signal.SIGTERM, 10)

    def start_worker(self, i: int) -> None:
        self._spawn(f"worker-{i}", [sys.executable, "-m", "kernellab", "worker", "--metrics-port",
                                    str(self.worker_ports[i]), "--worker-id", f"stress-w{i}-{uuid.uuid4().hex[:4]}"])

    def start_gateway(self, deadline: bool = False) -> None:
        if deadline:
            env = dict(self.env, KERNELLAB_REQUEST_TIMEOUT_S=str(self.deadline_s))
            self._spawn("gateway-deadline", [sys.executable, "-m", "kernellab", "gateway", "--port",
                                             str(self.deadline_port), "--metrics-port", "0"], env)
        else:
            self._spawn("gateway", [sys.executable, "-m", "kernellab", "gateway", "--port", str(self.port),
                                    "--metrics-port", str(self.gateway_metrics_port)])

    def start(self, timeout: float = 300) -> LocalStack:
        try:
            self.start_redis()
            for i in range(len(self.worker_ports)):
                self.start_worker(i)
            self.start_gateway()
            if self.deadline_s:
                self.start_gateway(deadline=True)
            self.wait_ready(len(self.worker_ports), timeout)
        except BaseException:
            tail = self.log_tail()
            self.stop()
            raise RuntimeError(f"the stack did not start:\n{tail}") from None
        return self

    def ready_workers(self, url: str | None = None) -> int:
        resp = httpx.get(f"{url or self.url}/ready", headers=self.auth, timeout=2)
        return resp.json().get("workers", 0) if resp.status_code == 200 else 0

    def wait_ready(self, workers: int, timeout: float = 120) -> None:
        def ok():
            dead = [n for n, p in self.procs.items() if p.poll() is not None and n.startswith("gateway")]
            if dead:
                raise RuntimeError(f"{dead} exited")
            urls = [self.url] + ([self.deadline_url] if self.deadline_s else [])
            return all(self.ready_workers(u) >= workers for u in urls)

        wait_for(ok, timeout, f"/ready with {workers} worker(s)", interval=0.5)

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def worker_health(self, i: int) -> dict:
        return httpx.get(f"http://127.0.0.1:{self.worker_ports[i]}/health", timeout=2).json()

    def gateway_metric(self, name: str) -> float:
        text = httpx.get(f"http://127.0.0.1:{self.gateway_metrics_port}/metrics", timeout=2).text
        return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
                   if line.startswith(name) and not line.startswith("#"))

    def worker_metric(self, i: int, name: str, label: str = "") -> float:
        text = httpx.get(f"http://127.0.0.1:{self.worker_ports[i]}/metrics", timeout=2).text
        return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
                   if line.startswith(name) and label in line)

    def live_workers(self) -> list[int]:
        return [i for i in range(len(self.worker_ports)) if self.procs[f"worker-{i}"].poll() is None]

    def busiest_worker(self) -> int:
        running = {i: self.worker_health(i)["running"] for i in self.live_workers()}
        return max(running, key=running.get)

    def signal_worker(self, i: int, sig: int) -> None:
        self.procs[f"worker-{i}"].send_signal(sig)
        if sig == signal.SIGKILL:
            self.procs[f"worker-{i}"].wait(10)

    def restart_gateway(self) -> float:
        """SIGTERM (drain), wait for the exit, start a new process on the same port; seconds the port was shut."""
        self._stop("gateway", signal.SIGTERM, 60)
        down = time.monotonic()
        self.start_gateway()
        wait_for(lambda: self.ready_workers() >= 1, 120, "the new gateway's /ready", interval=0.1)
        return time.monotonic() - down

    def _stop(self, name: str, sig: int, timeout: float) -> None:
        proc = self.procs.get(name)
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGCONT)  # a paused process cannot act on SIGTERM
            proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)

    def stop(self) -> None:
        order = [n for n in self.procs if n.startswith("gateway")] + [n for n in self.procs if n.startswith("worker")]
        for name in [*order, "redis"]:
            self._stop(name, signal.SIGTERM, 30)

    def log_tail(self, lines: int = 25) -> str:
        out = []
        for name in self.procs:
            path = self.workdir / f"{name}.log"
            if path.exists():
                out.append(f"--- {name} ---\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(out)

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ===================================================================== the request mix
@dataclass(frozen=True)
class Plan:
    index: int
    endpoint: str  # "chat" | "completions"
    stream: bool
    prompt: str
    max_tokens: int
    action: str = "normal"  # "normal" | "cancel" (closed after the first tokens) | "deadline" (expires)
    temperature: float = 0.0
    seed: int | None = None
    ignore_eos: bool = True
    logprobs: bool = False

    @property
    def key(self) -> tuple | None:
        """Requests with the same key must produce the same text (greedy or seeded); None: not comparable."""
        if self.action != "normal" or (self.temperature > 0 and self.seed is None):
            return None
        return (self.endpoint, self.prompt, self.max_tokens, self.ignore_eos, self.temperature, self.seed)

    def body(self) -> dict:
        body = {"model": MODEL, "max_tokens": self.max_tokens, "temperature": self.temperature,
                "stream": self.stream, "ignore_eos": self.ignore_eos}
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": self.prompt}]
            if self.logprobs:
                body["logprobs"] = True
        else:
            body["prompt"] = self.prompt
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.seed is not None:
            body["seed"] = self.seed
        return body


def make_plans(n: int, seed: int = 0, *, max_tokens: tuple[int, int] = (4, 8), cancel_frac: float = 0.03,
               deadline_frac: float = 0.02, stream_frac: float = 0.5) -> list[Plan]:
    rng = random.Random(seed)
    plans = []
    for i in range(n):
        r = rng.random()
        action = "cancel" if r < cancel_frac else "deadline" if r < cancel_frac + deadline_frac else "normal"
        endpoint = "chat" if rng.random() < 0.7 else "completions"
        stream = action == "cancel" or rng.random() < stream_frac
        kind = rng.random()
        temperature, sample_seed = (0.0, None) if kind < 0.7 else (0.8, rng.randrange(4)) if kind < 0.9 else (0.8, None)
        tokens = rng.randint(*max_tokens)
        if action != "normal":
            tokens = 1000  # runs long enough to be cancelled mid-stream, or to outlive its deadline
        plans.append(Plan(i, endpoint, stream, rng.choice(PROMPTS), tokens, action, temperature, sample_seed,
                          ignore_eos=action != "normal" or rng.random() < 0.8,
                          logprobs=endpoint == "chat" and stream and rng.random() < 0.2))
    return plans


# ===================================================================== one attempt
@dataclass
class Attempt:
    outcome: str  # completed | cancelled | error | refused | lost
    start: float
    end: float = 0.0
    code: str | None = None
    status: int | None = None
    first: float | None = None  # first content chunk (streams)
    chunk_times: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int | None = None
    tokens_seen: int | None = None  # from logprobs entries, when asked for
    retry_after: float | None = None  # a 429's Retry-After header
    detail: str = ""


def _openai_error(payload) -> dict | None:
    err = payload.get("error") if isinstance(payload, dict) else None
    return err if isinstance(err, dict) and {"message", "type", "code"} <= set(err) else None


def _error_attempt(a: Attempt, status: int | None, body: bytes) -> Attempt:
    try:
        err = _openai_error(json.loads(body))
    except ValueError:
        err = None
    a.status = status
    if err is None:
        a.outcome, a.detail = "lost", f"HTTP {status} without an OpenAI error object: {body[:120]!r}"
    else:
        a.outcome, a.code, a.detail = "error", err.get("code") or f"http_{status}", str(err.get("message"))[:160]
    return a


def _retry_after(resp: httpx.Response) -> float | None:
    with contextlib.suppress(TypeError, ValueError):
        return float(resp.headers.get("retry-after"))
    return None


async def send(client: httpx.AsyncClient, url: str, api_key: str, plan: Plan, *, guard_s: float,
               cancel_after: int = 2) -> Attempt:
    path = "/v1/chat/completions" if plan.endpoint == "chat" else "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"}
    a = Attempt("lost", time.perf_counter())
    got_status = False
    try:
        async with asyncio.timeout(guard_s):
            if not plan.stream:
                resp = await client.post(url + path, json=plan.body(), headers=headers)
                got_status = True
                if resp.status_code != 200:
                    a.retry_after = _retry_after(resp)
                    return _error_attempt(a, resp.status_code, resp.content)
                data = resp.json()
                choice = data["choices"][0]
                a.text = choice.get("text") if plan.endpoint == "completions" else choice["message"]["content"]
                a.finish_reason, a.completion_tokens = choice.get("finish_reason"), data["usage"]["completion_tokens"]
                a.outcome, a.status = ("completed" if a.finish_reason else "lost"), 200
                return a
            async with client.stream("POST", url + path, json=plan.body(), headers=headers) as resp:
                got_status = True
                a.status = resp.status_code
                if resp.status_code != 200:
                    a.retry_after = _retry_after(resp)
                    return _error_attempt(a, resp.status_code, await resp.aread())
                await _read_stream(resp, plan, a, cancel_after)
                return a
    except TimeoutError:
        a.outcome, a.detail = "lost", f"no outcome within {guard_s:.0f}s"
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        a.outcome, a.code, a.detail = "refused", "refused", repr(exc)[:160]
    except httpx.RemoteProtocolError as exc:
        # Closed before a status line: the gateway never answered, so it never accepted the request.
        a.outcome = "lost" if got_status else "refused"
        a.code, a.detail = (None if got_status else "refused"), repr(exc)[:160]
    except (httpx.HTTPError, ValueError, KeyError, TypeError, IndexError) as exc:
        a.outcome, a.detail = "lost", repr(exc)[:160]
    finally:
        a.end = time.perf_counter()
    return a


async def _read_stream(resp: httpx.Response, plan: Plan, a: Attempt, cancel_after: int) -> None:
    decoder, texts, usage_seen = SSEDecoder(), [], False
    async for line in resp.aiter_lines():
        payload = decoder.feed_line(line)
        if payload is None:
            if decoder.done:
                break
            continue
        chunk = json.loads(payload)
        err = _openai_error(chunk)
        if err is not None:
            a.outcome, a.code, a.detail = "error", err.get("code") or "stream_error", str(err.get("message"))[:160]
            return
        if isinstance(chunk.get("usage"), dict):
            a.completion_tokens, usage_seen = chunk["usage"]["completion_tokens"], True
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta")
            text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            if text:
                now = time.perf_counter()
                a.first = a.first or now
                a.chunk_times.append(now)
                texts.append(text)
            lp = choice.get("logprobs")
            if plan.logprobs and isinstance(lp, dict):
                a.tokens_seen = (a.tokens_seen or 0) + len(lp.get("content") or ())
            a.finish_reason = choice.get("finish_reason") or a.finish_reason
        if plan.action == "cancel" and len(a.chunk_times) >= cancel_after:
            a.outcome, a.text = "cancelled", "".join(texts)
            return  # leaving the context manager closes the connection mid-stream
    a.text = "".join(texts)
    if decoder.done and a.finish_reason and usage_seen:
        a.outcome = "completed"
    else:
        a.outcome, a.detail = "lost", f"stream ended without [DONE]/finish/usage (done={decoder.done})"


# ===================================================================== the run
@dataclass
class Result:
    plan: Plan
    attempts: list[Attempt]

    @property
    def final(self) -> Attempt:
        return self.attempts[-1]

    @property
    def outcome(self) -> str:
        if any(a.outcome == "lost" for a in self.attempts):
            return "lost"
        a = self.final
        if a.outcome in ("completed", "cancelled"):
            return a.outcome
        if a.code == "deadline_exceeded":
            return "timed_out"
        if a.code == "rate_limit_exceeded":
            return "rejected"
        return "failed"


class LoadRun:
    """A closed loop of ``concurrency`` clients over ``plans``; faults run beside it and read its progress."""

    def __init__(self, stack: LocalStack, plans: list[Plan], *, concurrency: int, retries: int = 0,
                 guard_s: float = 120.0, time_limit_s: float = 1800.0):
        self.stack, self.plans, self.concurrency = stack, plans, concurrency
        self.retries, self.guard_s, self.time_limit_s = retries, guard_s, time_limit_s
        self.results: list[Result] = []
        self.t0 = 0.0
        self.sent = 0
        self.not_sent = 0  # left unsent by the time limit (a failure)
        self.stop_at: int | None = None  # fault scenarios: stop sending after this many (not a failure)

    @property
    def done(self) -> int:
        return len(self.results)

    async def _one(self, client: httpx.AsyncClient, plan: Plan) -> Result:
        url = self.stack.deadline_url if plan.action == "deadline" else self.stack.url
        attempts = []
        for k in range(self.retries + 1):
            a = await send(client, url, self.stack.api_key, plan, guard_s=self.guard_s)
            attempts.append(a)
            if a.outcome in ("completed", "cancelled", "lost") or a.code not in RETRYABLE or k == self.retries:
                break
            await asyncio.sleep(a.retry_after or min(2.0, 0.25 * 2**k))
        if attempts[-1].retry_after:  # a rejected client waits as told before its next request
            await asyncio.sleep(attempts[-1].retry_after)
        return Result(plan, attempts)

    async def run(self) -> None:
        queue: asyncio.Queue[Plan] = asyncio.Queue()
        for p in self.plans:
            queue.put_nowait(p)
        self.t0 = time.perf_counter()
        limits = httpx.Limits(max_connections=self.concurrency * 2, max_keepalive_connections=self.concurrency)
        timeout = httpx.Timeout(self.guard_s, connect=5.0)
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:

            async def loop():
                while not queue.empty() and (self.stop_at is None or self.sent < self.stop_at):
                    if time.perf_counter() - self.t0 > self.time_limit_s:
                        self.not_sent += queue.qsize()
                        while not queue.empty():
                            queue.get_nowait()
                        return
                    plan = queue.get_nowait()
                    self.sent += 1
                    self.results.append(await self._one(client, plan))

            await asyncio.gather(*(loop() for _ in range(self.concurrency)))
        self.duration = time.perf_counter() - self.t0


# ===================================================================== faults
@dataclass
class FaultEvent:
    kind: str
    at: float  # perf_counter when the fault began
    end: float = 0.0  # when the injector was done (worker killed, Redis back, gateway restarted)
    details: dict = field(default_factory=dict)


async def _settle(run: LoadRun, timeout: float = 600) -> None:
    """Let ``2 x concurrency`` more requests finish: the load is in full swing (again) before a fault."""
    count, end = run.done + 2 * run.concurrency, time.monotonic() + timeout
    while run.done < min(count, len(run.plans)) and time.monotonic() < end:
        await asyncio.sleep(0.05)


async def _busy_worker(stack: LocalStack, timeout: float = 60) -> int:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with contextlib.suppress(Exception):
            i = await asyncio.to_thread(stack.busiest_worker)
            if (await asyncio.to_thread(stack.worker_health, i))["running"] > 0:
                return i
        await asyncio.sleep(0.05)
    raise TimeoutError("no worker had running requests")


async def fault_worker_kill(stack: LocalStack, run: LoadRun, events: list, repeats: int = 3) -> None:
    for _ in range(repeats):
        await _settle(run)
        victim = await _busy_worker(stack)
        ev = FaultEvent("worker-kill", time.perf_counter(), details={"worker": victim})
        await asyncio.to_thread(stack.signal_worker, victim, signal.SIGKILL)
        ev.end = time.perf_counter()
        events.append(ev)
        await asyncio.to_thread(stack.start_worker, victim)
        # Its metrics port answers once the new process has loaded the model; then it heartbeats.
        await asyncio.to_thread(wait_for, lambda v=victim: stack.worker_health(v)["status"] == "ok", 300,
                                "the restarted worker")
        ev.details["worker_back_s"] = round(time.perf_counter() - ev.at, 3)


async def fault_worker_pause(stack: LocalStack, run: LoadRun, events: list, extra_s: float = 2.5) -> None:
    await _settle(run)
    victim = await _busy_worker(stack)
    ev = FaultEvent("worker-pause", time.perf_counter(), details={"worker": victim,
                                                                  "paused_s": stack.dead_after_s + extra_s})
    await asyncio.to_thread(stack.signal_worker, victim, signal.SIGSTOP)
    ev.end = time.perf_counter()
    events.append(ev)
    await asyncio.sleep(stack.dead_after_s + extra_s)
    await asyncio.to_thread(stack.signal_worker, victim, signal.SIGCONT)
    ev.details["resumed_at_s"] = round(time.perf_counter() - ev.at, 3)


async def fault_redis_restart(stack: LocalStack, run: LoadRun, events: list, outage_s: float = 2.0) -> None:
    await _settle(run)
    ev = FaultEvent("redis-restart", time.perf_counter(), details={"outage_s": outage_s})
    await asyncio.to_thread(stack.stop_redis)
    await asyncio.sleep(outage_s)
    await asyncio.to_thread(stack.start_redis)
    ev.end = time.perf_counter()
    events.append(ev)


async def fault_gateway_restart(stack: LocalStack, run: LoadRun, events: list, repeats: int = 2) -> None:
    for _ in range(repeats):
        await _settle(run)
        ev = FaultEvent("gateway-restart", time.perf_counter())
        ev.details["port_closed_s"] = round(await asyncio.to_thread(stack.restart_gateway), 3)
        ev.end = time.perf_counter()
        events.append(ev)


def _raw_request(stack: LocalStack, body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{stack.port}\r\n"
            f"Authorization: Bearer {stack.api_key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode() + data


async def _raw_connect(stack: LocalStack, rcvbuf: int | None = None):
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", stack.port))
    return await asyncio.open_connection(sock=sock, limit=1024)


def _sse_text(raw: bytes) -> tuple[int, str, bool]:
    """(status, content, saw [DONE]) of a raw chunked HTTP/1.1 SSE response."""
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/") else 0
    if b"chunked" in head.lower():
        out, rest = bytearray(), body
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line.split(b";")[0] or b"0", 16)
            if size == 0:
                break
            out += rest[:size]
            rest = rest[size + 2:]
        body = bytes(out)
    decoder, texts = SSEDecoder(), []
    for line in body.decode(errors="replace").split("\n"):
        payload = decoder.feed_line(line)
        if payload:
            for choice in json.loads(payload).get("choices") or ():
                texts.append((choice.get("delta") or {}).get("content") or "")
    return status, "".join(texts), decoder.done


async def fault_slow_client(stack: LocalStack, run: LoadRun, events: list, clients: int = 3,
                            read_s: float = 10.0) -> None:
    """Clients that read their stream a few hundred bytes at a time: others must not notice; they must get
    every token. Their text is checked against a normal request of the same input afterwards."""
    await _settle(run)
    plan = Plan(-1, "chat", True, PROMPTS[0], 64, logprobs=True)
    body = {**plan.body(), "top_logprobs": 5}  # ~0.5 KB per token: more than the socket buffers hold
    ev = FaultEvent("slow-client", time.perf_counter(), details={"clients": clients})
    events.append(ev)

    async def one() -> tuple[int, str, bool, float]:
        reader, writer = await _raw_connect(stack, rcvbuf=2048)
        writer.write(_raw_request(stack, body))
        await writer.drain()
        raw, t = bytearray(), time.perf_counter()
        while chunk := await reader.read(256):
            raw += chunk
            await asyncio.sleep(read_s / 160)  # ~40 KB in ~read_s seconds
        writer.close()
        return (*_sse_text(bytes(raw)), time.perf_counter() - t)

    outs = await asyncio.gather(*(one() for _ in range(clients)), return_exceptions=True)
    ev.end = time.perf_counter()
    async with httpx.AsyncClient(timeout=120) as client:
        ref = await send(client, stack.url, stack.api_key, Plan(-1, "chat", False, PROMPTS[0], 64), guard_s=120)
    ok = [o for o in outs if not isinstance(o, BaseException) and o[0] == 200 and o[2] and o[1] == ref.text]
    ev.details.update(complete_and_equal=len(ok), read_s=[round(o[3], 2) for o in ok],
                      errors=[repr(o)[:120] for o in outs if isinstance(o, BaseException)])


async def fault_vanishing_client(stack: LocalStack, run: LoadRun, events: list, streams: int = 24) -> None:
    """One client opens ``streams`` long streams (half read their first token), then every socket is reset
    at once, as when its process dies. The workers must abort every one of them (KV blocks freed)."""
    await _settle(run)

    def aborts() -> float:
        return sum(stack.worker_metric(i, "kernellab:request_success_total", "abort") for i in stack.live_workers())

    aborts0 = await asyncio.to_thread(aborts)
    body = Plan(-1, "chat", True, PROMPTS[1], 1000).body()
    conns = []
    for _ in range(streams):
        reader, writer = await _raw_connect(stack)
        writer.write(_raw_request(stack, body))
        conns.append((reader, writer))
    await asyncio.gather(*(w.drain() for _, w in conns))
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(60):
            await asyncio.gather(*(r.read(64) for r, _ in conns[: streams // 2]))
    ev = FaultEvent("vanishing-client", time.perf_counter(), details={"streams": streams})
    for _, writer in conns:
        sock = writer.get_extra_info("socket")
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST, not FIN
        writer.close()
    ev.end = time.perf_counter()
    events.append(ev)

    def aborted() -> float:
        return aborts() - aborts0

    with contextlib.suppress(TimeoutError):
        await asyncio.to_thread(wait_for, lambda: aborted() >= streams, 60, "the aborts", 0.05)
    ev.details.update(aborted=int(await asyncio.to_thread(aborted)),
                      all_aborted_s=round(time.perf_counter() - ev.at, 3))


FAULTS = {"worker-kill": fault_worker_kill, "worker-pause": fault_worker_pause, "redis-restart": fault_redis_restart,
          "gateway-restart": fault_gateway_restart, "slow-client": fault_slow_client,
          "vanishing-client": fault_vanishing_client}


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
        workers.append({"worker": h["worker_id"], "running": h["running"], "waiting": h["waiting"],
                        "active": h.get("active"), "held": h.get("held"), "kv_blocks_used": h.get("kv_blocks_used"),
                        "kv_blocks_total": h.get("kv_blocks_total"), "integrity": h.get("integrity")})
    gw = {}
    with contextlib.suppress(Exception):
        wait_for(lambda: stack.gateway_metric("kernellab_gateway_requests_in_flight") == 0, 30, "gateway idle")
    with contextlib.suppress(Exception):
        gw = {"in_flight": stack.gateway_metric("kernellab_gateway_requests_in_flight"),
              "queue_depth": stack.gateway_metric("kernellab_gateway_queue_depth")}
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
    out = {"kind": ev.kind, "at_s": round(ev.at - t0, 3), "injector_s": round(ev.end - ev.at, 3),
           "in_flight_at_fault": len(hit), "stall_s": round(max(stalls), 3) if stalls else 0.0,
           "recovery_s": round(min(later) - ev.at, 3) if later else None}
    out.update(ev.details)
    return out


def summarize(scenario: str, run: LoadRun, events: list[FaultEvent], idle: dict, config: dict) -> dict:
    from kernellab.results import provenance

    outcomes = Counter(r.outcome for r in run.results)
    attempts = [a for r in run.results for a in r.attempts]
    clean = Counter(a.code or "unknown" for a in attempts if a.outcome in ("error", "refused"))
    lost = [{"index": r.plan.index, "detail": a.detail} for r in run.results for a in r.attempts
            if a.outcome == "lost"]
    corrupt = _corrupt(run.results)
    completed = [r.final for r in run.results if r.outcome == "completed"]
    leaked = sum(int(w["kv_blocks_used"] or 0) for w in idle["workers"])
    stuck = sum(int(w["active"] or 0) + int(w["held"] or 0) for w in idle["workers"])
    integrity_ok = all(w["integrity"] == "ok" for w in idle["workers"])
    gateway_idle = not idle["gateway"] or (idle["gateway"].get("in_flight") == 0
                                           and idle["gateway"].get("queue_depth") == 0)
    checks = {"zero_lost": not lost and run.not_sent == 0, "zero_leaked_blocks": leaked == 0 and stuck == 0,
              "engine_integrity": integrity_ok, "zero_corrupt": not corrupt, "gateway_idle": gateway_idle,
              "all_workers_reported": len(idle["workers"]) == len(run.stack.worker_ports),
              "rejections_say_retry_after": all(a.retry_after for a in attempts if a.code == "rate_limit_exceeded")}
    faults = [_fault_figures(ev, run.results, run.t0) for ev in events]
    checks["faults_injected"] = bool(faults) == (scenario != "load") and not any("error" in f for f in faults)
    if scenario == "slow-client":
        checks["slow_clients_complete"] = all(f.get("complete_and_equal") == f.get("clients") for f in faults)
    if scenario == "vanishing-client":
        checks["vanished_streams_aborted"] = all(f.get("aborted", -1) >= f.get("streams", 0) for f in faults)
    if scenario == "load":
        checks["no_unexpected_failures"] = outcomes.get("failed", 0) == 0
    return {
        "schema": SCHEMA, "provenance": provenance("cpu"), "scenario": scenario, "config": config,
        "duration_s": round(run.duration, 3),
        "requests": {"total": run.sent, "completed": outcomes.get("completed", 0),
                     "cancelled": outcomes.get("cancelled", 0), "timed_out": outcomes.get("timed_out", 0),
                     "rejected": outcomes.get("rejected", 0), "failed": outcomes.get("failed", 0),
                     "lost": outcomes.get("lost", 0), "not_sent": run.not_sent, "attempts": len(attempts),
                     "corrupt": len(corrupt)},
        "clean_errors": dict(clean.most_common()),
        "lost_details": lost[:20], "corrupt_details": corrupt[:20],
        "throughput_rps": round(len(run.results) / max(run.duration, 1e-9), 3),
        "ttft_s": distribution(a.first - a.start for a in completed if a.first is not None),
        "e2e_s": distribution(a.end - a.start for a in completed),
        "faults": faults, "workers": idle["workers"], "gateway": idle["gateway"], "leaked_blocks": leaked,
        "checks": checks, "passed": all(checks.values()),
    }


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


def run_scenario(stack: LocalStack, scenario: str, *, requests: int, concurrency: int, seed: int = 0,
                 max_tokens: tuple[int, int] = (4, 8), time_limit_s: float = 1800.0, guard_s: float = 120.0,
                 fault_kwargs: dict | None = None, command: str = "") -> dict:
    """One scenario against a started stack; returns the report (not yet written)."""
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}; one of {', '.join(SCENARIOS)}")
    mixed = scenario == "load"
    plans = make_plans(requests, seed, max_tokens=max_tokens, cancel_frac=0.03 if mixed else 0.0,
                       deadline_frac=0.02 if mixed else 0.0)
    # Fault scenarios retry clean, retryable errors with backoff 0.25 s doubling to 2 s: 8 retries wait ~12 s.
    run = LoadRun(stack, plans, concurrency=concurrency, retries=0 if mixed else 8, guard_s=guard_s,
                  time_limit_s=time_limit_s)
    load_before = os.getloadavg()
    finishes_before = _finishes(stack) if scenario == "worker-pause" else None
    events = asyncio.run(_scenario(stack, scenario, run, fault_kwargs or {}))
    for name in [n for n, p in stack.procs.items() if n.startswith("worker") and p.poll() is None]:
        with contextlib.suppress(ProcessLookupError):
            stack.procs[name].send_signal(signal.SIGCONT)  # a fault that failed half-way must not leave one paused
    idle = idle_report(stack)
    config = {"requests": requests, "concurrency": concurrency, "seed": seed, "max_tokens": list(max_tokens),
              "workers": len(stack.worker_ports), "model": MODEL, "retries": run.retries, "guard_s": guard_s,
              "deadline_gateway_timeout_s": stack.deadline_s, "worker_dead_after_s": stack.dead_after_s,
              "max_waiting": int(stack.env["KERNELLAB_MAX_WAITING"]), "fault": fault_kwargs or {},
              "command": command,
              # The machine is shared: its load average before and after says how quiet the run was.
              "load_average": [round(x, 2) for x in (*load_before, *os.getloadavg())]}
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


# ===================================================================== reporting
def table(reports: list[dict]) -> str:
    """The Markdown table of docs/reliability.md from reports (one row per scenario)."""
    head = ("| scenario | requests | completed | cancelled | timed out | rejected (429) | failed | lost | corrupt "
            "| leaked blocks | req/s | TTFT p50 / p99 (s) | E2E p50 / p99 (s) | clean errors (attempts) | fault figures |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in reports:
        q = r["requests"]

        def pp(d):
            return f"{d['p50']:.3f} / {d['p99']:.3f}" if d.get("count") else "–"

        figs = "; ".join(_fault_text(f) for f in r["faults"]) or "–"
        clean = ", ".join(f"{k} {v}" for k, v in r["clean_errors"].items()) or "–"
        lines.append(f"| {r['scenario']} | {q['total']} | {q['completed']} | {q['cancelled']} | {q['timed_out']} | "
                     f"{q['rejected']} | {q['failed']} | {q['lost']} | {q['corrupt']} | {r['leaked_blocks']} | "
                     f"{r['throughput_rps']:.2f} | {pp(r['ttft_s'])} | {pp(r['e2e_s'])} | {clean} | {figs} |")
    return "\n".join(lines)


def _fault_text(f: dict) -> str:
    parts = [f"{f['kind']} at {f['at_s']:.0f}s: {f['in_flight_at_fault']} in flight, stall {f['stall_s']:.1f}s"]
    if f.get("recovery_s") is not None:
        parts.append(f"recovered {f['recovery_s']:.1f}s")
    for key in ("port_closed_s", "worker_back_s", "duplicate_finishes", "aborted", "all_aborted_s", "read_s",
                "complete_and_equal", "error"):
        if key in f:
            parts.append(f"{key} {f[key]}")
    return ", ".join(parts)


def brief(report: dict) -> dict:
    """A small dict for logs and test failure messages."""
    return {k: report[k] for k in ("scenario", "requests", "clean_errors", "lost_details", "corrupt_details",
                                   "faults", "workers", "gateway", "checks")}
