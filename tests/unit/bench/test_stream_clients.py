"""The load generator's clients against a server on 127.0.0.1 that stops answering: a run whose server process is
gone ends as soon as ``server_down`` says so, not after the clients' whole timeout."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kernellab.bench.stream_clients import completion_request, run_clients


class _HangingServer:
    """Answers ``GET /health`` and then never answers a POST: a gateway whose worker died with the streams open."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        assert self.ready.wait(10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while line := await reader.readline():
                if line.startswith(b"GET /health"):
                    while await reader.readline() not in (b"\r\n", b""):
                        pass
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                    await writer.drain()
                # a POST is read and left unanswered

        async def start() -> None:
            self.server = await asyncio.start_server(handle, "127.0.0.1", 0)
            self.port = self.server.sockets[0].getsockname()[1]
            self.ready.set()

        self.loop.run_until_complete(start())
        self.loop.run_forever()

    def close(self) -> None:
        async def shutdown() -> None:
            self.server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def server():
    s = _HangingServer()
    yield s
    s.close()


def test_a_dead_server_process_ends_the_run_at_once(server):
    raws = [completion_request("127.0.0.1", server.port, "m", [1, 2, 3], 4) for _ in range(4)]
    t0 = time.monotonic()
    died_at = t0 + 1.0

    def down() -> str | None:
        return "worker0 exited with code -9" if time.monotonic() > died_at else None

    with pytest.raises(RuntimeError, match="worker0 exited with code -9"):
        run_clients("127.0.0.1", server.port, raws, 2, timeout_s=120, server_down=down)
    assert time.monotonic() - t0 < 60  # spawning the clients takes seconds; the 120 s timeout never ran out


def test_without_a_watch_a_hung_run_still_ends_at_its_timeout(server):
    raws = [completion_request("127.0.0.1", server.port, "m", [1, 2, 3], 4)]
    with pytest.raises(RuntimeError, match="did not finish in 2s"):
        run_clients("127.0.0.1", server.port, raws, 1, timeout_s=2)
