"""Helpers of the stack integration tests: a private redis-server, the stack as real processes, metrics."""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
import uuid
from pathlib import Path

import httpx
import pytest

from kernellab.services import processes
from kernellab.services.processes import Processes, free_port, ready_workers, share_cores, wait_ready
from kernellab.services.stress import CPU_STACK_ENV

API_KEY = "sk-integration"
MODEL = "smollm2-135m"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def wait_for(cond, timeout: float, what: str, interval: float = 0.1):
    """``kernellab.services.processes.wait_for``, polling twice as often (tests wait on short events)."""
    return processes.wait_for(cond, timeout, what, interval)


class RedisServer:
    """A redis-server we own: no persistence, so a restart comes back empty (the worst case)."""

    def __init__(self, workdir: Path, port: int | None = None):
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            pytest.fail("redis-server is not installed (apt-get install redis-server)")
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.processes = Processes(workdir)

    def start(self) -> RedisServer:
        self.processes.start_redis(self.port, self.binary)
        return self

    def restart(self) -> RedisServer:
        """The same port again, empty: the worst case for everything that talks to it."""
        self.stop()
        return self.start()

    def stop(self) -> None:
        self.processes.stop("redis", 10)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text → {"name{labels}": value} and {"name": value} for unlabelled series."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def metric(metrics: dict[str, float], name: str, **labels) -> float:
    """Sum of the series of ``name`` whose labels include ``labels``."""
    total = 0.0
    for key, value in metrics.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', rest))
        if all(found.get(k) == v for k, v in labels.items()):
            total += value
    return total


class Stack:
    """A gateway and N workers (``kernellab gateway`` / ``kernellab worker``) on one Redis."""

    def __init__(self, redis_url: str, workdir: Path, workers: int = 2, **env):
        self.workdir = workdir
        self.port, self.gateway_metrics_port = free_port(), free_port()
        self.worker_ports = [free_port() for _ in range(workers)]
        self.url = f"http://127.0.0.1:{self.port}"
        self.prefix = f"klit-{uuid.uuid4().hex[:8]}:"
        self.env = dict(
            os.environ,
            PYTHONUNBUFFERED="1",
            KERNELLAB_REDIS_URL=redis_url,
            KERNELLAB_MODEL=MODEL,
            KERNELLAB_KEY_PREFIX=self.prefix,
            KERNELLAB_API_KEYS=API_KEY,
            KERNELLAB_METRICS_HOST="127.0.0.1",
            **CPU_STACK_ENV,  # what `kernellab stress` runs: a dead worker is noticed within seconds
        )
        share_cores(self.env, workers)
        self.env.update(env)
        self.processes = Processes(workdir)
        self.procs = self.processes.procs  # name → process: worker-<i>, gateway (and what callers add)

    def _spawn(self, name: str, args: list[str], env: dict) -> None:
        self.processes.spawn(name, [sys.executable, "-m", "kernellab", *args], env)

    def start(self, timeout: float = 300) -> Stack:
        for i, port in enumerate(self.worker_ports):
            self._spawn(f"worker-{i}", ["worker", "--metrics-port", str(port)], self.env)
        self._spawn(
            "gateway", ["gateway", "--port", str(self.port), "--metrics-port", str(self.gateway_metrics_port)], self.env
        )
        try:
            wait_ready(
                self.url,
                len(self.worker_ports),
                timeout=timeout,
                watch={"gateway": self.procs["gateway"]},
                headers=AUTH,
            )
        except Exception:
            self.stop()
            raise RuntimeError(f"stack did not start:\n{self.log_tail()}") from None
        return self

    def ready(self, workers: int = 1) -> bool:
        return ready_workers(self.url, AUTH) >= workers

    def worker_metrics(self, i: int) -> dict[str, float]:
        return parse_metrics(httpx.get(f"http://127.0.0.1:{self.worker_ports[i]}/metrics", timeout=5).text)

    def gateway_metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(f"http://127.0.0.1:{self.gateway_metrics_port}/metrics", timeout=5).text)

    def live_workers(self) -> list[int]:
        return [i for i in range(len(self.worker_ports)) if self.procs[f"worker-{i}"].poll() is None]

    def kill_worker(self, i: int) -> None:
        proc = self.procs[f"worker-{i}"]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def openai(self, **kw):
        from openai import OpenAI

        kw = {"api_key": API_KEY, "max_retries": 0, "timeout": 120, **kw}
        return OpenAI(base_url=f"{self.url}/v1", **kw)

    def stop(self) -> None:
        """The gateway first (no new work), then everything else at once; 30 s each before SIGKILL."""
        self.processes.stop_all(("gateway",), 30)

    def log_tail(self, lines: int = 30) -> str:
        return self.processes.log_tail(lines)
