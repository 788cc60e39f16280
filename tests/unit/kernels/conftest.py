"""Run the Triton kernels on CPU tensors through Triton's interpreter.

``triton.jit`` picks the interpreter when a kernel is *decorated*, reading ``TRITON_INTERPRET`` then, so the
variable is set here, before any kernel module is imported; modules imported earlier without it are reloaded.
"""

from __future__ import annotations

import importlib
import os
import sys
import zlib

os.environ["TRITON_INTERPRET"] = "1"

_stale = sorted(m for m in sys.modules if m.startswith("kernellab.kernels."))
for _ in range(2):  # twice: a module that imported from another picks up the reloaded version
    for _name in _stale:
        importlib.reload(sys.modules[_name])

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter as _interpreter  # noqa: E402


def _patch_scalar_index() -> None:
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
    original = _interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _interpreter._patch_lang_tensor = patched


def _patch_bf16_dot() -> None:
    """Make ``tl.dot`` on bf16 operands compute instead of multiplying raw bits.

    The interpreter stores bf16 as uint16 and hands those integers straight to ``np.matmul`` (it converts only
    fp8). Convert bf16 operands to fp32 first: products of bf16 values are exact in fp32 and the GPU's
    tensor cores accumulate them in fp32, so this is the same arithmetic.
    """
    builder_cls = type(_interpreter.interpreter_builder)
    original = builder_cls.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        def widen(h):
            if h.dtype.scalar == tl.bfloat16:
                data = _interpreter._convert_float(h.data, tl.bfloat16, tl.float32, None).view(np.float32)
                return _interpreter.TensorHandle(data.reshape(h.data.shape), tl.float32)
            return h

        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    builder_cls.create_dot = create_dot


_patch_scalar_index()
_patch_bf16_dot()


@pytest.fixture
def gen(request) -> torch.Generator:
    """A generator seeded from the test id: fresh inputs per case, reproducible per case."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))
