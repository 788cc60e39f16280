"""A load generator that is not the bottleneck: several client processes, raw keep-alive sockets, SSE parsed
just enough to time it.

A benchmark client must cost far less than the server it measures. httpx or the openai client spend a few
milliseconds of Python per request and more per event; at tens of thousands of tokens a second one such
process would be the limit. Here each process holds prepared request bytes, writes them on connections it
opened and warmed beforehand, and reads chunked SSE with a small parser; several processes (spawned, one
event loop each) share the requests round robin, start at one shared monotonic instant, and report their own
CPU use so the artifact can show they were not saturated.

Per request it records: the send time, the first event with text (TTFT), the arrival time of every event that
carried text (gaps between them = inter-chunk latency), the end, and ``usage.completion_tokens``.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import time
from collections.abc import Callable
from dataclasses import dataclass, field

CPU_SATURATED = 0.9  # a client process busier than this share of one core may have delayed what it timed


@dataclass
class RequestRecord:
    index: int
    sent: float = 0.0
    first: float | None = None
    end: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    response_id: str | None = None  # the completion's "id": the request id in the worker's step trace


def post_request(host: str, port: int, path: str, body: dict, api_key: str | None = None) -> bytes:
    """The bytes of a JSON POST on a keep-alive connection."""
    data = json.dumps(body, separators=(",", ":")).encode()
    auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n{auth}"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    return head.encode() + data


def completion_request(
    host: str, port: int, model: str, prompt_ids: list[int], max_tokens: int, api_key: str | None = None
) -> bytes:
    """A streaming /v1/completions request with token-id prompt (the OpenAI API allows arrays of ints), greedy
    and ``ignore_eos`` so the output length is exactly ``max_tokens``."""
    return post_request(
        host,
        port,
        "/v1/completions",
        {
            "model": model,
            "prompt": prompt_ids,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        api_key,
    )


class SSEConnection:
    """A keep-alive HTTP/1.1 connection that writes prepared request bytes and times the SSE reply."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port

    async def open(self) -> SSEConnection:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port, limit=1 << 22)
        return self

    async def warm(self) -> None:
        """A GET on the open connection, so the first request does not pay for a cold connection."""
        self.writer.write(f"GET /health HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n\r\n".encode())
        status = await self.reader.readline()
        if b" 200 " not in status:
            raise RuntimeError(f"/health answered {status!r}")
        length = 0
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        await self.reader.readexactly(length)

    async def stream(self, raw: bytes, rec: RequestRecord) -> None:
        rec.sent = time.perf_counter()
        self.writer.write(raw)
        status = await self.reader.readline()
        headers = []
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            headers.append(line)
        if b" 200 " not in status:
            body = await self.reader.read(4096)
            rec.error = f"{status.decode(errors='replace').strip()}: {body[:300].decode(errors='replace')}"
            rec.end = time.perf_counter()
            return
        buf = b""
        while True:
            size = int((await self.reader.readline()).strip(), 16)  # uvicorn streams chunked
            data = await self.reader.readexactly(size + 2)
            now = time.perf_counter()
            if size == 0:
                break
            buf += data[:-2]
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                if not event.startswith(b"data: {"):
                    continue
                obj = json.loads(event[6:])
                if rec.response_id is None:
                    rec.response_id = obj.get("id")
                if "error" in obj:
                    rec.error = json.dumps(obj["error"])[:300]
                    continue
                choices = obj.get("choices") or []
                if choices:
                    c = choices[0]
                    if c.get("text") or (c.get("delta") or {}).get("content"):
                        if rec.first is None:
                            rec.first = now
                        rec.chunk_times.append(now)
                    if c.get("finish_reason"):
                        rec.finish_reason = c["finish_reason"]
                if obj.get("usage"):
                    rec.completion_tokens = obj["usage"]["completion_tokens"]
        rec.end = time.perf_counter()

    def close(self) -> None:
        self.writer.close()


async def _run_client(host: str, port: int, requests: list[tuple[int, bytes]], pipe) -> None:
    conns = [await SSEConnection(host, port).open() for _ in requests]
    await asyncio.gather(*(c.warm() for c in conns))
    pipe.send("ready")
    start_at = pipe.recv()  # a shared perf_counter instant (CLOCK_MONOTONIC: one clock for all processes)
    while (delay := start_at - time.perf_counter()) > 0:
        await asyncio.sleep(min(delay, 0.001) if delay < 0.002 else delay - 0.001)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    records = [RequestRecord(i) for i, _raw in requests]
    results = await asyncio.gather(
        *(c.stream(raw, rec) for c, (_i, raw), rec in zip(conns, requests, records, strict=True)),
        return_exceptions=True,
    )
    for rec, res in zip(records, results, strict=True):
        if isinstance(res, BaseException):
            rec.error = f"{type(res).__name__}: {res}"
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    for c in conns:
        c.close()
    pipe.send({"records": records, "cpu_s": cpu, "wall_s": wall})


def _client_process(host: str, port: int, requests: list[tuple[int, bytes]], pipe) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    try:
        asyncio.run(_run_client(host, port, requests, pipe))
    except BaseException as exc:
        pipe.send({"fatal": f"{type(exc).__name__}: {exc}"})
        raise


def run_clients(
    host: str,
    port: int,
    requests: list[bytes],
    processes: int,
    timeout_s: float = 600.0,
    on_start: Callable[[], object] | None = None,
    server_down: Callable[[], str | None] | None = None,
) -> dict:
    """Send every request at once from ``processes`` client processes; returns ``{"t0", "records" (in request
    order), "clients": [{"cpu_s", "wall_s", "cpu_util"}], "max_client_cpu_util", "clients_saturated"}``.
    ``on_start``: called once every connection is open and warmed, just before the shared start instant (a
    server-side meter that must leave the warm-up out starts there). ``server_down``: asked about once a second
    while the clients run; a message (a server process exited) ends the run at once with it, instead of after
    ``timeout_s`` of clients waiting on streams nobody will finish."""
    ctx = mp.get_context("spawn")
    processes = max(1, min(processes, len(requests)))
    shares = [[(i, raw) for i, raw in enumerate(requests) if i % processes == k] for k in range(processes)]
    pipes, procs = [], []
    for share in shares:
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_client_process, args=(host, port, share, child), daemon=True)
        p.start()
        pipes.append(parent)
        procs.append(p)
    try:
        for pipe in pipes:
            if not pipe.poll(120):
                raise RuntimeError("a client process did not get ready")
            msg = pipe.recv()
            if msg != "ready":
                raise RuntimeError(f"client process failed: {msg}")
        if on_start is not None:
            on_start()
        t0 = time.perf_counter() + 0.05
        for pipe in pipes:
            pipe.send(t0)
        records: dict[int, RequestRecord] = {}
        clients = []
        deadline = time.monotonic() + timeout_s
        for pipe in pipes:
            while not pipe.poll(max(0.0, min(1.0, deadline - time.monotonic()))):
                down = server_down() if server_down is not None else None
                if down:
                    raise RuntimeError(f"the server went down while the clients ran: {down}")
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"a client process did not finish in {timeout_s:.0f}s")
            out = pipe.recv()
            if "fatal" in out:
                raise RuntimeError(f"client process failed: {out['fatal']}")
            records.update({r.index: r for r in out["records"]})
            clients.append(
                {
                    "requests": len(out["records"]),
                    "cpu_s": round(out["cpu_s"], 3),
                    "wall_s": round(out["wall_s"], 3),
                    "cpu_util": round(out["cpu_s"] / out["wall_s"], 3),
                }
            )
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    top = max(c["cpu_util"] for c in clients)
    return {
        "t0": t0,
        "records": [records[i] for i in range(len(requests))],
        "clients": clients,
        "max_client_cpu_util": top,
        "clients_saturated": top >= CPU_SATURATED,
    }
