"""Compile the kernels' launches for a GPU on a machine without one: the CPU's guard against compile errors.

Triton's interpreter (``TRITON_INTERPRET=1``) runs a kernel's Python line by line: it never types the program,
so a branch the GPU compiler must type but the interpreter never takes (an atomic on a pointer of the wrong
dtype in a path a constexpr switches off, say) passes every CPU test and fails at its first launch on the GPU.
Triton's compiler itself needs no GPU: ``triton.compile`` lowers a kernel through TTIR, TTGIR, LLVM and PTX to
a cubin with the ``ptxas`` its wheel carries, for any target named. So the CPU tests

1. ``record_launches()``: run the launchers under the interpreter, recording each launch's specialization (the
   argument types, the constexpr values, the launch options ``num_warps``/``num_stages``/``launch_pdl``);
2. ``compile_records()``: in child processes without the interpreter (the kernels' modules must be imported
   with ``triton.jit`` producing compilable functions), one per CPU, compile each recorded specialization for
   Hopper (``sm_90``, the H200) and report the ones that fail, with the compiler's message.

    python -m kernellab.kernels.compile_check records.json   # the child: prints a JSON list of failures
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["Launch", "compile_launch", "compile_records", "record_launches"]

_DTYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.int16: "i16",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.bool: "i1",
    torch.float8_e4m3fn: "fp8e4nv",
    torch.float8_e5m2: "fp8e5",
}
_OPTIONS = ("num_warps", "num_stages", "num_ctas", "launch_pdl", "maxnreg")

Launch = dict[str, Any]  # {"module", "kernel", "signature", "constexprs", "options"}: JSON-serializable


def _arg_type(value: Any) -> str:
    from triton.tools.tensor_descriptor import TensorDescriptor

    if isinstance(value, torch.Tensor):
        return "*" + _DTYPES[value.dtype]
    if isinstance(value, TensorDescriptor):  # a host-side tensor descriptor (TMA): its dtype and block shape
        return f"tensordesc<{_DTYPES[value.base.dtype]}{list(value.block_shape)}>"
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for a runtime argument of type {type(value).__name__}")


def _is_constexpr(param: inspect.Parameter) -> bool:
    ann = param.annotation
    return ann is not inspect.Parameter.empty and "constexpr" in (ann if isinstance(ann, str) else repr(ann))


def describe(fn, args: tuple, kwargs: dict, aligned: bool = False) -> Launch:
    """The specialization of one launch of the Python kernel function ``fn`` (what the GPU would compile).
    ``aligned``: also list (``"aligned"``) the arguments the GPU's JIT specializes as divisible by 16 (pointers so
    aligned, integers so divisible), which lets the compiler vectorize loads as it does on the device."""
    params = list(inspect.signature(fn).parameters.values())
    bound = dict(zip([p.name for p in params], args, strict=False))
    bound.update({k: v for k, v in kwargs.items() if k not in _OPTIONS})
    signature, constexprs = {}, {}
    for p in params:
        value = bound.get(p.name, p.default)
        if _is_constexpr(p) or value is None:
            signature[p.name] = "constexpr"
            constexprs[p.name] = value
        else:
            signature[p.name] = _arg_type(value)
    options = {k: kwargs[k] for k in _OPTIONS if k in kwargs}
    launch: Launch = {
        "module": fn.__module__,
        "kernel": fn.__name__,
        "signature": signature,
        "constexprs": constexprs,
        "options": options,
    }
    if aligned:
        launch["aligned"] = [
            name
            for name, value in bound.items()
            if signature.get(name, "constexpr") != "constexpr"
            and (
                (isinstance(value, torch.Tensor) and value.data_ptr() % 16 == 0)
                or (isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0)
            )
        ]
    return launch


@contextlib.contextmanager
def record_launches(aligned: bool = False) -> Iterator[list[Launch]]:
    """Record every interpreted kernel launch inside the block (they still run); yields the growing list.
    ``aligned``: see ``describe``."""
    from triton.runtime.interpreter import InterpretedFunction

    launches: list[Launch] = []
    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        launches.append(describe(self.fn, args, kwargs, aligned))
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run
    try:
        yield launches
    finally:
        InterpretedFunction.run = original


def unique(launches: list[Launch]) -> list[Launch]:
    seen, out = set(), []
    for launch in launches:
        key = json.dumps(launch, sort_keys=True, default=str)
        if key not in seen:
            seen.add(key)
            out.append(launch)
    return out


def compile_launch(launch: Launch, arch: int = 90):
    """``triton.compile`` of one recorded launch for ``sm_{arch}`` (without the interpreter): the compiled kernel,
    its ``asm["cubin"]`` included."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(launch["module"]), launch["kernel"])
    names = fn.arg_names
    constexprs = {(names.index(k),): v for k, v in launch["constexprs"].items()}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in launch.get("aligned", ())}
    src = ASTSource(fn, launch["signature"], constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=launch["options"])


def _compile_one(launch: Launch, arch: int) -> str | None:
    try:
        compile_launch(launch, arch)
    except Exception as e:  # the compiler's own message is the finding
        # an error inside a called @triton.jit helper surfaces as its call site, the cause chained under it: the
        # chain, innermost last (the end is what the cut keeps)
        chain, seen = [], set()
        err: BaseException | None = e
        while err is not None and id(err) not in seen:
            seen.add(id(err))
            chain.append(f"{type(err).__name__}: {err}")
            err = err.__cause__ or err.__context__
        return "\n\ncaused by: ".join(chain)[-2000:]
    return None


def compile_records(
    launches: list[Launch], arch: int = 90, timeout: float = 900, workers: int | None = None
) -> list[dict]:
    """Compile each distinct launch for ``sm_{arch}`` in child processes without the interpreter; returns the
    failures as ``{"launch": …, "error": …}`` (empty: everything compiles).

    Each compile is one thread of LLVM and ``ptxas``: the launches are dealt round-robin to ``workers`` children
    (default: the CPUs this process may run on), so a two-core CI machine compiles two at a time."""
    import tempfile

    todo = unique(launches)
    n = max(1, min(len(todo), workers or len(os.sched_getaffinity(0))))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    jobs = []
    try:
        for i in range(n):
            with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
                json.dump({"arch": arch, "launches": todo[i::n]}, f, default=str)
            cmd = [sys.executable, "-m", "kernellab.kernels.compile_check", f.name]
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            jobs.append((f.name, proc))
        failures = []
        for _, proc in jobs:
            out, err = proc.communicate(timeout=timeout)
            if proc.returncode != 0:
                raise RuntimeError(f"compile check crashed (rc {proc.returncode}):\n{err[-4000:]}")
            failures += json.loads(out.strip().splitlines()[-1])
        return failures
    finally:
        for name, proc in jobs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            os.unlink(name)


def main(path: str) -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("run without TRITON_INTERPRET=1: the kernels must be compilable JIT functions")
    with open(path) as f:
        job = json.load(f)
    failures = []
    for launch in job["launches"]:
        error = _compile_one(launch, job["arch"])
        if error is not None:
            failures.append({"launch": launch, "error": error})
    print(json.dumps(failures, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
