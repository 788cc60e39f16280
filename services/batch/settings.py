"""Settings of the batch service (the gateway's /v1/files and /v1/batches routes and the Celery worker).

Both sides read the same ``KERNELLAB_*`` environment, so they agree on the Redis, the key prefix, the model,
the files directory and the Celery queue. Importing this module imports no torch, FastAPI or Celery.
"""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import Field, field_validator

from kernellab.services.config import StackSettings

WINDOW_RE = re.compile(r"^(\d+)([smh])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600}


def window_seconds(window: str) -> int:
    """``"24h"`` → 86400. Raises ValueError for anything else than ``<digits><s|m|h>``."""
    match = WINDOW_RE.match(window)
    if match is None or int(match.group(1)) <= 0:
        raise ValueError(f"a completion window is a positive number of s, m or h, like '24h'; got {window!r}")
    return int(match.group(1)) * _UNIT_S[match.group(2)]


class BatchSettings(StackSettings):
    files_dir: str = "~/.cache/kernellab/files"  # KERNELLAB_FILES_DIR: a volume shared by gateway and batch worker
    celery_broker_url: str = ""  # KERNELLAB_CELERY_BROKER_URL; "": the stack's Redis (KERNELLAB_REDIS_URL)
    batch_queue: str = "kernellab.batch"  # the Celery queue (its Redis keys are under the key prefix)
    # Lines of one batch in the request queue at once: the worker reads interactive entries first, but a
    # running batch request holds its engine slot until it finishes, so this bounds what chat competes with.
    batch_concurrency: int = Field(8, ge=1, le=1024)
    batch_max_file_bytes: int = Field(200 * 2**20, ge=1024)  # OpenAI's limit for a batch input file
    batch_max_lines: int = Field(50_000, ge=1)  # requests per input file, as OpenAI
    batch_completion_windows: str = "24h"  # comma-separated windows POST /v1/batches accepts
    # Redis transport: an unacknowledged task is handed to another worker after this long. It must exceed
    # the longest batch, or a batch still running is delivered twice (harmless here, the lease serializes
    # them, but wasted); the default is the longest window plus an hour.
    batch_visibility_timeout_s: float | None = Field(None, gt=0)
    batch_lease_ttl_s: float = Field(30.0, gt=0)  # a batch's owner renews its lease every third of this
    batch_restore_interval_s: float = Field(10.0, gt=0)  # how often an idle worker looks for expired messages
    max_model_len: int | None = None  # None: the registry's context length, as the gateway
    max_n: int = Field(16, ge=1)

    @field_validator("batch_completion_windows")
    @classmethod
    def _windows(cls, value: str) -> str:
        windows = [w.strip() for w in value.split(",") if w.strip()]
        if not windows:
            raise ValueError("batch_completion_windows needs at least one window")
        for w in windows:
            window_seconds(w)
        return ",".join(windows)

    @property
    def completion_windows(self) -> list[str]:
        return self.batch_completion_windows.split(",")

    @property
    def visibility_timeout_s(self) -> float:
        if self.batch_visibility_timeout_s is not None:
            return self.batch_visibility_timeout_s
        return max(window_seconds(w) for w in self.completion_windows) + 3600.0

    @property
    def broker_url(self) -> str:
        return self.celery_broker_url or self.redis_url

    @property
    def files_path(self) -> Path:
        return Path(self.files_dir).expanduser()

    @property
    def celery_prefix(self) -> str:
        """Every key Celery (kombu) writes starts with this, so stacks and tests sharing a Redis stay apart."""
        return f"{self.key_prefix}celery:"
