"""The local stack (`kernellab up`, embedded model, real Redis) under a real Prometheus and a headless
Locust run: the run ends with zero failures and a report, and every dashboard panel's query returns data.

Prometheus scrapes with grafana/prometheus.yml's own job names and rule file; only the discovery differs:
the compose file finds containers by DNS, here the processes listen on loopback ports we chose. The
`dcgm` job and the dashboard panels marked GPU-only are left out: dcgm-exporter needs an NVIDIA GPU and
driver, which these CPU machines do not have.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from kernellab.bench.serve import run_bench_serve
from kernellab.services.loadgen.headless import run_locust_headless
from kernellab.services.processes import free_port, stop_process
from tests.support.deploy import (
    GRAFANA,
    expand_variables,
    iter_panels,
    load_dashboards,
    metric_names,
    requires_gpu,
    running_prometheus,
    wait_until,
)

pytestmark = pytest.mark.integration

API_KEY = "deploy-test-key"
MODEL = "smollm2-135m"
# Small requests: the embedded 135M model on 2 CPU cores; prompts share a system prompt (prefix cache).
MIX = "16:8:1,32:12:1"
LOCUST_REQUESTS = 16
LOCUST_RUN_TIME_S = 75
RATE_WINDOW = "2m"  # covers the whole bounded run; Grafana's $__rate_interval would be 4 scrapes


class LocalStack:
    def __init__(self, workdir: Path):
        self.port, self.gateway_metrics, self.worker_metrics = free_port(), free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "kernellab-up.log"
        self.process: subprocess.Popen | None = None

    def start(self) -> LocalStack:
        env = dict(os.environ)
        env.update({
            "KERNELLAB_API_KEYS": API_KEY,
            "KERNELLAB_GATEWAY_METRICS_PORT": str(self.gateway_metrics),
            "KERNELLAB_WORKER_METRICS_PORT": str(self.worker_metrics),
            "KERNELLAB_METRICS_HOST": "127.0.0.1",
            "KERNELLAB_DEVICE": "cpu",
            "KERNELLAB_KEY_PREFIX": f"kl-deploy-test-{os.getpid()}:",  # our own keys in the shared Redis
        })  # fmt: skip
        kernellab = str(Path(sys.executable).with_name("kernellab"))
        command = [
            kernellab,
            "up",
            "--model",
            MODEL,
            "--workers",
            "1",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        self.process = subprocess.Popen(command, env=env, stdout=self.log_path.open("w"), stderr=subprocess.STDOUT,
                                        start_new_session=True)  # fmt: skip
        wait_until(lambda: urllib.request.urlopen(f"{self.url}/ready", timeout=5).status == 200, 300,
                   f"`kernellab up` /ready (log: {self.log_path})", interval_s=1.0, process=self.process)  # fmt: skip
        for name, port in (("gateway", self.gateway_metrics), ("worker", self.worker_metrics)):
            wait_until(lambda port=port: b"kernellab" in urllib.request.urlopen(
                f"http://127.0.0.1:{port}/metrics", timeout=5).read(), 30,
                f"{name} metrics on the port given to `kernellab up` ({port})")  # fmt: skip
        return self

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process, 30)

    def log_tail(self) -> str:
        return self.log_path.read_text()[-3000:] if self.log_path.exists() else ""


def prometheus_config(stack: LocalStack) -> str:
    """grafana/prometheus.yml with each job pointed at the local process instead of DNS."""
    config = yaml.safe_load((GRAFANA / "prometheus.yml").read_text())
    targets = {
        "gateway": f"127.0.0.1:{stack.gateway_metrics}",
        "worker": f"127.0.0.1:{stack.worker_metrics}",
        "prometheus": "__PROMETHEUS_ADDRESS__",
    }
    jobs = {job["job_name"] for job in config["scrape_configs"]}
    assert jobs == {*targets, "dcgm"}, f"a scrape job this test does not know: {jobs}"
    config["scrape_configs"] = [{"job_name": name, "static_configs": [{"targets": [target]}]}
                                for name, target in targets.items()]  # fmt: skip
    config["global"].update({"scrape_interval": "1s", "evaluation_interval": "1s"})
    config["rule_files"] = [str(GRAFANA / rule_file) for rule_file in config["rule_files"]]
    return yaml.safe_dump(config)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    local = LocalStack(tmp_path_factory.mktemp("stack"))
    try:
        yield local.start()
    finally:
        local.stop()


@pytest.fixture(scope="module")
def prometheus(stack, tmp_path_factory):
    with running_prometheus(prometheus_config(stack), tmp_path_factory.mktemp("prometheus")) as server:
        wait_until(lambda: len(server.query("up == 1")["data"]["result"]) == 3, 30, "all three targets up")
        yield server


@pytest.fixture(scope="module")
def locust_run(stack, prometheus, tmp_path_factory):
    out = tmp_path_factory.mktemp("locust")
    run = run_locust_headless(stack.url, out, users=4, run_time_s=LOCUST_RUN_TIME_S, max_requests=LOCUST_REQUESTS, mix=MIX,
                              api_key=API_KEY, stop_timeout_s=30)  # fmt: skip
    time.sleep(3)  # a few scrapes after the last request
    return run


@pytest.mark.timeout(420)
def test_headless_locust_run_ends_with_zero_failures_and_a_report(stack, locust_run):
    report = locust_run["report"]
    assert report is not None, locust_run["log_tail"]
    assert locust_run["exit_code"] == 0, locust_run["log_tail"] + "\n--- kernellab up ---\n" + stack.log_tail()
    assert report["requests"]["failed"] == 0, report["requests"]["failures"]
    # Bounded twice: by count, and by time on a machine too slow to finish the count.
    assert report["requests"]["completed"] == LOCUST_REQUESTS or report["duration_s"] >= LOCUST_RUN_TIME_S
    assert report["requests"]["completed"] > 0
    assert report["output_tokens"] > 0 and report["output_token_throughput_tps"] > 0
    for name in ("ttft_s", "itl_s", "e2e_s"):
        assert report[name]["count"] > 0, name
        assert 0 < report[name]["p50"] <= report[name]["p90"] <= report[name]["p99"], name
    assert report["config"]["model"] == MODEL
    assert Path(locust_run["html"]).stat().st_size > 0
    assert Path(locust_run["csv_prefix"] + "_stats.csv").exists()


def _panel_queries():
    for path, dashboard in load_dashboards():
        for panel in iter_panels(dashboard):
            for target in panel["targets"]:
                yield path.name, panel, target["expr"]


@pytest.mark.timeout(420)
def test_every_dashboard_panel_query_returns_data(prometheus, locust_run):
    empty, skipped = [], []
    for dashboard, panel, expr in _panel_queries():
        if requires_gpu(panel):
            skipped.append(panel["title"])  # DCGM metrics need an NVIDIA GPU (see the module docstring)
            continue
        answer = prometheus.query(expand_variables(expr, RATE_WINDOW))
        assert answer["status"] == "success", (expr, answer)
        values = [float(series["value"][1]) for series in answer["data"]["result"]]
        if not any(math.isfinite(v) for v in values):
            empty.append(f"{dashboard} / {panel['title']}: {expr} → {values or 'no series'}")
    assert not empty, "panels without data:\n" + "\n".join(empty)
    assert skipped, "the GPU panels should have been the only ones left out"


@pytest.mark.timeout(420)
def test_every_metric_the_dashboards_read_is_exported(prometheus, locust_run):
    exported = set(prometheus.api("label/__name__/values")["data"])
    wanted = {name for _, panel, expr in _panel_queries() if not requires_gpu(panel) for name in metric_names(expr)}
    assert wanted <= exported, f"read by a dashboard but not exported: {sorted(wanted - exported)}"


@pytest.mark.timeout(420)
def test_alert_rules_evaluate_cleanly_on_real_series(prometheus, locust_run):
    groups = prometheus.api("rules")["data"]["groups"]
    assert {g["name"] for g in groups} == {"kernellab-recording", "kernellab-slo"}
    for group in groups:
        for rule in group["rules"]:
            assert rule["health"] == "ok", (rule["name"], rule.get("lastError"))
    recorded = prometheus.query("kernellab:gateway_http_requests:rate5m")["data"]["result"]
    assert recorded and float(recorded[0]["value"][1]) > 0


@pytest.mark.timeout(420)
def test_bench_serve_writes_a_report_and_a_plot(stack, tmp_path):
    report = run_bench_serve(stack.url, None, concurrency=4, num_requests=8, api_key=API_KEY, mix="16:8:1",
                             slo_ttft_ms=120_000, slo_tpot_ms=60_000, output=tmp_path / "bench.json",
                             plot=tmp_path / "bench.png")  # fmt: skip
    assert report["requests"]["failed"] == 0, report["requests"]["failures"]
    assert report["requests"]["completed"] == 8
    assert report["goodput"]["requests_meeting_slo"] == 8
    for name in ("ttft_s", "itl_s", "tpot_s", "e2e_s"):
        assert {"p50", "p90", "p99"} <= set(report[name]), name
    assert report["output_tokens"] == sum(r["completion_tokens"] for r in report["records"])
    assert (tmp_path / "bench.json").read_text().startswith("{")
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
