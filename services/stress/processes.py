"""The stack of ``kernellab stress`` as real processes: ``LocalStack`` (a private redis-server, the workers
and two gateways on 127.0.0.1 free ports), with ``free_port`` and ``wait_for``."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx

MODEL = "smollm2-135m"


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


class LocalStack:
    """Redis + ``workers`` workers + a gateway + a short-deadline gateway, all ours, on 127.0.0.1."""

    def __init__(
        self,
        workdir: Path,
        *,
        workers: int = 2,
        api_key: str = "sk-stress",
        deadline_s: float = 1.0,
        max_waiting: int = 256,
        env: dict | None = None,
    ):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.api_key, self.deadline_s = api_key, deadline_s
        self.redis_port, self.port, self.deadline_port = free_port(), free_port(), free_port()
        self.gateway_metrics_port = free_port()
        self.worker_ports = [free_port() for _ in range(workers)]
        self.url, self.deadline_url = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{self.deadline_port}"
        self.redis_url = f"redis://127.0.0.1:{self.redis_port}/0"
        self.env = dict(
            os.environ,
            PYTHONUNBUFFERED="1",
            KERNELLAB_REDIS_URL=self.redis_url,
            KERNELLAB_MODEL=MODEL,
            KERNELLAB_KEY_PREFIX=f"kls-{uuid.uuid4().hex[:8]}:",
            KERNELLAB_API_KEYS=api_key,
            KERNELLAB_API_KEY_FILE="",
            KERNELLAB_HEARTBEAT_INTERVAL_S="0.5",
            KERNELLAB_WORKER_DEAD_AFTER_S="2.5",
            KERNELLAB_DEVICE="cpu",
            KERNELLAB_DTYPE="float32",
            KERNELLAB_NUM_KV_BLOCKS="512",
            KERNELLAB_MAX_NUM_SEQS="32",
            KERNELLAB_DRAIN_TIMEOUT_S="20",
            KERNELLAB_MAX_WAITING=str(max_waiting),
            KERNELLAB_FILES_DIR=str(self.workdir / "files"),
        )
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
        self.procs[name] = subprocess.Popen(
            cmd, env=env or self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()

    def start_redis(self) -> None:
        self._spawn(
            "redis",
            [
                self.redis_binary,
                "--port",
                str(self.redis_port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
            ],
        )
        import redis

        wait_for(lambda: redis.Redis.from_url(self.redis_url, socket_connect_timeout=0.2).ping(), 10, "redis-server")

    def stop_redis(self) -> None:
        self._stop("redis", signal.SIGTERM, 10)

    def start_worker(self, i: int) -> None:
        self._spawn(
            f"worker-{i}",
            [
                sys.executable,
                "-m",
                "kernellab",
                "worker",
                "--metrics-port",
                str(self.worker_ports[i]),
                "--worker-id",
                f"stress-w{i}-{uuid.uuid4().hex[:4]}",
            ],
        )

    def start_gateway(self, deadline: bool = False) -> None:
        if deadline:
            env = dict(self.env, KERNELLAB_REQUEST_TIMEOUT_S=str(self.deadline_s))
            self._spawn(
                "gateway-deadline",
                [
                    sys.executable,
                    "-m",
                    "kernellab",
                    "gateway",
                    "--port",
                    str(self.deadline_port),
                    "--metrics-port",
                    "0",
                ],
                env,
            )
        else:
            self._spawn(
                "gateway",
                [
                    sys.executable,
                    "-m",
                    "kernellab",
                    "gateway",
                    "--port",
                    str(self.port),
                    "--metrics-port",
                    str(self.gateway_metrics_port),
                ],
            )

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
        return sum(
            float(line.rpartition(" ")[2])
            for line in text.splitlines()
            if line.startswith(name) and not line.startswith("#")
        )

    def worker_metric(self, i: int, name: str, label: str = "") -> float:
        text = httpx.get(f"http://127.0.0.1:{self.worker_ports[i]}/metrics", timeout=2).text
        return sum(
            float(line.rpartition(" ")[2]) for line in text.splitlines() if line.startswith(name) and label in line
        )

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
