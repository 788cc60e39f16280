"""Our Dockerfiles: hadolint clean, pinned CUDA bases, multi-stage, non-root, HEALTHCHECK, sources present."""

from __future__ import annotations

import fnmatch
import re
import subprocess

import pytest

from tests.unit.deploy.support import REPO, require_binary

DOCKERFILES = sorted((REPO / "images").glob("*.Dockerfile"))
NAMES = [path.name for path in DOCKERFILES]


def _instructions(path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def test_the_three_images_exist():
    assert NAMES == ["gateway.Dockerfile", "loadgen.Dockerfile", "worker.Dockerfile"]


@pytest.mark.parametrize("path", DOCKERFILES, ids=NAMES)
def test_hadolint_passes(path):
    hadolint = require_binary("hadolint")
    done = subprocess.run([hadolint, "--no-color", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("path", DOCKERFILES, ids=NAMES)
def test_every_ignored_hadolint_rule_is_justified_in_a_comment(path):
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines):
        if "hadolint ignore" in line:
            # The comment lines right above the directive say why (DL3008 is the only rule we ignore).
            above = []
            for previous in reversed(lines[:number]):
                if not previous.startswith("#"):
                    break
                above.append(previous)
            reason = " ".join(a for a in above if "hadolint" not in a).strip("# ")
            assert len(reason) > 20 and "pin" in reason.lower(), (
                f"{path.name}:{number + 1}: {line!r} has no reason"
            )
    assert not (REPO / ".hadolint.yaml").exists() and not (REPO / ".hadolint.yml").exists()


@pytest.mark.parametrize("path", DOCKERFILES, ids=NAMES)
def test_pinned_cuda_base_and_multi_stage(path):
    bases = [args.split()[0] for keyword, args in _instructions(path) if keyword == "FROM"]
    assert len(bases) >= 2, "multi-stage: a build stage and a runtime stage"
    for base in bases:
        assert re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-[a-z-]+-ubuntu\d+\.\d+", base), base


@pytest.mark.parametrize("path", DOCKERFILES, ids=NAMES)
def test_runs_as_a_non_root_user_with_a_healthcheck(path):
    instructions = _instructions(path)
    users = [args for keyword, args in instructions if keyword == "USER"]
    assert users, "no USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, users[-1]
    assert any(keyword == "HEALTHCHECK" and "NONE" not in args for keyword, args in instructions)


def _dockerignore_allows(relative: str) -> bool:
    allowed = False
    for line in (REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").rstrip("/")
        if pattern == "**" or fnmatch.fnmatch(relative, pattern) or relative.startswith(pattern + "/"):
            allowed = negate
    return allowed


@pytest.mark.parametrize("path", DOCKERFILES, ids=NAMES)
def test_every_copied_source_exists_and_is_in_the_build_context(path):
    for keyword, args in _instructions(path):
        if keyword != "COPY" or "--from=" in args:
            continue
        parts = [p for p in args.split() if not p.startswith("--")]
        for source in parts[:-1]:
            assert (REPO / source).exists(), f"{path.name}: COPY {source}: missing"
            assert _dockerignore_allows(source.rstrip("/")), (
                f"{path.name}: COPY {source}: excluded by .dockerignore"
            )


def test_worker_image_installs_cuda_torch_our_package_and_the_runpod_handler():
    text = (REPO / "images" / "worker.Dockerfile").read_text()
    assert re.search(r"ARG TORCH_VERSION=\d+\.\d+\.\d+", text)
    assert 'pip install "torch==${TORCH_VERSION}"' in text
    assert "--dep runpod" in text and "pip install --no-deps /src" in text
    assert "COPY runpod/ /opt/kernellab/runpod/" in text
    entrypoint = (REPO / "images" / "worker-entrypoint.sh").read_text()
    assert "/opt/kernellab/runpod/handler.py" in entrypoint


def test_gateway_and_loadgen_images_leave_torch_out():
    for name in ("gateway.Dockerfile", "loadgen.Dockerfile"):
        code = " ".join(f"{keyword} {args}" for keyword, args in _instructions(REPO / "images" / name))
        assert "torch" not in code.replace("--exclude torch", ""), name


def test_worker_entrypoint_is_valid_posix_shell():
    done = subprocess.run(["sh", "-n", str(REPO / "images" / "worker-entrypoint.sh")], capture_output=True,
                          text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("path", DOCKERFILES, ids=NAMES)
def test_requirement_selection_of_each_image_works_on_this_pyproject(path):
    """Runs the build stage's own requirements step, so a renamed dependency or extra fails here."""
    import sys

    match = re.search(r"python images/requirements_from_pyproject\.py pyproject\.toml([^>]*)>",
                      re.sub(r"\\\n", " ", path.read_text()))  # fmt: skip
    assert match, "no requirements step"
    done = subprocess.run([sys.executable, str(REPO / "images" / "requirements_from_pyproject.py"),
                           str(REPO / "pyproject.toml"), *match.group(1).split()],
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    assert done.returncode == 0, done.stderr
    names = {re.split(r"[<>=\[; ]", line, maxsplit=1)[0].lower() for line in done.stdout.splitlines()}
    if path.name == "worker.Dockerfile":
        assert {"torch", "runpod", "triton"} <= names
    else:
        assert "torch" not in names and "accelerate" not in names
    if path.name == "loadgen.Dockerfile":
        assert {"locust", "matplotlib", "httpx"} <= names
    if path.name == "gateway.Dockerfile":
        assert {"fastapi", "celery", "redis", "prometheus-client"} <= names
