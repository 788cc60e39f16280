"""``kernellab gateway``: the FastAPI app under uvicorn, draining in-flight streams on SIGTERM.

With ``gateway_processes`` > 1 this process becomes a small supervisor: N gateway processes each bind the same
port with SO_REUSEPORT (the kernel spreads new connections evenly among them), each with its own event loop,
Redis clients and output router, so SSE framing, detokenization and JSON work scale with cores instead of
sharing one GIL. Redis is the only state they share. The supervisor serves their merged Prometheus metrics
(prometheus-client's multiprocess mode) on the gateway metrics port, forwards SIGTERM/SIGINT (each child
drains its own streams) and restarts a child that dies.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time

from kernellab.services.config import GatewaySettings

log = logging.getLogger("kernellab.gateway")

RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 5.0)  # a child that keeps dying is restarted ever more slowly
QUICK_DEATH_S = 10.0  # a child that exits this soon after its start did not come up …
QUICK_DEATHS_FATAL = 3  # … and this many times in a row means it cannot: the supervisor exits non-zero


def _configure_logging(settings: GatewaySettings) -> None:
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _listen_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve_one(settings: GatewaySettings, sock: socket.socket | None = None) -> None:
    """One gateway process: the app under uvicorn, on ``sock`` if given (a supervised child), else on
    ``settings.host:port``."""
    import uvicorn

    from kernellab.services.gateway.app import create_app

    app = create_app(settings, freeze_heap=settings.gc_freeze)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            # First signal: refuse new work (503 + /ready false) while uvicorn stops accepting and waits for
            # open streams, up to drain_timeout_s; uvicorn's own handling does the rest.
            gw = getattr(app.state, "gateway", None)
            if gw is not None and not gw.draining:
                log.info("signal %d: draining in-flight streams (up to %.0fs)", sig, settings.drain_timeout_s)
                gw.draining = True
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,
        timeout_graceful_shutdown=settings.drain_timeout_s or None,  # type: ignore[arg-type]  # uvicorn says int; a float works (wait_for)
        loop="auto",
        http="auto",
        lifespan="on",
        backlog=2048,
    )
    Server(config).run(sockets=[sock] if sock is not None else None)


def _die_with_parent() -> None:
    """Linux: SIGTERM this process when the supervisor dies, even by SIGKILL (no orphan keeps the port)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _child(settings: GatewaySettings, index: int) -> None:
    _die_with_parent()
    _configure_logging(settings)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the supervisor decides
    serve_one(settings, _listen_socket(settings.host, settings.port))


def supervise(settings: GatewaySettings) -> int:
    import multiprocessing as mp
    import shutil
    import tempfile

    from kernellab.runtime.request.registry import resolve_model

    resolve_model(settings.model)  # a configuration error stops here, not N times in the children
    n = settings.gateway_processes
    if settings.port == 0:
        raise SystemExit("gateway_processes > 1 needs a fixed port (the processes share it)")
    with socket.socket(socket.AF_INET6 if ":" in settings.host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((settings.host, settings.port))  # fails here, once, if anything (another tier too) holds it
    metrics_dir = tempfile.mkdtemp(prefix="kernellab-gateway-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # before any child imports prometheus_client
    child_settings = settings.model_copy(
        update={
            "gateway_processes": 1,
            "gateway_metrics_port": 0,
            "max_waiting": -(-settings.max_waiting // n) if settings.max_waiting else 0,
        }
    )
    ctx = mp.get_context("spawn")
    procs: list = [None] * n
    started_at = [0.0] * n
    quick_deaths = [0] * n  # deaths in a row within QUICK_DEATH_S of a start

    def start(i: int) -> None:
        p = ctx.Process(target=_child, args=(child_settings, i), name=f"gateway-{i}", daemon=False)
        p.start()
        procs[i], started_at[i] = p, time.monotonic()

    stopping = {"sig": None}

    def on_signal(signum, _frame):
        stopping["sig"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    metrics_server = _metrics_server(settings, procs)
    for i in range(n):
        start(i)
    log.info(
        "gateway supervisor: %d processes on %s:%d (SO_REUSEPORT), metrics on :%s",
        n,
        settings.host,
        settings.port,
        settings.gateway_metrics_port or "off",
    )
    code = 0
    try:
        while stopping["sig"] is None and code == 0:
            time.sleep(0.2)
            for i, p in enumerate(procs):
                if p.exitcode is None or stopping["sig"] is not None:
                    continue
                from prometheus_client import multiprocess

                multiprocess.mark_process_dead(p.pid)
                quick = time.monotonic() - started_at[i] < QUICK_DEATH_S
                quick_deaths[i] = quick_deaths[i] + 1 if quick else 0
                if quick_deaths[i] >= QUICK_DEATHS_FATAL:  # it cannot start (configuration, model): say so, exit
                    log.error(
                        "gateway process %d exited with %s %d times in a row right after starting; stopping",
                        i,
                        p.exitcode,
                        quick_deaths[i],
                    )
                    code = 1
                    break
                delay = RESTART_BACKOFF_S[min(quick_deaths[i], len(RESTART_BACKOFF_S) - 1)]
                log.error(
                    "gateway process %d (pid %d) exited with %s; restarting in %.1fs", i, p.pid, p.exitcode, delay
                )
                time.sleep(delay)
                start(i)
    finally:
        log.info("gateway supervisor: stopping %d processes", n)
        for p in procs:
            if p is not None and p.exitcode is None:
                os.kill(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + settings.drain_timeout_s + 5.0
        for p in procs:
            if p is not None:
                p.join(max(0.0, deadline - time.monotonic()))
                if p.exitcode is None:
                    p.kill()
                    p.join(5)
        if metrics_server is not None:
            metrics_server.stop()
        shutil.rmtree(metrics_dir, ignore_errors=True)
    return code


def _metrics_server(settings: GatewaySettings, procs: list):
    if not settings.gateway_metrics_port:
        return None
    from prometheus_client import CollectorRegistry, multiprocess

    from kernellab.services.observability import MetricsServer

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)

    def health() -> dict:
        alive = sum(1 for p in procs if p is not None and p.exitcode is None)
        return {"status": "ok" if alive == len(procs) else "degraded", "processes": len(procs), "alive": alive}

    return MetricsServer(settings.metrics_host, settings.gateway_metrics_port, registry, health).start()


def serve(settings: GatewaySettings) -> None:
    _configure_logging(settings)
    settings.pin_cpus()  # the supervised processes inherit it
    if settings.gateway_processes > 1:
        raise SystemExit(supervise(settings))
    serve_one(settings)


if __name__ == "__main__":
    serve(GatewaySettings())
