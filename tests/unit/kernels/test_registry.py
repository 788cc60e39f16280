"""The registry: every op maps to a kernel whose positional signature equals its torch reference's, and the
dispatcher's table holds exactly the ops it may swap in."""

from __future__ import annotations

import inspect

import torch

import kernellab.kernels as kernels
from kernellab.runtime import ops
from kernellab.runtime.dispatch import REPLACEABLE, load_status

# ops without a same-named function in runtime/ops.py: their references are torch functions or compositions
NO_OPS_REFERENCE = {"add", "topk", "linear_w8a16", "linear_w4a16"}


def _positional(fn):
    return [
        p.name
        for p in inspect.signature(fn).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]


def test_every_kernel_mirrors_its_reference():
    table = {**kernels.KERNELS, **kernels.STANDALONE}
    assert kernels.KERNELS and kernels.STANDALONE, f"Triton failed to import: {kernels.TRITON_IMPORT_ERROR}"
    for op, fn in table.items():
        assert fn.__name__ == op
        assert fn.__doc__
        if op not in NO_OPS_REFERENCE:
            assert _positional(fn) == _positional(getattr(ops, op)), op


def test_dispatcher_table_is_the_replaceable_ops():
    # KERNELS is what the dispatcher may enable; a standalone kernel there would be registered but never reached.
    assert set(kernels.KERNELS) == set(REPLACEABLE)
    assert not set(kernels.STANDALONE) & set(REPLACEABLE)
    # every op with a recorded GPU status is one the dispatcher can enable
    assert set(load_status()) <= set(REPLACEABLE)


def test_composite_and_torch_references():
    table = {**kernels.KERNELS, **kernels.STANDALONE}
    # the fused prologue's reference is the composition: qk_norm_rope's arguments with v, then store_kv's caches
    norm_rope = _positional(ops.qk_norm_rope)
    expected = [*norm_rope[:3], "v", *norm_rope[3:], *_positional(ops.store_kv)[2:]]
    assert _positional(table["qk_norm_rope_store_kv"]) == expected
    assert _positional(table["add"]) == ["a", "b"]
    assert _positional(table["topk"]) == ["logits", "k"]
    assert callable(torch.topk)


def test_every_module_documents_mapping_coalescing_precision_tradeoffs():
    seen = set()
    for fn in (*kernels.KERNELS.values(), *kernels.STANDALONE.values()):
        module = inspect.getmodule(fn)
        if module in seen or module.__name__.endswith(".linear"):
            continue
        seen.add(module)
        doc = module.__doc__.lower()
        for word in ("formula", "mapping", "coalescing", "precision", "trade-offs"):
            assert word in doc, f"{module.__name__} docstring lacks a {word!r} section"
