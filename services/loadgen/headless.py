"""Run the Locust file headless, bounded in requests and time, and return its report.

``run_locust_headless`` is what tests and scripts call; on the command line the same run is::

    locust -f services/loadgen/locustfile.py --headless --host URL -u 4 -r 4 --run-time 60s \\
        --max-requests 40 --loadgen-report out/loadgen.json --html out/locust.html --csv out/locust
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def locustfile_path() -> Path:
    return Path(__file__).with_name("locustfile.py")


def run_locust_headless(
    url: str,
    output_dir: str | Path,
    *,
    users: int = 4,
    spawn_rate: float | None = None,
    run_time_s: int = 60,
    max_requests: int = 0,
    mix: str = "128:128:3,1024:256:1",
    endpoint: str = "chat",
    model: str | None = None,
    api_key: str | None = None,
    ignore_eos: bool = False,
    seed: int = 0,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    slo_e2e_ms: float | None = None,
    stop_timeout_s: int = 30,
) -> dict:
    """Returns ``{"exit_code", "report", "html", "csv_prefix", "log_tail"}``; ``report`` is the locustfile's
    summary (None if Locust died before writing it). Locust exits 1 when any request failed."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    report_path, html_path, csv_prefix = out / "loadgen.json", out / "locust.html", out / "locust"
    report_path.unlink(missing_ok=True)
    command = [
        sys.executable, "-m", "locust", "-f", str(locustfile_path()), "--headless", "--host", url,
        "--users", str(users), "--spawn-rate", str(spawn_rate or users), "--run-time", f"{run_time_s}s",
        "--stop-timeout", str(stop_timeout_s), "--only-summary", "--exit-code-on-error", "1",
        "--loadgen-report", str(report_path), "--html", str(html_path), "--csv", str(csv_prefix),
        "--mix", mix, "--endpoint", endpoint, "--max-requests", str(max_requests), "--seed", str(seed),
    ]  # fmt: skip
    if model:
        command += ["--model", model]
    if ignore_eos:
        command.append("--ignore-eos")
    for flag, value in (
        ("--slo-ttft-ms", slo_ttft_ms),
        ("--slo-tpot-ms", slo_tpot_ms),
        ("--slo-e2e-ms", slo_e2e_ms),
    ):
        if value is not None:
            command += [flag, str(value)]
    env = dict(os.environ)
    if api_key:
        env["KERNELLAB_API_KEY"] = api_key  # not on the command line, where `ps` shows it
    # Locust's own bound is run_time + stop_timeout; the margin covers its start-up and report writing.
    # cwd: `python -m` puts the working directory first on sys.path, and in a checkout the repository's
    # kernellab/ folder would shadow the installed package (whose subpackages live elsewhere).
    completed = subprocess.run(
        command, env=env, cwd=out, capture_output=True, text=True, timeout=run_time_s + stop_timeout_s + 60
    )
    report = json.loads(report_path.read_text()) if report_path.exists() else None
    return {
        "exit_code": completed.returncode,
        "report": report,
        "html": str(html_path),
        "csv_prefix": str(csv_prefix),
        "log_tail": (completed.stdout + completed.stderr)[-4000:],
    }
