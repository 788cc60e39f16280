"""runtime/host_gate.py: another thread runs its Python only while the engine's thread is idle or waits for the
device, never while a step launches."""

import threading
import time

from kernellab.runtime.host_gate import DEVICE, HOST, IDLE, HostGate


class Device:
    """The device as the gate sees it: marked when a wait begins, done when the test says so."""

    def __init__(self):
        self.done = False
        self.marks = 0

    def mark(self):
        self.marks += 1
        self.done = False


def gate():
    dev = Device()
    return HostGate(lambda: dev.done, dev.mark), dev


def admit_in_thread(g, timeout=5.0):
    """Start admit() in a thread; returns (thread, a list that gets the instant it returned)."""
    returned: list[float] = []
    t = threading.Thread(target=lambda: (g.admit(timeout), returned.append(time.monotonic())))
    t.start()
    return t, returned


def test_idle_admits_at_once():
    g, _dev = gate()
    t0 = time.monotonic()
    g.admit()
    assert time.monotonic() - t0 < 0.05 and (g.admitted, g.held) == (1, 0)


def test_a_launching_step_holds_the_thread_until_its_device_wait():
    g, dev = gate()
    g.host()
    t, returned = admit_in_thread(g)
    time.sleep(0.1)
    assert not returned, "admitted while the step launches"
    with g.device_wait():
        assert g.state == DEVICE and dev.marks == 1
        t.join(2)
        assert returned, "not admitted while the device works"
    assert g.state == HOST and g.held == 1
    g.idle()


def test_once_the_device_is_done_the_thread_waits_for_the_loop_to_finish_the_step():
    """The step's thread is about to want the GIL back for the results: the other thread must not take it."""
    g, dev = gate()
    g.host()
    with g.device_wait():
        dev.done = True
        t, returned = admit_in_thread(g)
        time.sleep(0.1)
        assert not returned, "admitted after the device finished, before the step took its results"
    time.sleep(0.05)
    assert not returned, "admitted while the step's host work goes on"
    g.idle()
    t.join(2)
    assert returned and g.state == IDLE


def test_a_done_wait_releases_at_the_next_device_wait():
    g, dev = gate()
    g.host()
    with g.device_wait():
        dev.done = True
        t, returned = admit_in_thread(g)
        time.sleep(0.05)
    with g.device_wait():  # the next window: marked again, the device works
        t.join(2)
        assert returned
    g.idle()


def test_admit_gives_up_after_its_timeout():
    g, _dev = gate()
    g.host()
    t0 = time.monotonic()
    g.admit(timeout=0.05)
    took = time.monotonic() - t0
    assert 0.04 <= took < 1.0 and g.held == 1 and g.held_s > 0
    g.idle()


def test_device_waits_outside_a_step_mark_nothing():
    """Offline generate and warm-up steps do not tell the gate: their waits must cost nothing."""
    g, dev = gate()
    with g.device_wait():
        assert g.state == IDLE
    assert dev.marks == 0


def test_off_cuda_there_is_no_gate():
    import torch

    from kernellab.runtime.model_runner import host_gate_for

    assert host_gate_for(torch.device("cpu")) is None


def test_the_gate_splits_a_step_into_launch_and_device_wait():
    g, _dev = gate()
    g.host()
    time.sleep(0.02)
    with g.device_wait():
        time.sleep(0.03)
    g.idle()
    assert g.launch_s is not None and 0.015 <= g.launch_s < 0.5
    assert 0.025 <= g.wait_s < 0.5
    g.host()  # a step without a device wait
    g.idle()
    assert g.launch_s is None and g.wait_s == 0.0


def test_a_phase_that_outlasts_the_timeout_holds_only_the_first_admit():
    """A launch stuck compiling kernels must not hold a burst's requests one timeout each."""
    g, _dev = gate()
    g.host()
    t0 = time.monotonic()
    g.admit(timeout=0.05)
    for _ in range(20):
        g.admit(timeout=0.05)
    assert time.monotonic() - t0 < 0.5 and g.held == 1 and g.admitted == 20
    g.idle()
    g.host()  # the next step's launch holds again
    g.admit(timeout=0.02)
    assert g.held == 2
    g.idle()
