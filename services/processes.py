"""The stack's processes on this machine: starting them (each in its own session, with a log file), a private
redis-server, waiting for Redis or the gateway's ``/ready``, and stopping them (SIGTERM, a grace period, then
SIGKILL to the whole process group). One home for what ``kernellab up``, ``kernellab stress``, the serving
benchmarks and the integration tests all do.

No torch here (the import contract): the workers run as processes, never in this one.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands to outgoing connections and to ``bind(port 0)`` (Linux: ip_local_port_range)."""
    with contextlib.suppress(OSError, ValueError):
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[:2]
        return int(low), int(high)
    return 32768, 60999


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now, for a server started a moment later.

    Picked at random below the kernel's ephemeral range, never twice in one process. A port from
    ``bind(port 0)`` comes from that range, the one the kernel also gives every outgoing connection (each
    Redis or HTTP client socket), so between our check and the server's bind a client of the stack itself
    could take it: a server that then dies with "Address already in use". Below the range only another
    server could take it, and the pick is random over thousands of ports."""
    low, high = _ephemeral_range()
    span = (10_000, low - 1) if low > 12_000 else (high + 1, 65_535)
    for _ in range(200 if span[1] - span[0] > 1_000 else 0):
        port = random.randint(*span)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as s:  # a crowded machine: the kernel's own pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(cond: Callable, timeout: float, what: str, interval: float = 0.2):
    """``cond()``'s first truthy result, polling every ``interval`` s; an exception counts as not yet.
    TimeoutError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(Exception):
            result = cond()
            if result:
                return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def share_cores(env: dict, workers: int) -> None:
    """Workers share this machine's cores: more torch threads than cores slows every step down. An
    OMP_NUM_THREADS already in ``env`` wins."""
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))


# ------------------------------------------------------------------------------------------------ Redis
def redis_server_command(binary: str, port: int, workdir: Path) -> list[str]:
    """A redis-server on 127.0.0.1 without persistence: a restart comes back empty (the worst case for the
    stack), and nothing but its log is left in ``workdir``."""
    return [
        binary,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(workdir),
    ]


def redis_answers(url: str, timeout: float = 1.0) -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout).ping())
    except (redis.RedisError, OSError):
        return False


# ------------------------------------------------------------------------------------------------ the gateway
def ready_workers(base_url: str, headers: Mapping[str, str] | None = None, timeout: float = 2.0) -> int:
    """Live workers the gateway at ``base_url`` counts on ``/ready``; 0 while it is not ready. The count is shown
    to a key holder only (``headers``): without a key, a ready gateway counts as one."""
    import httpx

    resp = httpx.get(f"{base_url}/ready", headers=headers, timeout=timeout)
    return int(resp.json().get("workers", 1)) if resp.status_code == 200 else 0


class ProcessExited(RuntimeError):
    def __init__(self, name: str, returncode: int):
        super().__init__(f"{name} exited with code {returncode}")
        self.name, self.returncode = name, returncode


def wait_ready(
    base_url: str,
    workers: int = 1,
    *,
    timeout: float,
    watch: Mapping[str, subprocess.Popen] | None = None,
    headers: Mapping[str, str] | None = None,
    interval: float = 0.5,
    cancelled: Callable[[], bool] | None = None,
) -> bool:
    """Poll the gateway's ``/ready`` until it counts ``workers`` live workers: True; False as soon as
    ``cancelled()`` is true. ProcessExited as soon as a process of ``watch`` (name → process) has exited,
    TimeoutError after ``timeout`` s."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        for name, proc in (watch or {}).items():
            if proc.poll() is not None:
                raise ProcessExited(name, proc.returncode)
        if cancelled is not None and cancelled():
            return False
        with contextlib.suppress(httpx.HTTPError, ValueError):
            if ready_workers(base_url, headers) >= workers:
                return True
        if time.monotonic() > deadline:
            raise TimeoutError(f"{base_url}/ready did not count {workers} worker(s) within {timeout:.0f}s")
        time.sleep(interval)


# ------------------------------------------------------------------------------------------------ stopping
def _leads_group(proc: subprocess.Popen) -> bool:
    try:
        return os.getpgid(proc.pid) == proc.pid
    except ProcessLookupError:
        return False


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL; to the whole group where ``proc`` leads one (started in its own session: a gateway supervisor's
    processes go too). Never a group it does not lead: that may be ours."""
    with contextlib.suppress(ProcessLookupError):
        if _leads_group(proc):
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
    proc.wait(5)


def _send(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGCONT)  # a paused process cannot act on SIGTERM
        proc.send_signal(sig)


def stop_processes(
    procs: Iterable[subprocess.Popen], grace: float, sig: int = signal.SIGTERM
) -> list[subprocess.Popen]:
    """Signal every live process of ``procs`` at once, then wait up to ``grace`` s for each in turn; one still
    running then is killed (its group). Returns the killed ones."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        _send(p, sig)
    killed = []
    for p in live:
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            _kill(p)
            killed.append(p)
    return killed


def stop_process(proc: subprocess.Popen, grace: float, sig: int = signal.SIGTERM) -> bool:
    """``stop_processes`` for one process; False when it had to be killed."""
    return not stop_processes([proc], grace, sig)


class Processes:
    """Named child processes, each in its own session (Ctrl-C at the terminal reaches only the parent, which
    stops them in order) with stdout and stderr appended to ``logdir/<name>.log``."""

    def __init__(self, logdir: Path):
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}  # in start order

    def spawn(
        self, name: str, cmd: Sequence[str], env: Mapping[str, str] | None = None, cwd: Path | None = None
    ) -> subprocess.Popen:
        """Start ``cmd`` as ``name``; a name started again (a restart) replaces the old process, its log goes on."""
        with (self.logdir / f"{name}.log").open("ab") as log:
            proc = subprocess.Popen(
                list(cmd), env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.procs[name] = proc
        return proc

    def start_redis(
        self, port: int, binary: str = "redis-server", env: Mapping[str, str] | None = None, timeout: float = 10.0
    ) -> str:
        """A private redis-server (``redis_server_command``, its files in ``logdir``) as ``redis``; its URL once
        it answers."""
        self.spawn("redis", redis_server_command(binary, port, self.logdir), env)
        url = f"redis://127.0.0.1:{port}/0"
        wait_for(lambda: redis_answers(url, 0.2), timeout, f"redis-server on port {port}", interval=0.1)
        return url

    def exited(self) -> dict[str, int]:
        """name → exit code of the processes that are no longer running."""
        return {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}

    def stop(self, name: str, grace: float, sig: int = signal.SIGTERM) -> None:
        if name in self.procs:
            stop_process(self.procs[name], grace, sig)

    def stop_all(self, order: Sequence[str] = ("gateway", "worker", "redis"), grace: float = 30.0) -> list[str]:
        """Stop in groups by name prefix, in ``order`` (the gateway first, so no new work arrives, then the
        workers), the names that match no prefix last; each group with ``stop_processes``. The names killed."""
        groups = [[n for n in self.procs if n.startswith(prefix)] for prefix in order]
        groups.append([n for n in self.procs if not n.startswith(tuple(order))])
        killed = []
        for names in groups:
            gone = stop_processes([self.procs[n] for n in names], grace)
            killed += [n for n in names if self.procs[n] in gone]
        return killed

    def log_lines(self, name: str, lines: int = 25) -> list[str]:
        path = self.logdir / f"{name}.log"
        return path.read_text(errors="replace").splitlines()[-lines:] if path.exists() else []

    def log_tail(self, lines: int = 25) -> str:
        """The last ``lines`` of every process's log, under a ``--- name ---`` line each."""
        logs = [n for n in self.procs if (self.logdir / f"{n}.log").exists()]
        return "\n".join(f"--- {n} ---\n" + "\n".join(self.log_lines(n, lines)) for n in logs)
