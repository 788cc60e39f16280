"""Load the served model's tokenizer without letting torch into the gateway process.

``load_tokenizer`` is torch-free once a GGUF model's tokenizer has been converted and cached; the one-time
conversion goes through transformers (and so torch). Here it runs with torch and transformers blocked from
import; if a conversion turns out to be needed, it runs in a child process and the load is retried.
"""

from __future__ import annotations

import subprocess
import sys
from contextlib import contextmanager

BLOCKED = ("torch", "transformers")


class _Blocker:
    """A meta-path finder that refuses the blocked packages (and their submodules)."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".", 1)[0] in BLOCKED:
            raise ImportError(f"{name} must not be imported by the gateway")
        return None


@contextmanager
def torch_blocked():
    blocker = _Blocker()
    sys.meta_path.insert(0, blocker)
    try:
        yield
    finally:
        sys.meta_path.remove(blocker)


def load_gateway_tokenizer(model: str):
    from kernellab.runtime.request.tokenizer import load_tokenizer

    try:
        with torch_blocked():
            return load_tokenizer(model)
    except ImportError as exc:
        if not any(b in str(exc) for b in BLOCKED):
            raise
    code = f"from kernellab.runtime.request.tokenizer import load_tokenizer; load_tokenizer({model!r})"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=600)
    with torch_blocked():
        return load_tokenizer(model)
