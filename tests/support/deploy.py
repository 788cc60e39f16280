"""Helpers of the deployment tests (unit and integration): binaries the CI installs, a real Prometheus
server on a free loopback port, and the dashboards' queries."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kernellab.services.processes import free_port, stop_process

REPO = Path(__file__).resolve().parents[2]
GRAFANA = REPO / "grafana"
DASHBOARDS = GRAFANA / "dashboards"
INSTALL_HINT = "run scripts/install-system-deps.sh (the CI does) or `pip install -e .[dev]`"


def require_binary(name: str) -> str:
    """Path of a binary the CI installs; a missing one fails the test (a skip would hide the gap)."""
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail(f"`{name}` is not installed: {INSTALL_HINT}")
    return found


def http_json(url: str, data: dict | None = None, timeout: float = 10.0, headers: dict | None = None):
    body = None if data is None else json.dumps(data).encode()
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.25, process=None):
    """Poll ``predicate`` until it returns a truthy value; fail with ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last_error = None
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            pytest.fail(f"{what}: the process exited with status {process.returncode}")
        try:
            value = predicate()
            if value:
                return value
        except (OSError, urllib.error.URLError, ValueError) as error:
            last_error = error
        time.sleep(interval_s)
    pytest.fail(f"{what}: not ready after {timeout_s:.0f} s (last error: {last_error})")


class Prometheus:
    """A real Prometheus server (Debian's binary) on a free loopback port with a temporary data dir."""

    def __init__(self, config: str, workdir: Path):
        self.binary = require_binary("prometheus")
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # The config may name the server's own address before the port is known.
        (workdir / "prometheus.yml").write_text(config.replace("__PROMETHEUS_ADDRESS__", f"127.0.0.1:{self.port}"))
        self.log_path = workdir / "prometheus.log"
        self.process: subprocess.Popen | None = None

    def start(self) -> Prometheus:
        log = self.log_path.open("w")
        self.process = subprocess.Popen(
            [self.binary, f"--config.file={self.workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={self.workdir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}",
             "--storage.tsdb.retention.time=1h", "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        wait_until(lambda: urllib.request.urlopen(f"{self.url}/-/ready", timeout=2).status == 200, 30,
                   f"prometheus on {self.url} (log: {self.log_path})", process=self.process)  # fmt: skip
        return self

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process, 15)

    def api(self, path: str, **params) -> dict:
        query = urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:  # 400 for a bad query: the body says why
            return json.loads(error.read())

    def query(self, expr: str) -> dict:
        return self.api("query", query=expr)


@contextlib.contextmanager
def running_prometheus(config: str, workdir: Path) -> Iterator[Prometheus]:
    server = Prometheus(config, workdir).start()
    try:
        yield server
    finally:
        server.stop()


# ---- dashboards
def load_dashboards() -> list[tuple[Path, dict]]:
    return [(path, json.loads(path.read_text())) for path in sorted(DASHBOARDS.glob("*.json"))]


def iter_panels(dashboard: dict) -> Iterator[dict]:
    """Every panel that shows data, including those inside (collapsed) rows."""
    for panel in dashboard.get("panels", []):
        if panel.get("type") == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def requires_gpu(panel: dict) -> bool:
    """Panels marked ``"x-kernellab": {"requires": "gpu"}`` show DCGM data, which exists only on NVIDIA hosts."""
    return panel.get("x-kernellab", {}).get("requires") == "gpu"


def expand_variables(expr: str, rate_interval: str = "1m") -> str:
    """What Grafana sends for ``$model`` = All (allValue ``.*``) and ``$__rate_interval``."""
    expr = expr.replace("$__rate_interval", rate_interval).replace("${__rate_interval}", rate_interval)
    expr = expr.replace("${model}", ".*").replace("$model", ".*")
    if "$" in expr:
        raise ValueError(f"unexpanded Grafana variable in {expr!r}")
    return expr


METRIC_NAME = re.compile(r"\b(?:kernellab[:_][A-Za-z0-9_:]+|DCGM_[A-Z0-9_]+)\b|\bup(?=\{)")


def metric_names(expr: str) -> set[str]:
    """The metric names a query reads (ours, DCGM's and ``up``)."""
    return set(METRIC_NAME.findall(expr))


def subprocess_env(**extra: str) -> dict:
    env = dict(os.environ)
    env.update(extra)
    return env
