"""grafana/prometheus.yml and the alert rules through promtool (Debian's prometheus package)."""

from __future__ import annotations

import subprocess

import yaml

from tests.support.deploy import GRAFANA, require_binary

REQUIRED_ALERTS = {
    "KernellabTTFTP99OverSLO",  # TTFT p99 over SLO
    "KernellabQueueBacklog",  # waiting queue backlog
    "KernellabKVCacheNearlyFull",  # KV usage > 90 %
    "KernellabWorkerDown",
    "KernellabHigh5xxRate",
    "KernellabHigh429Rate",
}


def _promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([require_binary("promtool"), *args], capture_output=True, text=True, timeout=60,
                          cwd=GRAFANA)  # fmt: skip


def test_promtool_check_config():
    done = _promtool("check", "config", "prometheus.yml")
    assert done.returncode == 0, done.stdout + done.stderr


def test_promtool_check_rules():
    done = _promtool("check", "rules", "alerts.yml")
    assert done.returncode == 0, done.stdout + done.stderr


def test_promtool_rule_unit_tests_pass():
    done = _promtool("test", "rules", "alerts_test.yml")
    assert done.returncode == 0, done.stdout + done.stderr


def _alerts() -> dict[str, dict]:
    groups = yaml.safe_load((GRAFANA / "alerts.yml").read_text())["groups"]
    return {rule["alert"]: rule for group in groups for rule in group["rules"] if "alert" in rule}


def test_the_issue_alerts_exist_and_kv_threshold_is_90_percent():
    alerts = _alerts()
    assert set(alerts) >= REQUIRED_ALERTS
    assert "> 0.9" in alerts["KernellabKVCacheNearlyFull"]["expr"]
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert rule["annotations"]["summary"], name


def test_every_alert_is_tested_firing_and_quiet():
    cases = yaml.safe_load((GRAFANA / "alerts_test.yml").read_text())["tests"]
    firing, quiet = set(), set()
    for case in cases:
        for check in case.get("alert_rule_test", []):
            (firing if check["exp_alerts"] else quiet).add(check["alertname"])
    alerts = set(_alerts())
    assert alerts <= firing, f"never seen firing: {sorted(alerts - firing)}"
    assert alerts <= quiet, f"never seen quiet: {sorted(alerts - quiet)}"


def test_workers_are_found_by_dns_so_scaled_replicas_are_all_scraped():
    config = yaml.safe_load((GRAFANA / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["worker"]["dns_sd_configs"] == [{"names": ["worker"], "type": "A", "port": 9200,
                                                 "refresh_interval": "10s"}]  # fmt: skip
    assert jobs["dcgm"]["dns_sd_configs"][0]["names"] == ["dcgm-exporter"]
    assert jobs["gateway"]["static_configs"][0]["targets"] == ["gateway:9100"]
    assert config["rule_files"] == ["alerts.yml"]
