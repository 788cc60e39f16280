"""Our Dockerfiles: hadolint clean, pinned CUDA bases by default, multi-stage, non-root, HEALTHCHECK, sources
present, build arguments that let the same files build the CPU images, offline-buildable (no frontend pull)."""

from __future__ import annotations

import fnmatch
import re
import subprocess

import pytest

from tests.support.deploy import REPO, require_binary

DOCKERFILES = sorted((REPO / "images").glob("*.Dockerfile"))
NAMES = [path.name for path in DOCKERFILES]
# Stand-ins for the official Redis and Prometheus images, used by the container smoke test only.
LOCAL_DOCKERFILES = sorted((REPO / "images" / "local").glob("*.Dockerfile"))
ALL_DOCKERFILES = DOCKERFILES + LOCAL_DOCKERFILES
ALL_NAMES = [path.relative_to(REPO / "images").as_posix() for path in ALL_DOCKERFILES]
# Every rule we ignore, and a word its justification must use.
IGNORED_RULES = {"DL3008": "pin", "SC2086": "split"}


def _arg_defaults(path) -> dict[str, str]:
    """Values of the ARGs declared before the first FROM (the defaults a plain `docker build` uses)."""
    defaults = {}
    for keyword, args in _instructions(path):
        if keyword == "FROM":
            break
        if keyword == "ARG" and "=" in args:
            name, value = args.split("=", 1)
            defaults[name] = value.strip('"')
    return defaults


def _stages(path) -> list[tuple[str, str | None, list[tuple[str, str]]]]:
    """(base, stage name, instructions) per build stage."""
    stages = []
    for keyword, args in _instructions(path):
        if keyword == "FROM":
            words = args.split()
            stages.append((words[0], words[2] if len(words) > 2 and words[1].upper() == "AS" else None, []))
        elif stages:
            stages[-1][2].append((keyword, args))
    return stages


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


@pytest.mark.parametrize("path", ALL_DOCKERFILES, ids=ALL_NAMES)
def test_hadolint_passes(path):
    hadolint = require_binary("hadolint")
    done = subprocess.run([hadolint, "--no-color", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("path", ALL_DOCKERFILES, ids=ALL_NAMES)
def test_every_ignored_hadolint_rule_is_justified_in_a_comment(path):
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines):
        if "hadolint ignore" in line:
            rules = line.split("=", 1)[1].split(",")
            assert set(rules) <= set(IGNORED_RULES), f"{path.name}:{number + 1}: {line!r}"
            # The comment lines right above the directive say why.
            above = []
            for previous in reversed(lines[:number]):
                if not previous.startswith("#"):
                    break
                above.append(previous)
            reason = " ".join(a for a in above if "hadolint" not in a).strip("# ")
            for rule in rules:
                assert len(reason) > 20 and IGNORED_RULES[rule] in reason.lower(), (
                    f"{path.name}:{number + 1}: {line!r} has no reason"
                )
    assert not (REPO / ".hadolint.yaml").exists() and not (REPO / ".hadolint.yml").exists()


@pytest.mark.parametrize("path", DOCKERFILES, ids=NAMES)
def test_default_base_is_a_pinned_cuda_image_and_multi_stage(path):
    """The base is a build argument (the CPU profile and the smoke test pass others); its default, what a plain
    `docker compose build` uses, is NVIDIA's CUDA image. A stage may also start from an earlier stage."""
    defaults = _arg_defaults(path)
    assert re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-[a-z-]+-ubuntu\d+\.\d+", defaults["BASE_IMAGE"])
    assert defaults["PYTHON"] == "python3.12"  # Ubuntu 24.04's
    stages = _stages(path)
    assert len(stages) >= 2, "multi-stage: a build stage and a runtime stage"
    names = set()
    for base, name, _ in stages:
        assert base == "${BASE_IMAGE}" or base in names, base
        names.add(name)
    assert stages[-1][0] == "${BASE_IMAGE}", "the runtime stage starts from the base, not from the build stage"


@pytest.mark.parametrize("path", DOCKERFILES, ids=NAMES)
def test_python_comes_from_the_build_argument(path):
    code = " ".join(f"{k} {a}" for k, a in _instructions(path) if k != "ARG")
    assert not re.search(r"python3\.\d+", code), "a Python version outside the PYTHON build argument"
    for _, _, instructions in _stages(path):
        if any("${PYTHON}" in args for _, args in instructions):
            assert ("ARG", "PYTHON") in instructions, "a stage that uses PYTHON declares it"


@pytest.mark.parametrize("path", ALL_DOCKERFILES, ids=ALL_NAMES)
def test_no_syntax_directive_so_builds_pull_no_frontend_image(path):
    assert not re.search(r"^#\s*syntax\s*=", path.read_text(), re.MULTILINE | re.IGNORECASE)


@pytest.mark.parametrize("path", DOCKERFILES, ids=NAMES)
def test_every_pip_install_goes_through_the_wrapper_with_the_ca_secret(path):
    """The wrapper takes the optional CA bundle from the BuildKit secret (never a layer) and images/wheels."""
    for keyword, args in _instructions(path):
        if keyword == "RUN" and "pip install" in args:
            pytest.fail(f"{path.name}: a bare `pip install` in {args[:80]!r}")
        if keyword == "RUN" and "kl-pip-install" in args:
            assert "--mount=type=secret,id=pip_cert" in args, args[:80]
            assert "--mount=type=bind,source=images/wheels,target=/wheels" in args, args[:80]
    assert "ENV PIP_CERT" not in path.read_text() and "ARG PIP_CERT" not in path.read_text()


def test_the_pip_wrapper_is_valid_posix_shell_and_the_wheels_folder_exists():
    done = subprocess.run(["sh", "-n", str(REPO / "images" / "pip-install.sh")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (REPO / "images" / "wheels" / "README.md").is_file()  # a bind mount's source must exist


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
            assert _dockerignore_allows(source.rstrip("/")), f"{path.name}: COPY {source}: excluded by .dockerignore"


def test_worker_image_installs_cuda_torch_our_package_and_the_runpod_handler():
    path = REPO / "images" / "worker.Dockerfile"
    text = path.read_text()
    assert re.fullmatch(r"\d+\.\d+\.\d+", _arg_defaults(path)["TORCH_VERSION"])
    # No index by default: PyPI, whose Linux torch wheel is the CUDA build. The CPU profile names the CPU index.
    assert 'ARG TORCH_INDEX_URL=""' in text
    assert 'kl-pip-install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==${TORCH_VERSION}"' in text
    assert "--dep runpod" in text and "kl-pip-install --no-deps /src" in text
    assert "COPY runpod/ /opt/kernellab/runpod/" in text
    entrypoint = (REPO / "images" / "worker-entrypoint.sh").read_text()
    assert "/opt/kernellab/runpod/handler.py" in entrypoint


def test_gateway_and_loadgen_images_leave_torch_out():
    """torch may appear only in the gateway's `tokenizer` stage, which converts an embedded GGUF tokenizer at
    build time; the runtime stage copies the venv from the torch-free build stage and only that stage's cache."""
    for name in ("gateway.Dockerfile", "loadgen.Dockerfile"):
        for _, stage, instructions in _stages(REPO / "images" / name):
            code = " ".join(f"{keyword} {args}" for keyword, args in instructions)
            if stage == "tokenizer":
                continue
            assert "torch" not in code.replace("--exclude torch", ""), f"{name}: stage {stage}"
    runtime = _stages(REPO / "images" / "gateway.Dockerfile")[-1][2]
    from_tokenizer = [args for keyword, args in runtime if keyword == "COPY" and "--from=tokenizer" in args]
    assert from_tokenizer == ["--from=tokenizer --chown=10001:10001 /var/cache/kernellab/kernellab "
                              "/var/cache/kernellab/kernellab"]  # fmt: skip
    assert ("COPY", "--from=build /opt/venv /opt/venv") in runtime


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
    # `${ARG:+--dep "$ARG"}` with the ARG's default, as a plain `docker build` expands it.
    defaults = _arg_defaults(path)
    options = re.sub(r'\$\{(\w+):\+--dep "\$\1"\}', lambda m: f"--dep {defaults[m.group(1)]}" if defaults.get(m.group(1)) else "",
                     match.group(1))  # fmt: skip
    assert "$" not in options, options
    done = subprocess.run([sys.executable, str(REPO / "images" / "requirements_from_pyproject.py"),
                           str(REPO / "pyproject.toml"), *options.split()],
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
