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

import pytest  # noqa: E402
import torch  # noqa: E402

from kernellab.kernels.testing import patch_interpreter  # noqa: E402

patch_interpreter()


@pytest.fixture
def gen(request) -> torch.Generator:
    """A generator seeded from the test id: fresh inputs per case, reproducible per case."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))
