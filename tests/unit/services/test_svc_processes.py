"""kernellab.services.processes with stand-in children (Python one-liners): stops in order, SIGKILL to the
whole group of a child that ignores SIGTERM, a child that exits while we wait for /ready fails the wait at
once, a private redis-server that answers."""

from __future__ import annotations

import shutil
import sys
import time

import psutil
import pytest

from kernellab.services.processes import Processes, ProcessExited, free_port, redis_answers, wait_ready

STUBBORN = "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_stop_all_kills_the_group_of_a_child_that_ignores_sigterm(tmp_path):
    procs = Processes(tmp_path)
    procs.spawn("worker-0", python("import time; print('up', flush=True); time.sleep(60)"))
    # A supervisor that ignores SIGTERM, with a child of its own (as the gateway tier's processes).
    sup = procs.spawn(
        "gateway",
        python(STUBBORN + "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
               "print(c.pid, flush=True); time.sleep(60)"),
    )  # fmt: skip
    time.sleep(1.0)
    grandchild = psutil.Process(int(procs.log_lines("gateway")[0]))
    killed = procs.stop_all(("gateway", "worker"), grace=0.5)
    assert killed == ["gateway"]
    assert sup.returncode is not None and procs.procs["worker-0"].returncode is not None
    grandchild.wait(5)  # gone with its group
    assert "--- worker-0 ---\nup" in procs.log_tail()


def test_wait_ready_fails_at_once_when_a_watched_process_exits(tmp_path):
    procs = Processes(tmp_path)
    procs.spawn("gateway", python("import sys; sys.exit(3)"))
    started = time.monotonic()
    with pytest.raises(ProcessExited, match="gateway exited with code 3"):
        wait_ready(f"http://127.0.0.1:{free_port()}", timeout=30, watch=procs.procs, interval=0.05)
    assert time.monotonic() - started < 10
    assert wait_ready("http://127.0.0.1:1", timeout=30, cancelled=lambda: True) is False


def test_start_redis_answers_and_stops(tmp_path):
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed (apt-get install redis-server)")
    procs = Processes(tmp_path)
    url = procs.start_redis(free_port(), binary)
    assert redis_answers(url)
    assert procs.stop_all(grace=10) == []
    assert not redis_answers(url, 0.2)
