"""Grafana provisioning and dashboards: structure, the panels the issue asks for, GPU-only marking, and
every query accepted by a real Prometheus (no data needed for that; the live test checks data)."""

from __future__ import annotations

import re

import pytest
import yaml

from tests.support.deploy import (
    GRAFANA,
    REPO,
    expand_variables,
    iter_panels,
    load_dashboards,
    metric_names,
    requires_gpu,
    running_prometheus,
)

DASHBOARDS = load_dashboards()


def _all_exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for p in iter_panels(dashboard) for t in p.get("targets", [])]


def test_datasource_points_at_the_compose_prometheus():
    datasources = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yml").read_text())["datasources"]
    assert len(datasources) == 1
    ds = datasources[0]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090" and ds["uid"] == "prometheus"
    scrape = yaml.safe_load((GRAFANA / "prometheus.yml").read_text())["global"]["scrape_interval"]
    assert ds["jsonData"]["timeInterval"] == scrape


def test_dashboard_provider_reads_the_folder_compose_mounts():
    providers = yaml.safe_load((GRAFANA / "provisioning/dashboards/kernellab.yml").read_text())["providers"]
    compose = (REPO / "docker-compose.yml").read_text()
    for provider in providers:
        assert f"./grafana/dashboards:{provider['options']['path']}:ro" in compose


def test_dashboards_exist_with_unique_uids():
    assert DASHBOARDS
    uids = [d["uid"] for _, d in DASHBOARDS]
    assert len(set(uids)) == len(uids)


@pytest.mark.parametrize(("path", "dashboard"), DASHBOARDS, ids=[p.name for p, _ in DASHBOARDS])
def test_every_panel_queries_the_provisioned_prometheus(path, dashboard):
    ids = set()
    for panel in iter_panels(dashboard):
        assert panel["id"] not in ids, f"duplicate panel id {panel['id']}"
        ids.add(panel["id"])
        assert panel["datasource"]["uid"] == "prometheus", panel["title"]
        assert panel.get("targets"), f"{panel['title']}: no query"
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(set(ref_ids)) == len(ref_ids), panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip(), panel["title"]


def test_gpu_only_marking_is_exact():
    """Marked panels read only DCGM metrics, and every panel that reads DCGM metrics is marked."""
    for _, dashboard in DASHBOARDS:
        for panel in iter_panels(dashboard):
            names = set().union(*(metric_names(t["expr"]) for t in panel["targets"]))
            reads_dcgm = {n for n in names if n.startswith("DCGM_")}
            if requires_gpu(panel):
                assert names and reads_dcgm == names, panel["title"]
                assert panel["x-kernellab"]["why"], panel["title"]
            else:
                assert not reads_dcgm, panel["title"]


def test_the_panels_the_issue_asks_for():
    exprs = [e for _, d in DASHBOARDS for e in _all_exprs(d)]
    joined = "\n".join(exprs)
    for histogram in (
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
    ):
        for q in ("0.5", "0.9", "0.99"):
            assert re.search(rf"histogram_quantile\({q}, .*kernellab:{histogram}_bucket", joined), (
                histogram,
                q,
            )
    for needle in (
        "rate(kernellab:generation_tokens_total",  # output tok/s
        "kernellab:num_requests_running",
        "kernellab:num_requests_waiting",
        "kernellab:kv_cache_usage_perc",
        "kernellab:prefix_cache_hits_total",
        "kernellab:prefix_cache_queries_total",
        "kernellab_gateway_queue_depth",
        "kernellab_gateway_rejected_total",  # 429s
        'status=~"5.."',
        "DCGM_FI_DEV_GPU_UTIL",
        "DCGM_FI_DEV_FB_USED",
    ):
        assert needle in joined, needle


def test_every_query_is_valid_promql(tmp_path):
    """A real Prometheus parses each query (expanded as Grafana would); 400 means a syntax error."""
    exprs = sorted({expand_variables(e) for _, d in DASHBOARDS for e in _all_exprs(d)})
    with running_prometheus("global:\n  scrape_interval: 1s\nscrape_configs: []\n", tmp_path) as prometheus:
        errors = {}
        for expr in exprs:
            answer = prometheus.query(expr)
            if answer.get("status") != "success":
                errors[expr] = answer.get("error")
    assert not errors, errors
