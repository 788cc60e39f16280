"""Helpers of the stack integration tests: a private redis-server, the stack as real processes, metrics."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest

from kernellab.services import stress
from kernellab.services.stress import free_port

API_KEY = "sk-integration"
MODEL = "smollm2-135m"


def wait_for(cond, timeout: float, what: str, interval: float = 0.1):
    """The stress tool's wait, polling twice as often (tests wait on short events)."""
    return stress.wait_for(cond, timeout, what, interval)


class RedisServer:
    """A redis-server we own: no persistence, so a restart comes back empty (the worst case)."""

    def __init__(self, workdir: Path, port: int | None = None):
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            pytest.fail("redis-server is not installed (apt-get install redis-server)")
        self.port = port or free_port()
        self.workdir = workdir
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        import redis

        wait_for(lambda: redis.Redis.from_url(self.url, socket_connect_timeout=0.2).ping(), 10, "redis-server")
        return self

    def restart(self) -> RedisServer:
        """The same port again, empty: the worst case for everything that talks to it."""
        self.stop()
        return self.start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


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
            KERNELLAB_HEARTBEAT_INTERVAL_S="0.5",
            KERNELLAB_WORKER_DEAD_AFTER_S="2.5",
            KERNELLAB_DEVICE="cpu",
            KERNELLAB_DTYPE="float32",
            KERNELLAB_NUM_KV_BLOCKS="512",
            KERNELLAB_MAX_NUM_SEQS="32",
            KERNELLAB_DRAIN_TIMEOUT_S="20",
        )
        # N workers share the cores: more torch threads than cores makes every step slower.
        self.env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))
        self.env.update(env)
        self.procs: dict[str, subprocess.Popen] = {}

    def _spawn(self, name: str, args: list[str], env: dict) -> None:
        log = (self.workdir / f"{name}.log").open("wb")
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "kernellab", *args],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def start(self, timeout: float = 300) -> Stack:
        for i, port in enumerate(self.worker_ports):
            self._spawn(f"worker-{i}", ["worker", "--metrics-port", str(port)], self.env)
        self._spawn(
            "gateway", ["gateway", "--port", str(self.port), "--metrics-port", str(self.gateway_metrics_port)], self.env
        )
        try:
            wait_for(
                lambda: self._alive() and self.ready(len(self.worker_ports)),
                timeout,
                "the stack's /ready",
                interval=0.5,
            )
        except Exception:
            self.stop()
            raise RuntimeError(f"stack did not start:\n{self.log_tail()}") from None
        return self

    def _alive(self) -> bool:
        dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None and n.startswith("gateway")}
        if dead:
            raise RuntimeError(f"exited: {dead}")
        return True

    def ready(self, workers: int = 1) -> bool:
        resp = httpx.get(f"{self.url}/ready", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=2)
        return resp.status_code == 200 and resp.json()["workers"] >= workers

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
        order = [n for n in self.procs if n == "gateway"] + [n for n in self.procs if n != "gateway"]
        for name in order:
            proc = self.procs[name]
            if proc.poll() is None:
                proc.terminate()
        for name in order:
            try:
                self.procs[name].wait(30)
            except subprocess.TimeoutExpired:
                self.procs[name].kill()
                self.procs[name].wait(5)

    def log_tail(self, lines: int = 30) -> str:
        out = []
        for name in self.procs:
            path = self.workdir / f"{name}.log"
            if path.exists():
                text = path.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"--- {name} ---\n" + "\n".join(text))
        return "\n".join(out)
