"""The Triton compile watch (``runtime/jit_watch.py``): Triton calls its two hooks around each compile; here they
are called as Triton calls them (the CPU has no compiler to drive them: Triton compiles only for a GPU it can
launch on), to check the accounting, the startup bracket and that hooks already installed keep running."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

knobs = pytest.importorskip("triton").knobs

from kernellab.runtime import jit_watch  # noqa: E402


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(jit_watch, "_WATCH", None)
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)


def compile_once(key: str, name: str = "_gemv_kernel") -> None:
    kw = dict(
        key=key,
        repr=f"{name}[num_warps=4](x_ptr: *bf16, BLOCK_N: constexpr=16)",
        fn=SimpleNamespace(module="kernellab.kernels.gemv", name=name),
        compile={"key": key},
        is_manual_warmup=False,
        already_compiled=False,
    )
    if not knobs.runtime.jit_cache_hook(**kw):
        knobs.runtime.jit_post_compile_hook(**kw)


def test_compiles_during_startup_are_counted_apart_from_those_while_serving(fresh, caplog):
    w = jit_watch.watch()
    assert w is not None and jit_watch.watch() is w  # one per process
    with jit_watch.startup(w):
        compile_once("a")
        compile_once("b")
    assert (w.compiles, w.after_ready) == (2, 0)
    with caplog.at_level(logging.WARNING, logger="kernellab.runtime.jit_watch"):
        compile_once("c", "_paged_decode_kernel")
    assert (w.compiles, w.after_ready) == (3, 1)
    assert w.recent[-1]["kernel"] == "_paged_decode_kernel" and "BLOCK_N" in w.recent[-1]["specialization"]
    assert w.seconds_after_ready >= 0.0 and w.seconds >= w.seconds_after_ready
    assert "Triton compiled _paged_decode_kernel while serving" in caplog.text
    # a second engine starting in the same process: its compiles are startup again
    with jit_watch.startup(w):
        compile_once("d")
    assert w.after_ready == 1


def test_hooks_already_installed_keep_running(fresh):
    seen = []
    knobs.runtime.jit_cache_hook = lambda **kw: seen.append(("pre", kw["key"])) or kw["key"] == "skip"
    knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(("post", kw["key"]))
    w = jit_watch.watch()
    compile_once("x")
    compile_once("skip")  # the earlier hook skips this compile: no post hook, nothing counted
    assert seen == [("pre", "x"), ("post", "x"), ("pre", "skip")]
    assert w.compiles == 1
