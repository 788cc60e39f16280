"""Fixes for Triton's interpreter (``TRITON_INTERPRET=1``) so CPU runs of the kernels compute what the GPU does.

Called by the CPU interpreter tests (``tests/unit/kernels``, ``tests/unit/runtime``) and the kernel benchmarks'
CPU smoke run (``benchmarks/kernels``), hence in the package; the kernel tests' comparison helpers are in
``tests/support/kernels.py``.
"""

from __future__ import annotations

import numpy as np

_patched = False


def patch_interpreter() -> None:
    """Work around two Triton 3.6 interpreter bugs so CPU runs test what the GPU computes.

    Call before running kernels under ``TRITON_INTERPRET=1`` (the CPU tests' conftest and the CPU smoke run of
    the benchmarks do). Idempotent; patches only the interpreter, never compiled kernels.
    """
    global _patched
    if _patched:
        return
    import triton.language as tl
    from triton.runtime import interpreter as interp

    _patch_scalar_index(interp)
    _patch_bf16_dot(interp, tl.bfloat16, tl.float32)
    _patched = True


def _patch_scalar_index(interp) -> None:
    """Let ``range(start, n)`` take runtime int arguments under NumPy ≥ 2.4.

    The interpreter passes scalar kernel arguments as 1-element arrays and converts them with ``int(array)``,
    which NumPy 2.4 rejects for 1-D arrays ("only 0-dimensional arrays can be converted"), breaking every loop
    with a runtime bound. Convert through ``.item()`` instead. A no-op where NumPy still accepts it.
    """
    try:
        int(np.array([1]))
        return
    except TypeError:
        pass
    original = interp._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patched


def _patch_bf16_dot(interp, bf16, fp32) -> None:
    """Make ``tl.dot`` on bf16 operands compute instead of multiplying raw bits.

    The interpreter stores bf16 as uint16 and hands those integers straight to ``np.matmul`` (it converts only
    fp8). Convert bf16 operands to fp32 first: products of bf16 values are exact in fp32 and the GPU's
    tensor cores accumulate them in fp32, so this is the same arithmetic.
    """
    builder_cls = type(interp.interpreter_builder)
    original = builder_cls.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        def widen(h):
            if h.dtype.scalar == bf16:
                data = interp._convert_float(h.data, bf16, fp32, None).view(np.float32)
                return interp.TensorHandle(data.reshape(h.data.shape), fp32)
            return h

        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    builder_cls.create_dot = create_dot
