"""The committed container smoke test artifact (results/compose_smoke.json, `make compose-smoke`) records a
passed end-to-end run with every check of the issue, and the smoke test covers the whole cpu profile.

That the containers build and serve at the current commit is not a unit test's job: .ci/run runs the smoke test
itself. The artifact's inputs digest tells which images/, compose file and entrypoints its figures belong to."""

from __future__ import annotations

import importlib.util
import json

import pytest
import yaml

from tests.support.deploy import REPO

ARTIFACT = REPO / "results" / "compose_smoke.json"


def _script():
    spec = importlib.util.spec_from_file_location("compose_smoke", REPO / "scripts" / "compose_smoke.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def artifact() -> dict:
    return json.loads(ARTIFACT.read_text())


def test_the_committed_run_passed_with_a_cold_and_a_warm_build(artifact):
    assert artifact["passed"] is True, artifact.get("error")
    assert artifact["build"]["cold"] is not None, "commit a full run, not a --no-cold one"
    assert artifact["base_image"]["debootstrap_s"] > 0
    assert not artifact["provenance"]["commit"].endswith("-dirty")


def test_every_image_is_measured_non_root_and_free_of_the_build_secret(artifact):
    images = artifact["images"]
    assert {"gateway", "worker", "loadgen"} <= set(images)
    for name, image in images.items():
        assert image["size_bytes"] > 0 and image["non_root"] and image["runs_as_uid"] != 0, name
        assert image["build_secret_absent"], name
    assert images["gateway"]["torch_absent"] is True


def test_the_stack_served_scaled_was_scraped_survived_a_kill_and_a_load_run(artifact):
    assert {key.split("/")[0] for key in artifact["healthy_after_s"]} == set(_script().STARTED)
    assert set(artifact["requests"]) == {"chat", "completion", "chat_stream"}
    targets = artifact["prometheus"]["targets"]
    assert sum(t["job"] == "gateway" and t["health"] == "up" for t in targets) == 1
    assert sum(t["job"] == "worker" and t["health"] == "up" for t in targets) == 2
    kill = artifact["worker_kill"]
    assert kill["workers"] == 2 and kill["chunks_after_kill"] > 0
    assert kill["completion_tokens"] == kill["max_tokens"] and kill["finish_reason"] == "length"
    locust = artifact["locust"]
    assert locust["run_time_s"] >= 30 and locust["exit_code"] == 0
    assert locust["requests"]["failed"] == 0 and locust["requests"]["completed"] > 0
    assert artifact["teardown_leftovers"] == {"containers": 0, "networks": 0, "volumes": 0}


def test_the_artifact_says_what_it_could_not_cover(artifact):
    text = " ".join(artifact["not_covered"]).lower()
    for part in ("grafana", "gpu", "redis", "prometheus", "ubuntu"):
        assert part in text, part


def test_the_smoke_test_starts_every_service_of_the_cpu_profile_but_grafana():
    """A service added to the cpu profile is started by the smoke test, or this fails until it says why not."""
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    enabled = {name for name, svc in compose["services"].items()
               if not svc.get("profiles") or "cpu" in svc["profiles"]}  # fmt: skip
    assert set(_script().STARTED) == enabled - {"grafana"}


def test_the_smoke_override_only_retags_and_never_touches_a_users_images():
    override = yaml.safe_load((REPO / "images" / "local" / "compose.smoke.yml").read_text())
    for name, service in override["services"].items():
        assert service["image"].startswith("kernellab-smoke/"), name
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    assert set(override["services"]) <= set(compose["services"])


def test_the_inputs_digest_covers_images_compose_and_the_entrypoints():
    script = _script()
    names = {path.relative_to(REPO).as_posix() for path in script.input_files()}
    assert {"docker-compose.yml", "images/gateway.Dockerfile", "images/worker.Dockerfile", "images/loadgen.Dockerfile",
            "images/worker-entrypoint.sh", "images/healthcheck.py", "images/local/compose.smoke.yml",
            "scripts/compose_smoke.py"} <= names  # fmt: skip
    assert not any(name.endswith(".whl") for name in names)
    assert script.inputs_digest().startswith("sha256:")
