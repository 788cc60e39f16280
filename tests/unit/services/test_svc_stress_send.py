"""How the stress client classifies one attempt, against real servers on 127.0.0.1 that misbehave on purpose:
a connection closed or reset before a status line was never taken (refused, retried), one cut after its
status line lost a request, an error body that is not an OpenAI object is lost, a clean one is an error.
Also ``free_port``: ports below the kernel's ephemeral range, never the same twice."""

from __future__ import annotations

import asyncio
import socket
import struct

import httpx
import pytest

from kernellab.services.processes import _ephemeral_range, free_port
from kernellab.services.stress.client import RETRYABLE, Plan, send

PLAN = Plan(0, "chat", True, "hi", 4)
SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


async def _attempt(handler, plan: Plan = PLAN):
    """``send`` once to a server whose every connection runs ``handler(reader, writer)``."""
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(10, connect=5)) as client:
            return await send(client, f"http://127.0.0.1:{port}", "sk-x", plan, guard_s=10)
    finally:
        server.close()


async def _read_request(reader: asyncio.StreamReader) -> None:
    await reader.readuntil(b"\r\n\r\n")


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with SO_LINGER 0: the peer gets a RST, as it does from a server that closes with unread data."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@pytest.mark.parametrize("stream", [True, False])
def test_a_reset_before_the_status_line_is_refused_and_retryable(stream):
    async def handler(reader, writer):
        await _read_request(reader)
        _reset(writer)

    a = asyncio.run(_attempt(handler, Plan(0, "chat", stream, "hi", 4)))
    assert (a.outcome, a.code) == ("refused", "refused"), a.detail
    assert a.code in RETRYABLE and ("ReadError" in a.detail or "RemoteProtocolError" in a.detail)


def test_a_close_before_the_status_line_is_refused():
    async def handler(reader, writer):
        await _read_request(reader)
        writer.close()

    a = asyncio.run(_attempt(handler))
    assert (a.outcome, a.code) == ("refused", "refused"), a.detail


def test_a_stream_cut_after_its_status_line_is_lost():
    async def handler(reader, writer):
        await _read_request(reader)
        chunk = b'data: {"choices":[{"index":0,"delta":{"content":"Hel"}}]}\n\n'
        writer.write(SSE_HEAD + f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)
        _reset(writer)

    a = asyncio.run(_attempt(handler))
    assert a.outcome == "lost" and a.status == 200, a.detail
    assert a.code is None


def test_an_error_status_without_an_openai_error_object_is_lost():
    async def handler(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 11\r\nconnection: close\r\n\r\nbad gateway")
        await writer.drain()
        writer.close()

    a = asyncio.run(_attempt(handler))
    assert (a.outcome, a.status) == ("lost", 502) and "without an OpenAI error object" in a.detail


def test_an_openai_error_object_is_a_clean_error_with_its_code_and_retry_after():
    body = b'{"error":{"message":"busy","type":"rate_limit_error","code":"rate_limit_exceeded","param":null}}'
    head = f"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\nretry-after: 1\r\ncontent-length: {len(body)}\r\n\r\n"

    async def handler(reader, writer):
        await _read_request(reader)
        writer.write(head.encode() + body)
        await writer.drain()
        writer.close()

    a = asyncio.run(_attempt(handler))
    assert (a.outcome, a.code, a.status, a.retry_after) == ("error", "rate_limit_exceeded", 429, 1.0)


def test_free_ports_lie_below_the_ephemeral_range_and_are_never_handed_out_twice():
    low, _ = _ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    if low > 12_000:
        assert all(10_000 <= p < low for p in ports), ports
    for p in ports[:5]:  # free now: a server can bind each
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
