"""A gateway tier of several processes on one port (``KERNELLAB_GATEWAY_PROCESSES``): real processes, a real
Redis, the official openai client. Requests are served through every process, the supervisor's metrics are the
merge of its children's, a child killed with SIGKILL is replaced, and SIGTERM stops the whole tier."""

from __future__ import annotations

import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from tests.support.stack import Stack, metric, wait_for

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture()
def tier(private_redis, tmp_path):
    """Two gateway processes in front of one worker running the deterministic test engine (no model load)."""
    s = Stack(
        private_redis.url,
        tmp_path,
        workers=1,
        KERNELLAB_GATEWAY_PROCESSES="2",
        KERNELLAB_ENGINE="tests.support.fake_engine:FakeEngine",
        FAKE_STEP_S="0.005",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    s.start(timeout=120)
    yield s
    s.stop()


def children(s: Stack) -> list[psutil.Process]:
    """The gateway processes under the supervisor (multiprocessing's resource tracker is not one)."""
    sup = psutil.Process(s.procs["gateway"].pid)
    return [c for c in sup.children() if "spawn_main" in " ".join(c.cmdline())]


def complete_many(s: Stack, n: int) -> list[str]:
    def one(i: int) -> str:
        # A fresh client per request: new connections, so the kernel spreads them over the tier's sockets.
        stream = s.openai().completions.create(
            model="smollm2-135m",
            prompt=f"request {i}",
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage = "", None
        for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            usage = chunk.usage or usage
        assert usage is not None and usage.completion_tokens == 6
        return text

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(n)))


def test_requests_are_served_by_the_tier_and_metrics_merge(tier):
    assert len(children(tier)) == 2
    before = metric(tier.gateway_metrics(), "kernellab_gateway_http_requests_total", route="/v1/completions")
    texts = complete_many(tier, 16)
    assert all(texts)
    # The supervisor's /metrics merges what each process counted: every request once.
    after = metric(
        tier.gateway_metrics(), "kernellab_gateway_http_requests_total", route="/v1/completions", status="200"
    )
    assert after - before == 16
    assert metric(tier.gateway_metrics(), "kernellab_gateway_requests_in_flight") == 0


def test_a_killed_gateway_process_is_replaced(tier):
    first = children(tier)
    victim = first[0]
    victim.send_signal(signal.SIGKILL)
    wait_for(
        lambda: len(children(tier)) == 2 and victim.pid not in {c.pid for c in children(tier)},
        30,
        "a replacement gateway process",
    )
    wait_for(lambda: tier.ready(1), 30, "/ready after the restart")
    assert all(complete_many(tier, 8))


def test_sigterm_stops_the_whole_tier(tier):
    procs = children(tier)
    tier.procs["gateway"].send_signal(signal.SIGTERM)
    tier.procs["gateway"].wait(60)
    deadline = time.monotonic() + 10
    while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in procs)
    with socket.socket() as sock:  # the port is free again
        sock.bind(("127.0.0.1", tier.port))
