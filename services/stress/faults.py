"""The faults of ``kernellab stress``, each run beside a ``LoadRun``: worker kill and pause, Redis and gateway
restarts, and the hostile clients (slow readers, vanishing streams) on raw sockets; ``FAULTS`` by scenario."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx

from kernellab.services.loadgen.sse import SSEDecoder
from kernellab.services.processes import wait_for
from kernellab.services.stress.client import PROMPTS, LoadRun, Plan, send
from kernellab.services.stress.processes import LocalStack


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
        await asyncio.to_thread(
            wait_for, lambda v=victim: stack.worker_health(v)["status"] == "ok", 300, "the restarted worker"
        )
        ev.details["worker_back_s"] = round(time.perf_counter() - ev.at, 3)


async def fault_worker_pause(stack: LocalStack, run: LoadRun, events: list, extra_s: float = 2.5) -> None:
    await _settle(run)
    victim = await _busy_worker(stack)
    ev = FaultEvent(
        "worker-pause", time.perf_counter(), details={"worker": victim, "paused_s": stack.dead_after_s + extra_s}
    )
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
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{stack.port}\r\n"
        f"Authorization: Bearer {stack.api_key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    ).encode() + data


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
            rest = rest[size + 2 :]
        body = bytes(out)
    decoder, texts = SSEDecoder(), []
    for line in body.decode(errors="replace").split("\n"):
        payload = decoder.feed_line(line)
        if payload:
            for choice in json.loads(payload).get("choices") or ():
                texts.append((choice.get("delta") or {}).get("content") or "")
    return status, "".join(texts), decoder.done


async def fault_slow_client(
    stack: LocalStack, run: LoadRun, events: list, clients: int = 3, read_s: float = 10.0
) -> None:
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
    ev.details.update(
        complete_and_equal=len(ok),
        read_s=[round(o[3], 2) for o in ok],
        errors=[repr(o)[:120] for o in outs if isinstance(o, BaseException)],
    )


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
    ev.details.update(
        aborted=int(await asyncio.to_thread(aborted)), all_aborted_s=round(time.perf_counter() - ev.at, 3)
    )


FAULTS: dict[str, Callable[..., Awaitable[None]]] = {
    "worker-kill": fault_worker_kill,
    "worker-pause": fault_worker_pause,
    "redis-restart": fault_redis_restart,
    "gateway-restart": fault_gateway_restart,
    "slow-client": fault_slow_client,
    "vanishing-client": fault_vanishing_client,
}
