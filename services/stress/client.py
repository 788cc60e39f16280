"""The load client of ``kernellab stress``: the request mix (``Plan``, ``make_plans``), one attempt and its
outcome (``Attempt``, ``send``), and the closed loop of clients (``Result``, ``LoadRun``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from dataclasses import dataclass, field

import httpx

from kernellab.services.loadgen.sse import SSEDecoder
from kernellab.services.stress.processes import MODEL, LocalStack

PROMPTS = (
    "What is the capital of France?",
    "Name three colors.",
    "Why is the sky blue?",
    "What does a CPU do?",
    "Write a haiku about the ocean.",
    "List three uses of copper.",
    "What is 12 times 12?",
    "Describe a cat in one sentence.",
    "Suggest a name for a bakery.",
    "What is photosynthesis?",
    "How do vaccines work?",
    "Give me a tip for learning to cook.",
)
RETRYABLE = frozenset(
    {
        "refused",
        "queue_unavailable",
        "service_unavailable",
        "draining",
        "no_worker",
        "rate_limit_exceeded",
        "dead_lettered",
        "protocol_gap",
    }
)


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
        body = {
            "model": MODEL,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "stream": self.stream,
            "ignore_eos": self.ignore_eos,
        }
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


def make_plans(
    n: int,
    seed: int = 0,
    *,
    max_tokens: tuple[int, int] = (4, 8),
    cancel_frac: float = 0.03,
    deadline_frac: float = 0.02,
    stream_frac: float = 0.5,
) -> list[Plan]:
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
        plans.append(
            Plan(
                i,
                endpoint,
                stream,
                rng.choice(PROMPTS),
                tokens,
                action,
                temperature,
                sample_seed,
                ignore_eos=action != "normal" or rng.random() < 0.8,
                logprobs=endpoint == "chat" and stream and rng.random() < 0.2,
            )
        )
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


async def send(
    client: httpx.AsyncClient, url: str, api_key: str, plan: Plan, *, guard_s: float, cancel_after: int = 2
) -> Attempt:
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
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
        # Closed before a status line, with a FIN or (the request still unread in the server's socket) a RST:
        # a draining uvicorn closes every connection it has not started a request on, and a listener closing
        # resets the connections in its backlog; whatever it started it finishes. So no status line means the
        # gateway never took the request: the connection was refused, and the client may send it again.
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

    def __init__(
        self,
        stack: LocalStack,
        plans: list[Plan],
        *,
        concurrency: int,
        retries: int = 0,
        guard_s: float = 120.0,
        time_limit_s: float = 1800.0,
    ):
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
