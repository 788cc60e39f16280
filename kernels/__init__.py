"""Triton kernels, one module per kernel, each mirroring a torch reference op of ``kernellab.runtime.ops``.

``KERNELS`` maps an op name to its Triton implementation (same name and signature as the reference; extra
keyword-only arguments such as ``out=`` are optional): exactly the ops the runtime's dispatcher may swap in
(``REPLACEABLE`` in ``runtime/dispatch.py``), each enabled by its status in ``runtime/kernel_status.json``
(numerics + end-to-end result recorded under ``results/``; accepted by default, experimental on request).
``STANDALONE`` maps the kernels no engine path calls: they run only when called by name (tests,
``benchmarks/kernels``). Both tables are built on first access, so importing this package never imports Triton;
without Triton they are empty and ``TRITON_IMPORT_ERROR`` says why. See docs/kernels.md for what each kernel
teaches and what it measured.
"""

from __future__ import annotations

import importlib
from typing import Any

# op name → (module, function). Modules import triton at import time; these tables do not.
# The dispatcher's ops: each replaces the same-named function of runtime/ops.py where its status allows.
_REGISTRY: dict[str, tuple[str, str]] = {
    "rms_norm": ("rms_norm", "rms_norm"),
    "add_rms_norm": ("rms_norm", "add_rms_norm"),
    "rotary_embedding": ("rope", "rotary_embedding"),
    "qk_norm_rope": ("rope", "qk_norm_rope"),
    "qk_norm_rope_store_kv": ("rope", "qk_norm_rope_store_kv"),
    "store_kv": ("kv_cache", "store_kv"),
    "silu_and_mul": ("swiglu", "silu_and_mul"),
    "linear": ("linear", "linear"),
    "silu_and_mul_linear": ("gemv", "silu_and_mul_linear"),
    "add_rms_norm_linear": ("gemv", "add_rms_norm_linear"),
    "paged_decode_attention": ("paged_attention", "paged_decode_attention"),
    "paged_decode_attention_qk_norm_rope": ("paged_attention", "paged_decode_attention_qk_norm_rope"),
    "decode_attention_o_proj": ("paged_attention", "decode_attention_o_proj"),
    "argmax": ("argmax", "argmax"),
    "l2_prefetch": ("prefetch", "l2_prefetch"),
    "varlen_causal_attention": ("attention", "varlen_causal_attention"),
    "gate_up_swiglu": ("gemm", "gate_up_swiglu"),
    "qkv_proj_norm_rope_store_kv": ("gemm", "qkv_proj_norm_rope_store_kv"),
}

# Kernels outside the engine: the teaching chapters that tie or lose to torch on the H200 (add, add_silu,
# softmax, the tiled causal prefill attention, top-k; docs/kernels.md), and the W8A16/W4A16 GEMVs, whose packed
# weights no loader produces. Tests and benchmarks call them directly, as they call the GEMM (``gemm.linear``,
# which lost to cuBLAS and which ``linear.linear`` does not route to).
_STANDALONE: dict[str, tuple[str, str]] = {
    "add": ("vector_add", "add"),
    "add_silu": ("vector_add", "add_silu"),
    "softmax": ("softmax", "softmax"),
    "causal_attention": ("attention", "causal_attention"),
    "topk": ("argmax", "topk"),
    "linear_w8a16": ("quant_gemv", "linear_w8a16"),
    "linear_w4a16": ("quant_gemv", "linear_w4a16"),
}

TRITON_IMPORT_ERROR: ImportError | None = None
_tables: dict[str, dict[str, Any]] = {}


def _build(registry: dict[str, tuple[str, str]]) -> dict[str, Any]:
    global TRITON_IMPORT_ERROR
    try:
        import triton  # noqa: F401
    except ImportError as exc:  # CPU-only installs without the [triton] extra
        TRITON_IMPORT_ERROR = exc
        return {}
    return {op: getattr(importlib.import_module(f"{__name__}.{module}"), fn) for op, (module, fn) in registry.items()}


def __getattr__(name: str) -> Any:
    registry = {"KERNELS": _REGISTRY, "STANDALONE": _STANDALONE}.get(name)
    if registry is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _tables:
        _tables[name] = _build(registry)
    return _tables[name]


def available() -> bool:
    """True when Triton imports and every kernel module of the dispatcher loaded."""
    return bool(__getattr__("KERNELS"))
