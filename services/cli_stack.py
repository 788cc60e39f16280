"""Stack commands: ``kernellab gateway``, ``kernellab worker`` (the single services compose runs) and
``kernellab up`` (Redis + gateway + N workers on this machine, until Ctrl-C).

Flags override ``KERNELLAB_*`` environment variables (pydantic-settings); a flag left out keeps the
environment's value or the default. Heavy imports stay inside the commands so ``kernellab --help`` is fast.
"""

from __future__ import annotations

from typing import Annotated

import typer

from kernellab.services.cli import app

Opt = typer.Option


def _settings(cls, **flags):
    return cls(**{k: v for k, v in flags.items() if v is not None})


@app.command(rich_help_panel="Serving stack")
def gateway(
    model: Annotated[str | None, Opt(help="registry name or hub id [env KERNELLAB_MODEL]")] = None,
    host: Annotated[str | None, Opt(help="[env KERNELLAB_HOST; default 127.0.0.1]")] = None,
    port: Annotated[int | None, Opt(help="[env KERNELLAB_PORT; default 8000]")] = None,
    redis_url: Annotated[str | None, Opt(help="[env KERNELLAB_REDIS_URL]")] = None,
    api_keys: Annotated[str | None, Opt(help="comma-separated [env KERNELLAB_API_KEYS]")] = None,
    api_key_file: Annotated[str | None, Opt(help="one key per line [env KERNELLAB_API_KEY_FILE]")] = None,
    metrics_port: Annotated[int | None, Opt(help="0: off [env KERNELLAB_GATEWAY_METRICS_PORT; default 9100]")] = None,
    max_waiting: Annotated[int | None, Opt(help="429 beyond this many waiting [env KERNELLAB_MAX_WAITING]")] = None,
    key_prefix: Annotated[str | None, Opt(help="Redis key prefix [env KERNELLAB_KEY_PREFIX; default kl:]")] = None,
    processes: Annotated[
        int | None, Opt(min=1, help="gateway processes sharing the port [env KERNELLAB_GATEWAY_PROCESSES; default 1]")
    ] = None,
) -> None:
    """The OpenAI-compatible gateway (FastAPI, no torch)."""
    from kernellab.services.config import GatewaySettings
    from kernellab.services.gateway.main import serve

    serve(
        _settings(
            GatewaySettings,
            model=model,
            host=host,
            port=port,
            redis_url=redis_url,
            api_keys=api_keys,
            api_key_file=api_key_file,
            gateway_metrics_port=metrics_port,
            max_waiting=max_waiting,
            key_prefix=key_prefix,
            gateway_processes=processes,
        )
    )


@app.command(rich_help_panel="Serving stack")
def worker(
    model: Annotated[str | None, Opt(help="registry name or hub id [env KERNELLAB_MODEL]")] = None,
    redis_url: Annotated[str | None, Opt(help="[env KERNELLAB_REDIS_URL]")] = None,
    device: Annotated[str | None, Opt(help="cpu | cuda | auto [env KERNELLAB_DEVICE]")] = None,
    dtype: Annotated[str | None, Opt(help="auto | float32 | bfloat16 | float16 [env KERNELLAB_DTYPE]")] = None,
    metrics_port: Annotated[int | None, Opt(help="0: off [env KERNELLAB_WORKER_METRICS_PORT; default 9200]")] = None,
    max_num_seqs: Annotated[int | None, Opt(help="[env KERNELLAB_MAX_NUM_SEQS]")] = None,
    max_model_len: Annotated[int | None, Opt(help="[env KERNELLAB_MAX_MODEL_LEN]")] = None,
    num_kv_blocks: Annotated[int | None, Opt(help="[env KERNELLAB_NUM_KV_BLOCKS]")] = None,
    worker_id: Annotated[str | None, Opt(help="consumer name, unique per live worker")] = None,
    key_prefix: Annotated[str | None, Opt(help="Redis key prefix [env KERNELLAB_KEY_PREFIX; default kl:]")] = None,
) -> None:
    """One engine worker: reads requests from Redis, runs the step loop, streams tokens back."""
    from kernellab.services.config import WorkerSettings
    from kernellab.services.worker.main import serve

    serve(
        _settings(
            WorkerSettings,
            model=model,
            redis_url=redis_url,
            device=device,
            dtype=dtype,
            worker_metrics_port=metrics_port,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            num_kv_blocks=num_kv_blocks,
            worker_id=worker_id,
            key_prefix=key_prefix,
        )
    )


@app.command(rich_help_panel="Serving stack")
def up(
    model: Annotated[str, Opt(help="registry name or hub id")] = "smollm2-135m",
    workers: Annotated[int, Opt(min=1, help="worker processes")] = 1,
    gateway_processes: Annotated[
        int | None, Opt(min=1, help="gateway processes sharing the port [env KERNELLAB_GATEWAY_PROCESSES; default 1]")
    ] = None,
    host: Annotated[str, Opt(help="gateway address")] = "127.0.0.1",
    port: Annotated[int, Opt(help="gateway port")] = 8000,
    no_auth: Annotated[bool, Opt("--no-auth", help="serve without an API key")] = False,
    metrics_port: Annotated[
        int | None, Opt(help="gateway metrics port, 0: off [env KERNELLAB_GATEWAY_METRICS_PORT; default 9100]")
    ] = None,
    worker_metrics_port: Annotated[
        int | None,
        Opt(
            help="first worker's metrics port, worker i uses this + i [env KERNELLAB_WORKER_METRICS_PORT; default 9200]"
        ),
    ] = None,
    redis_url: Annotated[str | None, Opt(help="[env KERNELLAB_REDIS_URL; default redis://127.0.0.1:6379/0]")] = None,
    ready_timeout: Annotated[float, Opt(help="seconds to wait for /ready")] = 600.0,
) -> None:
    """Redis (the one at KERNELLAB_REDIS_URL, else a private redis-server), the gateway and N workers on this
    machine; prints the URL, the API key and a curl example; Ctrl-C stops everything it started."""
    raise typer.Exit(
        _StackUp(
            model=model,
            workers=workers,
            gateway_processes=gateway_processes,
            host=host,
            port=port,
            no_auth=no_auth,
            metrics_port=metrics_port,
            worker_metrics_port=worker_metrics_port,
            redis_url=redis_url,
            ready_timeout=ready_timeout,
        ).run()
    )


class _StackUp:
    """Children run in their own sessions so Ctrl-C reaches only us; we stop them in order (gateway first,
    so no new work arrives, then the workers), each with SIGTERM and a grace period before SIGKILL."""

    def __init__(
        self,
        *,
        model,
        workers,
        gateway_processes,
        host,
        port,
        no_auth,
        metrics_port,
        worker_metrics_port,
        redis_url,
        ready_timeout,
    ):
        import os

        self.model, self.workers, self.host, self.port = model, workers, host, port
        self.gateway_processes = gateway_processes
        self.no_auth = no_auth
        env = os.environ
        self.metrics_port = (
            int(env.get("KERNELLAB_GATEWAY_METRICS_PORT", 9100)) if metrics_port is None else metrics_port
        )
        self.worker_metrics_port = (
            int(env.get("KERNELLAB_WORKER_METRICS_PORT", 9200)) if worker_metrics_port is None else worker_metrics_port
        )
        self.redis_url = redis_url or os.environ.get("KERNELLAB_REDIS_URL") or "redis://127.0.0.1:6379/0"
        self.ready_timeout = ready_timeout
        self.processes = None  # kernellab.services.processes.Processes, logs in a temporary folder
        self.logs = None

    def run(self) -> int:
        import signal
        import tempfile
        from pathlib import Path

        from rich.console import Console

        from kernellab.services.processes import Processes

        self.out = Console(highlight=False)
        self.logs = Path(tempfile.mkdtemp(prefix="kernellab-up-"))
        self.processes = Processes(self.logs)
        stop = {"signal": None}

        def on_signal(signum, _frame):
            stop["signal"] = signum

        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        try:
            key = self._start()
            if not self._wait_ready(stop):
                return 1
            self._banner(key)
            while stop["signal"] is None:
                dead = self.processes.exited()
                if dead:
                    name, code = next(iter(dead.items()))
                    self.out.print(f"[red]{name} exited with code {code}[/]; stopping (logs in {self.logs})")
                    self._tail(name)
                    return 1
                import time

                time.sleep(0.5)
            self.out.print("stopping…")
            return 0
        finally:
            self._stop_all()

    def _start(self) -> str | None:
        import os
        import secrets
        import shutil
        import sys

        from kernellab.services.processes import free_port, redis_answers, share_cores

        env = dict(os.environ, KERNELLAB_MODEL=self.model, PYTHONUNBUFFERED="1")
        share_cores(env, self.workers)
        device = env.get("KERNELLAB_DEVICE", "auto")
        on_cpu = device == "cpu" or (device == "auto" and not os.path.exists("/dev/nvidia0"))
        if on_cpu:
            # On a CPU the workers' steps would otherwise delay the gateway's and Redis' short jobs (delivering
            # tokens, taking requests): they run niced, which costs them nothing when they run alone.
            env.setdefault("KERNELLAB_NICE", "10")
        if not redis_answers(self.redis_url):
            binary = shutil.which("redis-server")
            if binary is None:
                raise typer.BadParameter(f"no Redis answers at {self.redis_url} and redis-server is not installed")
            self.redis_url = self.processes.start_redis(free_port(), binary, env)
            self.out.print(f"started a private redis-server at {self.redis_url}")
        env["KERNELLAB_REDIS_URL"] = self.redis_url
        key = None
        if not self.no_auth:
            key = (env.get("KERNELLAB_API_KEYS") or "").split(",")[0].strip() or None
            if key is None and not env.get("KERNELLAB_API_KEY_FILE"):
                key = "sk-kl-" + secrets.token_urlsafe(18)
                env["KERNELLAB_API_KEYS"] = key
        else:
            env["KERNELLAB_API_KEYS"] = ""
            env.pop("KERNELLAB_API_KEY_FILE", None)
        for i in range(self.workers):
            wport = self.worker_metrics_port + i if self.worker_metrics_port else 0
            self._spawn(
                f"worker-{i}",
                [sys.executable, "-m", "kernellab.services.worker"],
                dict(env, KERNELLAB_WORKER_METRICS_PORT=str(wport)),
            )
        self._spawn(
            "gateway",
            [sys.executable, "-m", "kernellab.services.gateway"],
            dict(
                env,
                KERNELLAB_HOST=self.host,
                KERNELLAB_PORT=str(self.port),
                KERNELLAB_GATEWAY_METRICS_PORT=str(self.metrics_port),
                **({"KERNELLAB_GATEWAY_PROCESSES": str(self.gateway_processes)} if self.gateway_processes else {}),
            ),
        )
        self.out.print(f"starting the gateway and {self.workers} worker(s) for {self.model} (logs in {self.logs})")
        return key

    def _spawn(self, name: str, cmd: list[str], env: dict) -> None:
        self.processes.spawn(name, cmd, env)

    def _wait_ready(self, stop) -> bool:
        from kernellab.services.processes import ProcessExited, wait_ready

        try:
            return wait_ready(
                f"http://{_client_host(self.host)}:{self.port}",
                timeout=self.ready_timeout,
                watch=self.processes.procs,
                cancelled=lambda: stop["signal"] is not None,
            )
        except ProcessExited as exited:
            self.out.print(f"[red]{exited.name} exited with code {exited.returncode} while starting[/]")
            self._tail(exited.name)
        except TimeoutError:
            self.out.print(f"[red]not ready after {self.ready_timeout:.0f}s[/] (logs in {self.logs})")
        return False

    def _banner(self, key: str | None) -> None:
        import json

        base = f"http://{_client_host(self.host)}:{self.port}"
        auth = f" -H 'Authorization: Bearer {key}'" if key else ""
        self.out.print(f"[bold green]kernellab is up[/]: {base}/v1  (model {self.model}, {self.workers} worker(s))")
        self.out.print(
            f"API key: {key}"
            if key
            else "API key: none (--no-auth)"
            if self.no_auth
            else "API key: from KERNELLAB_API_KEY_FILE"
        )
        if self.metrics_port:
            wm = ", ".join(f"{self.worker_metrics_port + i}" for i in range(self.workers))
            self.out.print(f"metrics: gateway :{self.metrics_port}/metrics, workers :{wm}/metrics")
        body = json.dumps({"model": self.model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32})
        self.out.print(
            f"try:\n  curl {base}/v1/chat/completions{auth} -H 'Content-Type: application/json' -d '{body}'",
            soft_wrap=True,
        )
        self.out.print("Ctrl-C stops everything.")

    def _tail(self, name: str, lines: int = 20) -> None:
        for line in self.processes.log_lines(name, lines):
            self.out.print(f"  {name}| {line}", markup=False)

    def _stop_all(self) -> None:
        for name in self.processes.stop_all(("gateway", "worker", "redis"), grace=15):
            self.out.print(f"{name} did not stop in 15 s: killed it (and its process group)")


def _client_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
