"""The acceptance dispatcher: which ops run as Triton kernels.

Every replaceable op has a status in ``runtime/kernel_status.json`` — ``accepted``, ``experimental`` or
``rejected`` — backed by artifacts under ``results/`` that hold its numerics check and its end-to-end effect
(the kernel-lab rule: a kernel stays only if it is correct AND speeds up the whole workload). By default only
accepted ops run; ``kernels="experimental"`` opts into the experimental ones too; ``kernels="none"`` runs the
torch references everywhere. Ops without a kernel, or on a device Triton cannot run on, stay on torch.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kernellab.runtime import ops as reference

log = logging.getLogger(__name__)

STATUS_FILE = Path(__file__).with_name("kernel_status.json")
# The ops with a Triton kernel in ``kernellab.kernels.KERNELS`` (the same set: tests/unit/kernels/test_registry.py).
# The kernels of ``kernels.STANDALONE`` (teaching chapters, quantized GEMVs) are never dispatched.
REPLACEABLE = (
    "rms_norm",
    "add_rms_norm",
    "rotary_embedding",
    "qk_norm_rope",
    "qk_norm_rope_store_kv",
    "store_kv",
    "silu_and_mul",
    "linear",
    "paged_decode_attention",
    "argmax",
)
_TORCH_ONLY = ("paged_prefill_attention", "varlen_causal_attention")  # the model's other ops: always the reference
LEVELS = {"accepted": ("accepted",), "experimental": ("accepted", "experimental"), "none": ()}

Op = Callable[..., torch.Tensor]


@dataclass(frozen=True, slots=True)
class Ops:
    """The op table a model calls: the torch reference of every op, or the accepted Triton kernel in its place
    (each kernel keeps its reference's signature, ``runtime/ops.py``). ``enabled`` names the ops that run as
    Triton kernels."""

    rms_norm: Op
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rotary_embedding: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    qk_norm_rope: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    qk_norm_rope_store_kv: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    store_kv: Callable[..., None]
    silu_and_mul: Op
    linear: Op
    paged_decode_attention: Op
    argmax: Op
    paged_prefill_attention: Op
    varlen_causal_attention: Op
    enabled: tuple[str, ...] = ()


def load_status(path: Path = STATUS_FILE) -> dict[str, dict]:
    if not path.exists():
        return {}
    return json.loads(path.read_text()).get("ops", {})


def triton_runs_on(device) -> bool:
    return getattr(device, "type", str(device)) == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def build_ops(kernels: str, device, status: dict[str, dict] | None = None, disabled: tuple[str, ...] = ()) -> Ops:
    """The op table: the torch reference for every op, with the allowed Triton kernels swapped in."""
    if kernels not in LEVELS:
        raise ValueError(f"kernels must be one of {', '.join(LEVELS)}, got {kernels!r}")
    table = {name: getattr(reference, name) for name in (*REPLACEABLE, *_TORCH_ONLY)}
    enabled: list[str] = []
    if LEVELS[kernels] and triton_runs_on(device):
        from kernellab import kernels as lib

        available = lib.KERNELS
        if not available:
            log.warning("Triton is unavailable (%s): torch references everywhere", lib.TRITON_IMPORT_ERROR)
        status = load_status() if status is None else status
        for op in REPLACEABLE:
            if op in available and op not in disabled and status.get(op, {}).get("status") in LEVELS[kernels]:
                table[op] = available[op]
                enabled.append(op)
    return Ops(**table, enabled=tuple(enabled))


def graph_safe(ops: Ops, qk_norm: bool) -> bool:
    """CUDA-graph capture needs the KV write and the decode attention without host syncs (the Triton kernels)."""
    store = "qk_norm_rope_store_kv" if qk_norm else "store_kv"
    return "paged_decode_attention" in ops.enabled and store in ops.enabled
