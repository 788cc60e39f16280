"""Triton JIT compiles, counted and timed: the first launch of a kernel specialization in a process compiles it (or
loads it from Triton's disk cache) on the step that meets it, and that step waits.

A specialization is the kernel with its constexprs and what Triton infers from the arguments (an integer that is 1
or a multiple of 16, a pointer aligned to 16 bytes). The engine's startup (graph capture and its warm-ups) meets
most of them; a step of a shape the startup never ran (a mixed step of decode rows and fresh prompts whose
attention runs eagerly, say) can still meet a new one while serving: on the H200 such a step took ~1 s once in a
fresh worker. ``watch()`` hooks Triton's compile hooks once per process; the engine marks its startup's start and
end and reports the compiles while serving in its stats (the worker's ``kernellab:triton_jit_compiles`` counter), and
each one is logged as a warning with the kernel's specialization, so a stall while serving names its cause.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass
class JitWatch:
    """Compiles seen in this process: all of them, and those while serving (after an engine's startup ended and
    while no other engine of the process is starting)."""

    compiles: int = 0
    seconds: float = 0.0
    after_ready: int = 0
    seconds_after_ready: float = 0.0
    ready: bool = False
    starting: int = 0  # engines of this process inside their startup (their compiles are not "while serving")
    recent: list[dict] = field(default_factory=list)  # the last 16 compiles while serving: kernel, ms, signature
    _starts: dict[str, float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def begin_startup(self) -> None:
        with self._lock:
            self.starting += 1

    def end_startup(self) -> None:
        with self._lock:
            self.starting = max(0, self.starting - 1)
            self.ready = True

    def serving(self) -> bool:
        return self.ready and self.starting == 0

    def _before(self, key: str) -> None:
        with self._lock:
            self._starts[key] = time.perf_counter()

    def _after(self, key: str, name: str, signature: str) -> None:
        with self._lock:
            started = self._starts.pop(key, None)
            dt = time.perf_counter() - started if started is not None else 0.0
            self.compiles += 1
            self.seconds += dt
            if not self.serving():
                return
            self.after_ready += 1
            self.seconds_after_ready += dt
            self.recent = [*self.recent[-15:], {"kernel": name, "ms": round(dt * 1e3, 1), "specialization": signature}]
        log.warning("Triton compiled %s while serving (%.0f ms: the step waited): %s", name, dt * 1e3, signature)


_WATCH: JitWatch | None = None


@contextlib.contextmanager
def startup(w: JitWatch | None) -> Iterator[None]:
    """An engine's startup: its compiles are expected, not "while serving"."""
    if w is None:
        yield
        return
    w.begin_startup()
    try:
        yield
    finally:
        w.end_startup()


def watch() -> JitWatch | None:
    """The process's watch, hooking Triton's ``jit_cache_hook`` / ``jit_post_compile_hook`` on the first call
    (keeping any hooks already there: they still run, and a pre-compile hook that returns True still skips the
    compile). None without Triton."""
    global _WATCH
    if _WATCH is not None:
        return _WATCH
    try:
        from triton import knobs
    except ImportError:
        return None
    w = JitWatch()
    before_hook, after_hook = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook

    def pre(**kw):  # Triton's keywords: key, repr, fn, compile, is_manual_warmup, already_compiled
        skip = before_hook(**kw) if before_hook else None
        if not skip:
            w._before(str(kw["key"]))
        return skip

    def post(**kw):
        w._after(str(kw["key"]), getattr(kw["fn"], "name", "?"), kw["repr"])
        return after_hook(**kw) if after_hook else None

    knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = pre, post
    _WATCH = w
    return w
