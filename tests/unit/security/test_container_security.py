"""Static security checks of the deployment: read docker-compose.yml, the Dockerfiles and .env.example
(no Docker engine needed) and hold them to the rules of docs/reliability.md:

- Redis is published nowhere, lives only on the internal network, and requires a password that compose
  refuses to start without (no default, not on any command line).
- Grafana has no default admin password, no anonymous access and no sign-up.
- Every container runs as a non-root user: our images end on a numeric non-root ``USER``; an official
  image either declares a non-root user itself (listed below, with where that is documented) or compose
  sets ``user:``. The one exception is named with its reason.
- No service is privileged, shares the host's network or PID namespace, or publishes a metrics port.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
SERVICES: dict[str, dict] = COMPOSE["services"]

# Official images whose own Dockerfile ends on a non-root USER (so compose needs no `user:`).
NON_ROOT_IMAGES = {
    "prom/prometheus": "USER nobody in prometheus/prometheus's Dockerfile",
    "grafana/grafana": "USER 472 (grafana) in grafana/grafana's Dockerfile",
}
# Services allowed to run as root, and why. Keep this list short and justified.
ROOT_ALLOWED = {
    "dcgm-exporter": "opt-in `gpu-metrics` profile; NVIDIA's DCGM needs root with SYS_ADMIN for profiling metrics",
}
REQUIRED = re.compile(r"^\$\{(\w+):\?[^}]*\}$")  # ${NAME:?message}: compose refuses to start without it


def image_name(ref: str) -> str:
    return ref.split("@")[0].rsplit(":", 1)[0] if ":" in ref.split("/")[-1] else ref.split("@")[0]


def final_user(dockerfile: Path) -> str | None:
    """The USER in effect in the Dockerfile's last stage (None: never set, i.e. root)."""
    user = None
    for line in dockerfile.read_text().splitlines():
        words = line.strip().split()
        if not words:
            continue
        if words[0].upper() == "FROM":
            user = None
        elif words[0].upper() == "USER":
            user = words[1]
    return user


def is_root(user: str | None) -> bool:
    return user is None or user.split(":")[0] in ("root", "0")


def built_dockerfile(name: str) -> Path | None:
    """The Dockerfile a service's image comes from: its own build, or the build of the service whose
    image it reuses (``batch`` runs the gateway image)."""
    svc = SERVICES[name]
    if "build" not in svc:
        for other in SERVICES.values():
            if "build" in other and other.get("image") == svc.get("image"):
                svc = other
                break
        else:
            return None
    build = svc["build"]
    return REPO / build.get("context", ".") / build["dockerfile"]


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_every_container_runs_as_non_root(name):
    svc = SERVICES[name]
    if "user" in svc:
        assert not is_root(str(svc["user"])), f"{name}: compose runs it as {svc['user']!r}"
        return
    dockerfile = built_dockerfile(name)
    if dockerfile is not None:
        user = final_user(dockerfile)
        assert not is_root(user), f"{name}: {dockerfile.name} ends as {user or 'root (no USER)'}"
        assert user.split(":")[0].isdigit(), f"{name}: use a numeric USER so runAsNonRoot can verify it"
        return
    image = image_name(svc["image"])
    if image in NON_ROOT_IMAGES or name in ROOT_ALLOWED:
        return
    pytest.fail(f"{name}: {image} runs as root unless compose sets `user:` (the image declares no non-root user)")


def test_redis_is_unpublished_internal_and_password_protected():
    redis = SERVICES["redis"]
    assert "ports" not in redis and "expose" not in redis
    assert redis["networks"] == ["backend"] and COMPOSE["networks"]["backend"].get("internal") is True
    command = " ".join(redis["command"]) if isinstance(redis["command"], list) else redis["command"]
    assert '--requirepass "$$REDIS_PASSWORD"' in command, "the password is read from the environment at run time"
    assert REQUIRED.match(redis["environment"]["REDIS_PASSWORD"]), "no default password: compose must refuse"
    for name, svc in SERVICES.items():
        url = (svc.get("environment") or {}).get("KERNELLAB_REDIS_URL")
        if url is not None:
            assert url.startswith("redis://:${REDIS_PASSWORD:?"), f"{name} reaches Redis without the password"


def test_grafana_has_no_default_admin_password_and_no_anonymous_access():
    env = SERVICES["grafana"]["environment"]
    assert REQUIRED.match(env["GF_SECURITY_ADMIN_PASSWORD"]), env["GF_SECURITY_ADMIN_PASSWORD"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "false" and env["GF_USERS_ALLOW_SIGN_UP"] == "false"
    assert "GF_SECURITY_ADMIN_PASSWORD__FILE" not in env


def test_env_example_ships_no_secret_values():
    values = dict(
        line.split("=", 1)
        for line in (REPO / ".env.example").read_text().splitlines()
        if line and not line.startswith("#") and "=" in line
    )
    for secret in ("REDIS_PASSWORD", "KERNELLAB_API_KEYS", "GRAFANA_ADMIN_PASSWORD"):
        assert values.get(secret) == "", f"{secret} must be empty in .env.example (each host makes its own)"


def test_no_privileged_host_namespaces_or_published_metrics():
    for name, svc in SERVICES.items():
        assert not svc.get("privileged"), name
        assert svc.get("network_mode") != "host" and svc.get("pid") != "host" and svc.get("ipc") != "host", name
        for port in svc.get("ports") or []:
            container_port = str(port).rsplit(":", 1)[-1]
            assert container_port not in ("6379", "9090", "9100", "9200", "9400"), f"{name} publishes {port}"
        caps = set(svc.get("cap_add") or [])
        assert not caps or name in ROOT_ALLOWED, f"{name} adds capabilities {caps}"


def test_api_keys_are_required_by_compose():
    assert REQUIRED.match(SERVICES["gateway"]["environment"]["KERNELLAB_API_KEYS"])
