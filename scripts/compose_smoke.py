"""Container smoke test (`make compose-smoke`): the real images built and the compose stack run end to end.

On a Debian machine as root, with no image registry reachable (docs/deploy.md, "The container smoke test"):

 1. host tools: Debian's docker.io and debootstrap (installed if missing), Docker Compose v2 (Debian's
    package, unpacked into a cache folder: bookworm has only v1); a dockerd is started if none answers
 2. a local base image: `debootstrap --variant=minbase bookworm`, then `docker import`
 3. the images of the `cpu` profile built from the real Dockerfiles with that base (images/local/
    compose.smoke.yml): gateway, worker, loadgen, and local Redis and Prometheus from Debian's packages;
    once with no cache, once warm; sizes, user and the absence of build secrets measured
 4. `--profile cpu up`: every healthcheck waited for; chat and completion requests with the openai client
    through the published port, one streamed
 5. the worker scaled to 2; Prometheus must scrape the gateway and both workers
 6. a stream started, the worker running it `docker kill`ed mid-stream: the stream must still complete
 7. Locust headless for 30 s against the stack, zero failures
 8. everything torn down (containers, networks, volumes; the dockerd it started) and the artifact written

Everything talks to 127.0.0.1 only (the gateway's port is published on loopback), every wait is bounded.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import itertools
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # kernellab.results from this checkout (provenance, schema check)
from kernellab.services.processes import free_port  # noqa: E402  (ports below the ephemeral range)

SCHEMA = "kernellab.deploy.compose_smoke/v1"
BASE_IMAGE = "kernellab-smoke/bookworm:minbase"
BASE_PYTHON = "python3.11"
SMOKE_OVERRIDE = "images/local/compose.smoke.yml"
# Built with the smoke override: service -> what the image is. batch-cpu runs the gateway-cpu image.
BUILT = {"gateway-cpu": "gateway", "worker-cpu": "worker", "locust": "loadgen", "redis": "redis (local)",
         "prometheus": "prometheus (local)"}  # fmt: skip
STARTED = ["redis", "prometheus", "gateway-cpu", "worker-cpu", "batch-cpu"]
MODEL = "smollm2-135m"
LOCUST_MIX = "16:8:1,32:12:1"  # short requests: the 135M model on the machine's CPU
COMPOSE_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kernellab" / "compose-smoke"
NOT_COVERED = [
    "grafana: no Debian package and no image registry here, so the test does not start it (its provisioning "
    "and every dashboard query are checked against a real Prometheus by tests/unit/deploy and "
    "tests/integration/deploy)",
    "the GPU services (profile gpu: CUDA base images, the CUDA torch wheel, the NVIDIA device reservation, "
    "GPU claiming in images/worker-entrypoint.sh) and dcgm-exporter (profile gpu-metrics): no GPU here",
    "the official redis:7.4.6-alpine and prom/prometheus:v3.5.0 images: stood in for by Debian's redis-server "
    "7.0 and prometheus 2.42, built locally (images/local/)",
    "the cpu profile's own bases and indexes: ubuntu:24.04 with python3.12 and torch from PyTorch's CPU "
    "index; the test builds the same Dockerfiles on a debootstrapped bookworm (python3.11) with the host's "
    "CPU torch wheel",
    "Docker Engine 20.10 and Compose 2.26 (Debian's); not the newest Docker or Compose",
]


# ---------------------------------------------------------------- inputs digest
def input_files() -> list[Path]:
    """The files whose change calls for a new run (docs/deploy.md): images/ (without the dropped-in
    wheels), the compose file and its env template, the build context's filter, this script, and the
    CLI modules of the commands the containers run (`kernellab gateway|worker|batch-worker`)."""
    files = [p for p in (REPO / "images").rglob("*") if p.is_file() and "__pycache__" not in p.parts
             and not (p.parent.name == "wheels" and p.name != "README.md")]  # fmt: skip
    files += [REPO / name for name in ("docker-compose.yml", ".env.example", ".dockerignore", "scripts/compose_smoke.py",
                                       "services/cli.py", "services/cli_stack.py", "services/cli_batch.py")]  # fmt: skip
    return sorted(files)


def inputs_digest() -> str:
    digest = hashlib.sha256()
    for path in input_files():
        digest.update(path.relative_to(REPO).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return "sha256:" + digest.hexdigest()


# ---------------------------------------------------------------- helpers
class SmokeFailure(RuntimeError):
    pass


def log(message: str) -> None:
    print(f"[compose-smoke {time.strftime('%H:%M:%S')}] {message}", flush=True)


def run(command: list[str], timeout: float, check: bool = True, env: dict | None = None, quiet: bool = False,
        **kwargs) -> subprocess.CompletedProcess:  # fmt: skip
    if not quiet:
        log("$ " + " ".join(str(c) for c in command))
    done = subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=timeout, env=env,
                          **kwargs)  # fmt: skip
    if check and done.returncode != 0:
        raise SmokeFailure(f"{' '.join(map(str, command[:6]))}… exited {done.returncode}:\n"
                           f"{(done.stdout + done.stderr)[-3000:]}")  # fmt: skip
    return done


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 1.0):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except (OSError, ValueError, subprocess.SubprocessError, SmokeFailure) as error:
            last = error
        time.sleep(interval_s)
    raise SmokeFailure(f"{what}: not within {timeout_s:.0f} s (last error: {last})")


# ---------------------------------------------------------------- host tools
def docker_cli() -> str:
    # Debian's docker.io CLI matches its engine; another `docker` earlier on PATH may need buildx for builds.
    return "/usr/bin/docker" if Path("/usr/bin/docker").exists() else (shutil.which("docker") or "docker")


def ensure_debian_packages() -> None:
    missing = [pkg for cmd, pkg in (("dockerd", "docker.io"), ("debootstrap", "debootstrap")) if not shutil.which(cmd)]
    if missing:
        run(["apt-get", "update", "-qq"], 600)
        run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing], 900,
            env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))  # fmt: skip


def compose_v2() -> tuple[str, str]:
    """(binary, where it came from). `docker compose` if the CLI has the v2 plugin, else Debian trixie's
    docker-compose package unpacked into a cache folder (installing it would replace bookworm's v1, which
    the static tests use)."""
    plugin = subprocess.run([docker_cli(), "compose", "version", "--short"], capture_output=True, text=True)
    if plugin.returncode == 0 and plugin.stdout.strip().lstrip("v").startswith("2."):
        return docker_cli() + " compose", "the Docker CLI's compose plugin"
    binary = COMPOSE_CACHE / "docker-compose"
    if not binary.exists():
        work = Path(tempfile.mkdtemp(prefix="kl-compose-"))
        try:
            (work / "lists" / "partial").mkdir(parents=True)
            (work / "cache" / "archives" / "partial").mkdir(parents=True)
            (work / "sources.list").write_text("deb http://deb.debian.org/debian trixie main\n")
            apt = ["-o", f"Dir::Etc::SourceList={work / 'sources.list'}", "-o", "Dir::Etc::SourceParts=/dev/null",
                   "-o", f"Dir::State::Lists={work / 'lists'}", "-o", f"Dir::Cache={work / 'cache'}"]  # fmt: skip
            run(["apt-get", *apt, "update", "-qq"], 600)
            run(["apt-get", *apt, "download", "docker-compose"], 600, cwd=work)
            deb = next(work.glob("docker-compose_*.deb"))
            run(["dpkg-deb", "-x", deb, work / "root"], 120)
            COMPOSE_CACHE.mkdir(parents=True, exist_ok=True)
            shutil.copy2(work / "root/usr/libexec/docker/cli-plugins/docker-compose", binary)
            (COMPOSE_CACHE / "SOURCE").write_text(f"{deb.name} (Debian trixie), unpacked by scripts/compose_smoke.py\n")
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return str(binary), (COMPOSE_CACHE / "SOURCE").read_text().strip()


class Dockerd:
    """The Docker engine: the one that answers, else a dockerd started here and stopped by its pid."""

    def __init__(self, workdir: Path):
        self.workdir, self.process = workdir, None

    def answers(self) -> bool:
        return subprocess.run([docker_cli(), "info"], capture_output=True, timeout=30).returncode == 0

    def start(self) -> None:
        if self.answers():
            return
        log("starting dockerd")
        output = (self.workdir / "dockerd.log").open("w")
        self.process = subprocess.Popen(["dockerd"], stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(lambda: self.process.poll() is None and self.answers(), 60, "dockerd answering")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            log(f"stopping the dockerd we started (pid {self.process.pid})")
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(30)


# ---------------------------------------------------------------- images
def build_base_image(workdir: Path, reuse: bool = False) -> dict:
    if reuse:  # quick reruns (--no-cold): a new base would invalidate every cached layer
        return {"image": BASE_IMAGE, "made_by": "reused from an earlier run", "python": BASE_PYTHON,
                "debootstrap_s": 0.0, "total_s": 0.0, "size_bytes": image_size(BASE_IMAGE)}  # fmt: skip
    root = workdir / "rootfs"
    started = time.monotonic()
    run(["debootstrap", "--variant=minbase", "--include=passwd,ca-certificates", "bookworm", root,
         "http://deb.debian.org/debian"], 900)  # fmt: skip
    debootstrap_s = time.monotonic() - started
    # As the official images: no package lists or downloaded packages in the base.
    for pattern in ("var/lib/apt/lists/*", "var/cache/apt/*.bin", "var/cache/apt/archives/*.deb"):
        for path in root.glob(pattern):
            path.unlink() if path.is_file() else None
    tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
    run([docker_cli(), "import", "-c", 'CMD ["/bin/bash"]', "-", BASE_IMAGE], 600, stdin=tar.stdout)
    tar.wait(60)
    shutil.rmtree(root, ignore_errors=True)
    return {"image": BASE_IMAGE, "made_by": "debootstrap --variant=minbase --include=passwd,ca-certificates bookworm",
            "python": BASE_PYTHON, "debootstrap_s": round(debootstrap_s, 1), "total_s": round(time.monotonic() - started, 1),
            "size_bytes": image_size(BASE_IMAGE)}  # fmt: skip


def image_size(image: str) -> int:
    return int(run([docker_cli(), "image", "inspect", "--format", "{{.Size}}", image], 60, quiet=True).stdout)


def host_torch_wheel(wheels: Path, given: str | None) -> tuple[Path, str]:
    """The host's CPU torch wheel for the base's Python, copied into images/wheels/ (see compose.smoke.yml)."""
    download = None
    try:
        if given:
            source = Path(given)
        else:
            from importlib.metadata import version

            download = Path(tempfile.mkdtemp(prefix="kl-torch-"))
            run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", download,
                 f"torch=={version('torch')}"], 900)  # fmt: skip
            source = next(download.glob("torch-*.whl"))
        match = re.match(r"torch-([^-]+)-", source.name)
        if not match or "+cpu" not in match.group(1):
            raise SmokeFailure(f"{source.name} is not a CPU build of torch: hand one in with --torch-wheel")
        target = wheels / source.name
        shutil.copy2(source, target)
        return target, match.group(1)
    finally:
        if download is not None:
            shutil.rmtree(download, ignore_errors=True)


class Stack:
    """docker compose on docker-compose.yml + the smoke override, profile cpu, a private project name."""

    def __init__(self, compose: str, env_file: Path, project: str, smoke_env: dict):
        self.compose = compose.split()
        self.project = project
        self.env = dict(os.environ, **smoke_env)
        self.base = [*self.compose, "-p", project, "--project-directory", REPO, "--env-file", env_file,
                     "-f", REPO / "docker-compose.yml", "-f", REPO / SMOKE_OVERRIDE, "--profile", "cpu",
                     "--profile", "loadtest"]  # fmt: skip

    def __call__(self, *args, timeout: float = 600, check: bool = True, quiet: bool = False):
        return run([*self.base, *args], timeout, check=check, env=self.env, quiet=quiet)

    def containers(self, service: str) -> list[str]:
        out = self("ps", "--all", "--quiet", service, quiet=True).stdout.split()
        return sorted(out)

    def state(self, container: str) -> dict:
        out = run([docker_cli(), "inspect", "--format", "{{json .State}}", container], 60, quiet=True).stdout
        return json.loads(out)

    def exec_text(self, container: str, *command: str, timeout: float = 60) -> str:
        return run([docker_cli(), "exec", container, *command], timeout, quiet=True).stdout


def build_images(stack: Stack, no_cache: bool) -> dict:
    seconds = {}
    for service in BUILT:
        started = time.monotonic()
        stack("build", *(["--no-cache"] if no_cache else []), service, timeout=1800)
        seconds[service] = round(time.monotonic() - started, 1)
    return {"per_service_s": seconds, "total_s": round(sum(seconds.values()), 1)}


def image_hygiene(stack: Stack) -> dict:
    config = json.loads(stack("config", "--format", "json", quiet=True).stdout)
    out = {}
    for service, what in BUILT.items():
        image = config["services"][service]["image"]
        user = run(
            [docker_cli(), "image", "inspect", "--format", "{{.Config.User}}", image], 60, quiet=True
        ).stdout.strip()
        uid = run([docker_cli(), "run", "--rm", "--entrypoint", "id", image, "-u"], 120, quiet=True).stdout.strip()
        # The CA bundle came in as a build secret: mounted for single RUNs, so no file of the image may be
        # the secret and no layer may set PIP_CERT.
        secret_files = run([docker_cli(), "run", "--rm", "--user", "0", "--entrypoint", "sh", image, "-c",
                            "find / -xdev \\( -name pip_cert -o -path '/run/secrets/*' \\) -print 2>/dev/null"], 300,
                           quiet=True).stdout.split()  # fmt: skip
        history = run(
            [docker_cli(), "history", "--no-trunc", "--format", "{{.CreatedBy}}", image], 60, quiet=True
        ).stdout
        entry = {"service": service, "image": image, "what": what, "size_bytes": image_size(image),
                 "user": user, "runs_as_uid": int(uid), "non_root": int(uid) != 0,
                 "build_secret_absent": not secret_files and "PIP_CERT=" not in history}  # fmt: skip
        if service == "gateway-cpu":  # the gateway image is torch-free (its tokenizer was converted at build time)
            probe = run([docker_cli(), "run", "--rm", "--entrypoint", "python", image, "-c", "import torch"], 120,
                        check=False, quiet=True)  # fmt: skip
            entry["torch_absent"] = probe.returncode != 0 and "No module named 'torch'" in probe.stderr
        out[what] = entry
    return out


# ---------------------------------------------------------------- the stack's checks
def wait_healthy(stack: Stack, services: list[str], started: float, timeout_s: float = 600) -> dict:
    """Seconds from `up` until each container is healthy (or running, for the one without a healthcheck)."""
    ready: dict[str, float] = {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pending = False
        for service in services:
            for container in stack.containers(service):
                key = f"{service}/{container[:12]}"
                if key in ready:
                    continue
                state = stack.state(container)
                health = (state.get("Health") or {}).get("Status")
                if state.get("Status") == "running" and health in (None, "healthy"):
                    ready[key] = round(time.monotonic() - started, 1)
                elif health == "unhealthy" or state.get("Status") in ("exited", "dead"):
                    logs = run([docker_cli(), "logs", "--tail", "40", container], 60, check=False, quiet=True)
                    raise SmokeFailure(f"{service} is {health or state.get('Status')}:\n{logs.stdout}{logs.stderr}")
                else:
                    pending = True
            if not stack.containers(service):
                pending = True
        if not pending:
            return ready
        time.sleep(1)
    raise SmokeFailure(
        f"not healthy within {timeout_s:.0f} s: {sorted(set(services) - {k.split('/')[0] for k in ready})}"
    )


def openai_requests(client) -> dict:
    out = {}
    started = time.monotonic()
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
                                          max_tokens=32, temperature=0)  # fmt: skip
    text = chat.choices[0].message.content or ""
    if not text.strip() or chat.usage.completion_tokens < 1:
        raise SmokeFailure(f"empty chat answer: {chat}")
    out["chat"] = {"text": text, "finish_reason": chat.choices[0].finish_reason,
                   "completion_tokens": chat.usage.completion_tokens, "seconds": round(time.monotonic() - started, 2)}  # fmt: skip
    started = time.monotonic()
    completion = client.completions.create(
        model=MODEL, prompt="The three primary colours are", max_tokens=24, temperature=0
    )
    if not completion.choices[0].text.strip():
        raise SmokeFailure(f"empty completion: {completion}")
    out["completion"] = {"text": completion.choices[0].text, "finish_reason": completion.choices[0].finish_reason,
                         "completion_tokens": completion.usage.completion_tokens,
                         "seconds": round(time.monotonic() - started, 2)}  # fmt: skip
    started = time.monotonic()
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name three planets."}],
                                            max_tokens=48, temperature=0, stream=True,
                                            stream_options={"include_usage": True})  # fmt: skip
    pieces, finish, usage, first = [], None, None, None
    for chunk in stream:
        if chunk.choices:
            first = first or time.monotonic()
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    if not "".join(pieces).strip() or finish is None or usage is None:
        raise SmokeFailure(f"stream incomplete: finish={finish} usage={usage} text={''.join(pieces)!r}")
    out["chat_stream"] = {"text": "".join(pieces), "chunks": len(pieces), "finish_reason": finish,
                          "completion_tokens": usage.completion_tokens, "ttft_s": round(first - started, 3),
                          "seconds": round(time.monotonic() - started, 2)}  # fmt: skip
    return out


def prometheus_targets(stack: Stack) -> list[dict]:
    container = stack.containers("prometheus")[0]
    body = stack.exec_text(container, "wget", "-qO-", "http://127.0.0.1:9090/api/v1/targets?state=active")
    return [{"job": t["labels"]["job"], "url": t["scrapeUrl"], "health": t["health"]}
            for t in json.loads(body)["data"]["activeTargets"]]  # fmt: skip


def check_scrapes(stack: Stack) -> dict:
    def scraped():
        targets = prometheus_targets(stack)
        up = {job: sum(1 for t in targets if t["job"] == job and t["health"] == "up") for job in ("gateway", "worker")}
        return targets if up["gateway"] == 1 and up["worker"] == 2 else None

    started = time.monotonic()
    targets = wait_for(scraped, 120, "Prometheus scraping the gateway and both workers", interval_s=2)
    return {"targets": targets, "seconds": round(time.monotonic() - started, 1)}


def running_requests(stack: Stack, container: str) -> float:
    metrics = stack.exec_text(container, "python", "-c",
                              "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:9200/metrics').read().decode())")  # fmt: skip
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("kernellab:num_requests_running"))  # fmt: skip


def kill_worker_mid_stream(stack: Stack, client, max_tokens: int = 160, kill_after_chunks: int = 8) -> dict:
    workers = stack.containers("worker-cpu")
    started = time.monotonic()
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell me a long story about a lighthouse."}],
                                            max_tokens=max_tokens, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
                                            timeout=300)  # fmt: skip
    pieces, times, finish, usage, killed, chunks_before = [], [], None, None, None, 0
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            times.append(time.monotonic())
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
        if killed is None and len(pieces) >= kill_after_chunks:
            busy = [c for c in workers if running_requests(stack, c) > 0]
            if len(busy) != 1:
                raise SmokeFailure(f"expected one worker running the stream, found {len(busy)} of {len(workers)}")
            killed, chunks_before = busy[0], len(pieces)
            run([docker_cli(), "kill", killed], 60)
            killed_at = time.monotonic()
    if killed is None:
        raise SmokeFailure(f"the stream ended after {len(pieces)} chunks, before the kill")
    if finish != "length" or usage is None or usage.completion_tokens != max_tokens:
        raise SmokeFailure(f"the stream did not complete after the kill: finish={finish}, usage={usage}")
    gaps = [b - a for a, b in itertools.pairwise(times)]
    after = [t for t in times if t > killed_at]  # chunks read after the kill (some were already in flight)
    return {"workers": len(workers), "killed_container": killed[:12], "max_tokens": max_tokens,
            "chunks_before_kill": chunks_before, "chunks_after_kill": len(after),
            "completion_tokens": usage.completion_tokens, "finish_reason": finish,
            # The stall the client saw: the dead worker's heartbeat expiring, then another worker reclaiming
            # the request and continuing from the tokens already emitted.
            "longest_gap_s": round(max(gaps), 2) if gaps else None,
            "seconds": round(time.monotonic() - started, 1),
            "killed_container_status_after": stack.state(killed).get("Status")}  # fmt: skip


def run_locust(stack: Stack, workdir: Path, run_time_s: int) -> dict:
    out = workdir / "locust"
    out.mkdir(mode=0o777)
    out.chmod(0o777)  # the image's user (10001) writes the report
    done = stack("run", "--rm", "--no-deps", "-T", "-v", f"{out}:/home/kernellab/results", "locust",
                 "locust", "--host", "http://gateway:8000", "--headless", "-u", "4", "-r", "4",
                 "--run-time", f"{run_time_s}s", "--stop-timeout", "60", "--only-summary", "--exit-code-on-error", "1",
                 "--loadgen-report", "results/loadgen.json", "--html", "results/locust.html", "--csv", "results/locust",
                 "--mix", LOCUST_MIX, "--model", MODEL, timeout=run_time_s + 240, check=False)  # fmt: skip
    report_path = out / "loadgen.json"
    if not report_path.exists():
        raise SmokeFailure(f"Locust wrote no report (exit {done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
    report = json.loads(report_path.read_text())
    requests = report["requests"]
    if done.returncode != 0 or requests["failed"] or not requests["completed"]:
        raise SmokeFailure(f"Locust: exit {done.returncode}, {requests}")
    return {"run_time_s": run_time_s, "users": 4, "mix": LOCUST_MIX, "exit_code": done.returncode,
            "requests": requests, "output_token_throughput_tps": round(report["output_token_throughput_tps"], 1),
            "ttft_p50_s": report["ttft_s"].get("p50"), "ttft_p90_s": report["ttft_s"].get("p90"),
            "e2e_p50_s": report["e2e_s"].get("p50")}  # fmt: skip


def smoke_image_ids() -> set[str]:
    out = run([docker_cli(), "image", "ls", "--quiet", "--no-trunc", "kernellab-smoke/*"], 60, quiet=True).stdout
    return set(out.split())


def remove_replaced_images(before: set[str]) -> int:
    """Our images that this run's builds replaced (now untagged): removed, so reruns do not fill the disk.
    Still-tagged images stay for the next run's warm builds."""
    removed = 0
    for image in sorted(before - smoke_image_ids()):
        removed += run([docker_cli(), "image", "rm", image], 120, check=False, quiet=True).returncode == 0
    return removed


def leftovers(project: str) -> dict:
    label = f"label=com.docker.compose.project={project}"
    count = {}
    for kind, args in (("containers", ["ps", "-a", "-q"]), ("networks", ["network", "ls", "-q"]),
                       ("volumes", ["volume", "ls", "-q"])):  # fmt: skip
        count[kind] = len(run([docker_cli(), *args, "--filter", label], 60, quiet=True).stdout.split())
    return count


# ---------------------------------------------------------------- main
def _interrupted(*_args) -> None:
    raise KeyboardInterrupt


def env_file(workdir: Path, port: int, api_key: str) -> Path:
    values = {"COMPOSE_PROJECT_NAME": "kernellab-smoke", "COMPOSE_PROFILES": "cpu",
              "REDIS_PASSWORD": secrets.token_hex(16), "KERNELLAB_API_KEYS": api_key,
              "GRAFANA_ADMIN_PASSWORD": secrets.token_hex(16), "GATEWAY_BIND": "127.0.0.1",
              "GATEWAY_PORT": str(port), "UI_BIND": "127.0.0.1", "GRAFANA_PORT": str(free_port()),
              "LOCUST_PORT": str(free_port()), "LOADGEN_API_KEY": api_key, "LOADGEN_MIX": LOCUST_MIX}  # fmt: skip
    lines = []
    for line in (REPO / ".env.example").read_text().splitlines():
        key = line.split("=", 1)[0]
        lines.append(f"{key}={values[key]}" if "=" in line and key in values else line)
    path = workdir / "smoke.env"
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o600)
    return path


def provenance(compose: str, compose_source: str) -> dict:
    from kernellab.results import cpu_name, git_commit

    def version(command: list[str]) -> str:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
        return done.stdout.strip() or done.stderr.strip()

    return {"date": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()), "commit": git_commit(),
            "host": socket.gethostname(), "python": sys.version.split()[0], "cpu": cpu_name(),
            "cpu_count": os.cpu_count(), "device": "cpu",
            "docker_engine": version([docker_cli(), "version", "--format", "{{.Server.Version}}"]),
            "docker_compose": version([*compose.split(), "version", "--short"]), "docker_compose_source": compose_source,
            "kernel": os.uname().release}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=str(REPO / "results" / "compose_smoke.json"))
    parser.add_argument("--torch-wheel", help="a CPU torch wheel for python3.11 (default: pip download of the host's)")
    parser.add_argument(
        "--pip-cert",
        default="/etc/ssl/certs/ca-certificates.crt",
        help="CA bundle handed to pip in the builds as a BuildKit secret",
    )
    parser.add_argument(
        "--no-cold",
        action="store_true",
        help="skip the no-cache build and reuse the base image "
        "of an earlier run (quick reruns; the artifact has no cold figure and is not one to commit)",
    )
    parser.add_argument("--locust-seconds", type=int, default=30)
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("compose-smoke needs root (it installs Debian packages, runs dockerd and debootstrap)", file=sys.stderr)
        return 2

    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="kl-compose-smoke-"))
    project = f"kernellab-smoke-{os.getpid()}"
    result: dict = {"schema": SCHEMA, "passed": False, "project": project, "inputs_digest": inputs_digest(),
                    "inputs": [p.relative_to(REPO).as_posix() for p in input_files()], "not_covered": NOT_COVERED,
                    "steps": {}}  # fmt: skip
    dockerd, stack, wheel, images_before = Dockerd(workdir), None, None, None
    signal.signal(signal.SIGTERM, _interrupted)  # `kill PID` tears down like Ctrl-C

    def step(name: str, function, *fargs, **fkwargs):
        log(f"--- {name}")
        step_started = time.monotonic()
        value = function(*fargs, **fkwargs)
        result["steps"][name] = round(time.monotonic() - step_started, 1)
        return value

    try:
        step("host_tools", ensure_debian_packages)
        compose, compose_source = step("compose_v2", compose_v2)
        step("dockerd", dockerd.start)
        images_before = smoke_image_ids()
        result["provenance"] = provenance(compose, compose_source)
        result["provenance"]["dockerd_started_by_test"] = dockerd.process is not None
        reuse = (
            args.no_cold
            and run([docker_cli(), "image", "inspect", BASE_IMAGE], 60, check=False, quiet=True).returncode == 0
        )
        result["base_image"] = step("base_image", build_base_image, workdir, reuse)
        wheel, torch_version = step("torch_wheel", host_torch_wheel, REPO / "images" / "wheels", args.torch_wheel)
        port, api_key = free_port(), "sk-smoke-" + secrets.token_hex(12)
        stack = Stack(compose, env_file(workdir, port, api_key), project,
                      {"SMOKE_BASE_IMAGE": BASE_IMAGE, "SMOKE_TORCH_VERSION": torch_version, "SMOKE_PIP_CERT": args.pip_cert})  # fmt: skip
        result["stack"] = {"profile": "cpu", "override": SMOKE_OVERRIDE, "services_started": STARTED, "model": MODEL,
                           "python": BASE_PYTHON, "torch": torch_version}  # fmt: skip
        result["build"] = {"cold": step("build_cold", build_images, stack, True) if not args.no_cold else None,
                           "warm": step("build_warm", build_images, stack, False)}  # fmt: skip
        result["images"] = step("image_hygiene", image_hygiene, stack)
        up_started = time.monotonic()
        stack("up", "--detach", "--no-build", *STARTED)
        result["healthy_after_s"] = step("healthchecks", wait_healthy, stack, STARTED, up_started)
        from openai import OpenAI

        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=api_key, max_retries=0, timeout=120)
        result["requests"] = step("openai_requests", openai_requests, client)
        scale_started = time.monotonic()
        stack("up", "--detach", "--no-build", "--no-recreate", "--scale", "worker-cpu=2", "worker-cpu")
        result["scaled_worker_healthy_after_s"] = step("scale_to_2", wait_healthy, stack, ["worker-cpu"], scale_started)
        result["prometheus"] = step("prometheus_scrapes", check_scrapes, stack)
        result["worker_kill"] = step("worker_kill_mid_stream", kill_worker_mid_stream, stack, client)
        result["locust"] = step("locust_headless", run_locust, stack, workdir, args.locust_seconds)
        hygiene_ok = all(i["non_root"] and i["build_secret_absent"] and i.get("torch_absent", True)
                         for i in result["images"].values())  # fmt: skip
        if not hygiene_ok:
            raise SmokeFailure(f"image hygiene: {json.dumps(result['images'], indent=1)}")
        result["passed"] = True
    except (Exception, KeyboardInterrupt) as error:  # any failure (the openai client's too) is recorded
        result["error"] = f"{type(error).__name__}: {error}"[-4000:]
        log(f"FAILED: {result['error']}")
    finally:
        if stack is not None:
            with contextlib.suppress(SmokeFailure, subprocess.SubprocessError):
                if not result["passed"]:
                    logs = stack("logs", "--no-color", "--tail", "60", check=False, quiet=True)
                    (workdir / "stack.log").write_text(logs.stdout + logs.stderr)
                    print((logs.stdout + logs.stderr)[-8000:], flush=True)  # CI shows only the console
                    log(f"stack logs: {workdir / 'stack.log'}")
                stack("down", "--volumes", "--remove-orphans", "--timeout", "20", timeout=300, check=False)
            result["teardown_leftovers"] = leftovers(project)
            if any(result["teardown_leftovers"].values()):
                result["passed"] = False
                result.setdefault("error", f"left behind: {result['teardown_leftovers']}")
        if wheel is not None:
            wheel.unlink(missing_ok=True)
        if images_before is not None:
            with contextlib.suppress(SmokeFailure, subprocess.SubprocessError):
                result["replaced_images_removed"] = remove_replaced_images(images_before)
                # Every cold (--no-cache) build adds its layers to BuildKit's cache, which nothing else frees:
                # 65 GB after a day of runs filled this machine's disk and failed a build. The warm build is
                # measured within the run, so the cache is not needed afterwards.
                run([docker_cli(), "builder", "prune", "--all", "--force"], 600, check=False, quiet=True)
        dockerd.stop()
        if result["passed"]:  # kept for its logs when the run failed
            shutil.rmtree(workdir, ignore_errors=True)
        result["duration_s"] = round(time.monotonic() - started, 1)
    result.setdefault(
        "provenance", {"date": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()), "commit": "unknown"}
    )
    from kernellab.results import write

    path = write(args.output, result)
    log(f"{'PASSED' if result['passed'] else 'FAILED'} in {result['duration_s']:.0f} s; artifact: {path}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
