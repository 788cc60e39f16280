"""KERNELLAB_CPUS: a service process bound to a cpu list, its threads and children with it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kernellab.services.config import GatewaySettings, WorkerSettings, bindable_cpus, parse_cpu_list


def test_cpu_lists_parse_as_linux_writes_them():
    assert parse_cpu_list("") == set()
    assert parse_cpu_list("3") == {3}
    assert parse_cpu_list("0-2,8-9") == {0, 1, 2, 8, 9}
    assert parse_cpu_list(" 1 , 4-5 ") == {1, 4, 5}


@pytest.mark.parametrize("bad", ["a", "3-1", "1-", "-2", "1;2", "1.5"])
def test_a_bad_cpu_list_is_a_settings_error(bad):
    with pytest.raises(ValueError, match="cpu list"):
        WorkerSettings(cpus=bad)
    with pytest.raises(ValueError, match="cpu list"):
        GatewaySettings(cpus=bad)


def test_a_process_and_the_threads_and_children_it_starts_run_on_its_cpus():
    """In a fresh interpreter (binding this test process would outlive the test): pin_cpus() as the worker and
    the gateway call it first thing, then a thread and a child process started afterwards."""
    cpu = max(os.sched_getaffinity(0))
    script = (
        "import os, subprocess, sys, threading\n"
        "from kernellab.services.config import WorkerSettings\n"
        "WorkerSettings().pin_cpus()\n"
        "seen = []\n"
        "t = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0))); t.start(); t.join()\n"
        "child = subprocess.run([sys.executable, '-c', 'import os; print(sorted(os.sched_getaffinity(0)))'],"
        " capture_output=True, text=True, check=True).stdout.strip()\n"
        "print(sorted(os.sched_getaffinity(0)), sorted(seen[0]), child)\n"
    )
    env = dict(os.environ, KERNELLAB_CPUS=str(cpu))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [f"[{cpu}]"] * 3


def test_a_child_started_on_narrower_cores_may_widen_its_binding():
    """A launcher that binds itself to some cores (serve_gpu.py's gateway tier and clients) and then starts the
    worker: the worker inherits the narrow binding, and KERNELLAB_CPUS may still name any core of the host."""
    cpus = sorted(os.sched_getaffinity(0))
    script = (
        "import os\n"
        f"os.sched_setaffinity(0, {{{cpus[0]}}})\n"
        "from kernellab.services.config import WorkerSettings\n"
        "WorkerSettings().pin_cpus()\n"
        "print(sorted(os.sched_getaffinity(0)))\n"
    )
    env = dict(os.environ, KERNELLAB_CPUS=str(cpus[-1]))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"[{cpus[-1]}]"


def test_no_cpu_list_leaves_the_binding_alone():
    before = os.sched_getaffinity(0)
    WorkerSettings(cpus="").pin_cpus()
    assert os.sched_getaffinity(0) == before


def test_cores_the_process_may_not_use_are_named_in_the_error():
    allowed = os.sched_getaffinity(0)
    outside = max(bindable_cpus()) + 1
    with pytest.raises(ValueError, match=f"may not run on: {outside} "):
        WorkerSettings(cpus=f"{min(allowed)},{outside}").pin_cpus()
    assert os.sched_getaffinity(0) == allowed
