"""Benchmark artifacts: provenance and versioned schemas.

Every artifact is a JSON object with ``"schema": "<name>/v<N>"`` and a ``provenance`` block; the schema file
``kernellab/schemas/<name with dots as underscores>_v<N>.json`` (JSON Schema) checks the rest.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import socket
import subprocess
from importlib import metadata
from pathlib import Path

SCHEMA_DIR = Path(__file__).parent / "schemas"


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def git_commit() -> str:
    if os.environ.get("KERNELLAB_COMMIT"):  # the device machine's copy of the tree has no git history
        return os.environ["KERNELLAB_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent.parent,
        )
        # "-dirty" when the code differs from the commit (edits to docs or results do not change a figure)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", *CODE_PATHS],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent.parent,
        )
        commit = out.stdout.strip() or "unknown"
        return commit + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def provenance(device: str = "cpu") -> dict:
    import torch

    info = {
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "kernellab": _version("kernellab"),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": device,
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu=props.name,
            gpu_sms=props.multi_processor_count,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            cuda=torch.version.cuda,
        )
    return info


CODE_PATHS = (
    "kernellab",
    "runtime",
    "kernels",
    "services",
    "benchmarks",
    "tests",
    "scripts",
    "runpod",
    "images",
    "pyproject.toml",
    "Makefile",
    "docker-compose.yml",
)


def schema_path(schema: str) -> Path:
    name, _, version = schema.partition("/")
    return SCHEMA_DIR / f"{name.replace('.', '_')}_{version}.json"


class ResultError(ValueError):
    pass


def validate(data: dict) -> str:
    """Check an artifact against its declared schema; returns the schema id or raises ResultError."""
    import jsonschema

    if not isinstance(data, dict) or not isinstance(data.get("schema"), str):
        raise ResultError('an artifact is a JSON object with a "schema" field such as "kernellab.bench.offline/v1"')
    path = schema_path(data["schema"])
    if not path.exists():
        known = sorted(p.stem for p in SCHEMA_DIR.glob("*.json"))
        raise ResultError(f"unknown schema {data['schema']!r} (known: {', '.join(known)})")
    try:
        jsonschema.validate(data, json.loads(path.read_text()))
    except jsonschema.ValidationError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(top level)"
        raise ResultError(f"{data['schema']}: at {where}: {exc.message}") from None
    return data["schema"]


def write(path: str | Path, data: dict) -> Path:
    validate(data)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path
