"""One stack for the whole reliability package (stress, security, fuzzing, then faults, in that order):
a private redis-server, 2 workers with the embedded model, the gateway and a short-deadline gateway, all
from ``kernellab.services.stress.LocalStack`` so the CI runs exactly what ``kernellab stress`` runs.

Two API keys are configured: ``KEY`` (the load's) and ``OTHER`` (another tenant, for the isolation tests).
A missing redis-server fails the tests; nothing here is skipped."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kernellab.services.stress import LocalStack
from tests.support.reliability import KEY, OTHER


def pytest_collection_modifyitems(items):
    """Faults last: they restart the stack's processes, so the tests that need a calm stack come first."""
    here = Path(__file__).parent
    mine = [i for i in items if Path(str(i.fspath)).parent == here]
    if mine:
        start = items.index(mine[0])
        faults = [i for i in mine if Path(str(i.fspath)).name == "test_faults.py"]
        items[start : start + len(mine)] = [i for i in mine if i not in faults] + faults


@pytest.fixture(scope="package")
def rstack(tmp_path_factory):
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed (apt-get install redis-server)")
    stack = LocalStack(
        tmp_path_factory.mktemp("reliability"), workers=2, api_key=KEY, env={"KERNELLAB_API_KEYS": f"{KEY},{OTHER}"}
    )
    stack.start()
    yield stack
    stack.stop()
