"""The stack of ``kernellab stress`` as real processes: ``LocalStack`` (a private redis-server, the workers
and two gateways on 127.0.0.1 free ports), started and stopped with ``kernellab.services.processes``."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
import uuid
from pathlib import Path

import httpx

from kernellab.services.processes import (
    Processes,
    free_port,
    ready_workers,
    share_cores,
    wait_for,
    wait_ready,
)

MODEL = "smollm2-135m"
# A small CPU stack that notices a dead worker within seconds (its heartbeats every 0.5 s); the integration
# tests' stack runs with the same settings.
CPU_STACK_ENV = {
    "KERNELLAB_HEARTBEAT_INTERVAL_S": "0.5",
    "KERNELLAB_WORKER_DEAD_AFTER_S": "2.5",
    "KERNELLAB_DEVICE": "cpu",
    "KERNELLAB_DTYPE": "float32",
    "KERNELLAB_NUM_KV_BLOCKS": "512",
    "KERNELLAB_MAX_NUM_SEQS": "32",
    "KERNELLAB_DRAIN_TIMEOUT_S": "20",
}


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
            **CPU_STACK_ENV,
            KERNELLAB_MAX_WAITING=str(max_waiting),
            KERNELLAB_FILES_DIR=str(self.workdir / "files"),
        )
        share_cores(self.env, workers)
        self.env.pop("KERNELLAB_METRICS_HOST", None)  # the default (127.0.0.1), which the security tests check
        self.env.update(env or {})
        self.processes = Processes(self.workdir)
        self.procs = self.processes.procs  # name → process: worker-<i>, gateway, gateway-deadline, redis
        redis_binary = shutil.which("redis-server")
        if redis_binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.redis_binary = redis_binary

    @property
    def dead_after_s(self) -> float:
        return float(self.env["KERNELLAB_WORKER_DEAD_AFTER_S"])

    def _spawn(self, name: str, cmd: list[str], env: dict | None = None) -> None:
        self.processes.spawn(name, cmd, env or self.env)

    def start_redis(self) -> None:
        self.processes.start_redis(self.redis_port, self.redis_binary, self.env)

    def stop_redis(self) -> None:
        self.processes.stop("redis", 10)

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
        return ready_workers(url or self.url, self.auth)

    def wait_ready(self, workers: int, timeout: float = 120) -> None:
        """Both gateways count ``workers`` live workers; a gateway that exits meanwhile fails at once."""
        gateways = {n: p for n, p in self.procs.items() if n.startswith("gateway")}
        deadline = time.monotonic() + timeout
        for url in [self.url] + ([self.deadline_url] if self.deadline_s else []):
            left = max(0.0, deadline - time.monotonic())
            wait_ready(url, workers, timeout=left, watch=gateways, headers=self.auth)

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
        return max(running, key=running.__getitem__)

    def signal_worker(self, i: int, sig: int) -> None:
        self.procs[f"worker-{i}"].send_signal(sig)
        if sig == signal.SIGKILL:
            self.procs[f"worker-{i}"].wait(10)

    def restart_gateway(self) -> float:
        """SIGTERM (drain), wait for the exit, start a new process on the same port; seconds the port was shut."""
        self.processes.stop("gateway", 60)
        down = time.monotonic()
        self.start_gateway()
        wait_for(lambda: self.ready_workers() >= 1, 120, "the new gateway's /ready", interval=0.1)
        return time.monotonic() - down

    def stop(self) -> None:
        """The gateways, then the workers, then Redis: each group SIGTERM'd at once, 30 s before SIGKILL."""
        self.processes.stop_all(("gateway", "worker", "redis"), 30)

    def log_tail(self, lines: int = 25) -> str:
        return self.processes.log_tail(lines)

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
