"""docker-compose.yml through a real compose implementation (Debian's docker-compose 1.29, which validates
and resolves a compose-spec file without a Docker engine), then the resolved file against the issue's rules."""

from __future__ import annotations

import re
import subprocess

import pytest
import yaml

from tests.unit.deploy.support import REPO, require_binary

PROFILES = ("loadtest", "gpu-metrics")
SECRETS = {"REDIS_PASSWORD": "redis-test-secret", "KERNELLAB_API_KEYS": "key-a,key-b",
           "GRAFANA_ADMIN_PASSWORD": "grafana-test-secret"}  # fmt: skip
PUBLISHED = {"gateway", "grafana", "locust"}
BACKEND_ONLY = {"redis", "prometheus", "dcgm-exporter"}
# A pinned tag names a release: digits in it, never `latest`; or a digest.
PINNED_TAG = re.compile(r"^[^:@]+(:(?!latest$)[^:@]*\d[^:@]*)?(@sha256:[0-9a-f]{64})?$")


def _env_file(tmp_path, **overrides) -> str:
    lines = []
    for line in (REPO / ".env.example").read_text().splitlines():
        key = line.split("=", 1)[0]
        if key in SECRETS and "=" in line:
            line = f"{key}={overrides.get(key, SECRETS[key])}"
        lines.append(line)
    path = tmp_path / "env"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _compose(tmp_path, *args: str, env_file: str | None = None) -> subprocess.CompletedProcess:
    binary = require_binary("docker-compose")
    command = [binary, "--project-directory", str(REPO), "-f", str(REPO / "docker-compose.yml"),
               "--env-file", env_file or _env_file(tmp_path)]  # fmt: skip
    for profile in PROFILES:
        command += ["--profile", profile]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=60, cwd=tmp_path)


def _volumes(service: dict) -> list[dict]:
    """Volumes as {type, source, target}, from the long or the short syntax (1.29 prints the short one)."""
    out = []
    for volume in service.get("volumes", []):
        if isinstance(volume, dict):
            out.append(volume)
            continue
        source, target = volume.split(":")[:2]
        kind = "bind" if source.startswith(("/", ".")) else "volume"
        out.append({"type": kind, "source": source, "target": target})
    return out


def _host_ips(service: dict) -> list[str]:
    ips = []
    for port in service.get("ports", []):
        if isinstance(port, dict):
            ips.append(str(port.get("host_ip", "")))
        else:  # "127.0.0.1:3000:3000/tcp"
            parts = port.split(":")
            ips.append(parts[0] if len(parts) == 3 else "")
    return ips


def _seconds(duration: str) -> float:
    """A compose duration ("15m", "1m30s", "900s") in seconds."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s|us)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    scale = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}
    return sum(float(n) * scale[u] for n, u in parts)


@pytest.fixture(scope="module")
def resolved(tmp_path_factory) -> dict:
    tmp_path = tmp_path_factory.mktemp("compose")
    done = _compose(tmp_path, "config")
    assert done.returncode == 0, done.stderr
    return yaml.safe_load(done.stdout)


def test_compose_config_is_valid(tmp_path):
    done = _compose(tmp_path, "config", "-q")
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("secret", sorted(SECRETS))
def test_compose_refuses_to_start_without_each_secret(tmp_path, secret):
    done = _compose(tmp_path, "config", "-q", env_file=_env_file(tmp_path, **{secret: ""}))
    assert done.returncode != 0
    assert secret in done.stderr


def test_services_of_the_issue_exist(resolved):
    assert set(resolved["services"]) == {"redis", "gateway", "worker", "batch", "prometheus", "grafana", "locust",
                                         "dcgm-exporter"}  # fmt: skip
    assert resolved["services"]["locust"]["profiles"] == ["loadtest"]
    assert resolved["services"]["dcgm-exporter"]["profiles"] == ["gpu-metrics"]


def test_every_build_context_and_dockerfile_exists(resolved):
    built = {name: svc["build"] for name, svc in resolved["services"].items() if "build" in svc}
    assert set(built) == {"gateway", "worker", "locust"}
    for name, build in built.items():
        context = REPO / build["context"]
        assert context.is_dir(), name
        assert (context / build["dockerfile"]).is_file(), f"{name}: {build['dockerfile']}"


def test_every_image_tag_is_pinned(resolved):
    for name, service in resolved["services"].items():
        image = service["image"]
        assert ":" in image.split("/")[-1] or "@" in image, f"{name}: {image} has no tag"
        assert PINNED_TAG.match(image), f"{name}: {image} is not pinned to a release"


def test_only_gateway_grafana_and_locust_publish_ports(resolved):
    publishing = {name for name, svc in resolved["services"].items() if svc.get("ports")}
    assert publishing == PUBLISHED
    for name in ("grafana", "locust"):  # no authentication in front of Locust: loopback unless asked
        assert _host_ips(resolved["services"][name]) == ["127.0.0.1"], name


def test_redis_metrics_and_prometheus_stay_on_the_internal_network(resolved):
    assert resolved["networks"]["backend"].get("internal") is True
    assert not resolved["networks"]["edge"].get("internal")
    for name in BACKEND_ONLY:
        assert list(resolved["services"][name]["networks"]) == ["backend"], name
    for name in ("gateway", "worker", "batch", "grafana"):  # they reach Redis or Prometheus
        assert "backend" in resolved["services"][name]["networks"], name


def test_redis_password_healthcheck_and_append_only_volume(resolved):
    redis = resolved["services"]["redis"]
    command = " ".join(redis["command"])
    assert "--requirepass" in command and "$REDIS_PASSWORD" in command  # from the environment
    assert SECRETS["REDIS_PASSWORD"] not in command
    assert "--appendonly yes" in command
    assert any(v["target"] == "/data" and v["type"] == "volume" for v in _volumes(redis))
    assert "test" in redis["healthcheck"]
    assert "ports" not in redis


def test_worker_gpu_reservation_caches_healthcheck_and_scaling(resolved):
    worker = resolved["services"]["worker"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices and devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    targets = {v["source"]: v["target"] for v in _volumes(worker) if v["type"] == "volume"}
    assert targets["hf-cache"] == worker["environment"]["HF_HOME"]
    assert targets["triton-cache"] == worker["environment"]["TRITON_CACHE_DIR"]
    assert worker["environment"]["KERNELLAB_MODEL"] == "Qwen/Qwen3-0.6B"
    assert _seconds(worker["healthcheck"]["start_period"]) >= 300  # model download + kernel compilation
    # `--scale worker=N` needs no fixed container name and no host port.
    assert "container_name" not in worker and "ports" not in worker
    assert "batch-worker" in resolved["services"]["batch"]["command"]


def test_services_share_one_redis_url_with_the_password(resolved):
    urls = {svc["environment"]["KERNELLAB_REDIS_URL"] for name, svc in resolved["services"].items()
            if name in ("gateway", "worker", "batch")}  # fmt: skip
    assert urls == {f"redis://:{SECRETS['REDIS_PASSWORD']}@redis:6379/0"}


def test_gateway_and_batch_worker_share_the_batch_files_volume(resolved):
    for name in ("gateway", "batch"):
        service = resolved["services"][name]
        mounts = {v["source"]: v["target"] for v in _volumes(service) if v["type"] == "volume"}
        assert mounts["batch-files"] == service["environment"]["KERNELLAB_FILES_DIR"], name


def test_grafana_admin_password_from_env_and_no_anonymous_access(resolved):
    env = resolved["services"]["grafana"]["environment"]
    assert env["GF_SECURITY_ADMIN_PASSWORD"] == SECRETS["GRAFANA_ADMIN_PASSWORD"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert "GF_AUTH_ANONYMOUS_ORG_ROLE" not in env


def test_mounted_configuration_files_exist(resolved):
    for name, service in resolved["services"].items():
        for volume in _volumes(service):
            if volume["type"] == "bind":
                assert (REPO / volume["source"]).exists(), f"{name}: {volume['source']}"


def test_env_example_names_every_variable_the_compose_file_reads():
    compose = (REPO / "docker-compose.yml").read_text()
    used = set(re.findall(r"\$\{([A-Z_][A-Z0-9_]*)", compose))
    documented = {line.split("=", 1)[0] for line in (REPO / ".env.example").read_text().splitlines()
                  if line and not line.startswith("#")}  # fmt: skip
    assert used <= documented, sorted(used - documented)
