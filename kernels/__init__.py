"""Triton kernels, one module per kernel, each mirroring a torch reference op of ``kernellab.runtime.ops``.

``KERNELS`` maps an op name to its Triton implementation (same name and signature as the reference; extra
keyword-only arguments such as ``out=`` are optional). It is built on first access, so importing this package
never imports Triton; without Triton it is empty and ``TRITON_IMPORT_ERROR`` says why. The runtime's
dispatcher enables an entry only where it is accepted (numerics + end-to-end result recorded under
``results/``); see docs/kernels.md for what each kernel teaches and what it measured.
"""

from __future__ import annotations

import importlib
from typing import Any

# op name → (module, function). Modules import triton at import time; this table does not.
_REGISTRY: dict[str, tuple[str, str]] = {
    "add": ("vector_add", "add"),
    "add_silu": ("vector_add", "add_silu"),
    "rms_norm": ("rms_norm", "rms_norm"),
    "add_rms_norm": ("rms_norm", "add_rms_norm"),
    "rotary_embedding": ("rope", "rotary_embedding"),
    "qk_norm_rope": ("rope", "qk_norm_rope"),
    "qk_norm_rope_store_kv": ("rope", "qk_norm_rope_store_kv"),
    "store_kv": ("kv_cache", "store_kv"),
    "silu_and_mul": ("swiglu", "silu_and_mul"),
    "softmax": ("softmax", "softmax"),
    "linear": ("linear", "linear"),
    "causal_attention": ("attention", "causal_attention"),
    "paged_decode_attention": ("paged_attention", "paged_decode_attention"),
    "argmax": ("argmax", "argmax"),
    "topk": ("argmax", "topk"),
    "linear_w8a16": ("quant_gemv", "linear_w8a16"),
    "linear_w4a16": ("quant_gemv", "linear_w4a16"),
}

# Ops whose Triton version is opt-in only (quality or speed not yet accepted for the default path).
EXPERIMENTAL = frozenset({"linear_w8a16", "linear_w4a16"})

TRITON_IMPORT_ERROR: ImportError | None = None
_kernels: dict[str, Any] | None = None


def _build() -> dict[str, Any]:
    global TRITON_IMPORT_ERROR
    try:
        import triton  # noqa: F401
    except ImportError as exc:  # CPU-only installs without the [triton] extra
        TRITON_IMPORT_ERROR = exc
        return {}
    table = {}
    for op, (module, fn) in _REGISTRY.items():
        table[op] = getattr(importlib.import_module(f"{__name__}.{module}"), fn)
    return table


def __getattr__(name: str) -> Any:
    global _kernels
    if name == "KERNELS":
        if _kernels is None:
            _kernels = _build()
        return _kernels
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def available() -> bool:
    """True when Triton imports and every kernel module loaded."""
    return bool(__getattr__("KERNELS"))
