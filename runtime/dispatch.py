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
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kernellab.runtime import ops as reference
from kernellab.runtime.op_names import REPLACEABLE  # the ops with a Triton kernel (torch-free: configs check names)

log = logging.getLogger(__name__)

STATUS_FILE = Path(__file__).with_name("kernel_status.json")
_TORCH_ONLY = ("paged_prefill_attention",)  # the model's other op: always the reference
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
    silu_and_mul_linear: Op
    add_rms_norm_linear: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    paged_decode_attention: Op
    paged_decode_attention_qk_norm_rope: Op
    decode_attention_o_proj: Op
    argmax: Op
    l2_prefetch: Callable[..., None]
    paged_prefill_attention: Op
    varlen_causal_attention: Op
    gate_up_swiglu: Op
    qkv_proj_norm_rope_store_kv: Op
    enabled: tuple[str, ...] = ()
    torch_reasons: dict[str, str] = field(default_factory=dict)  # a replaceable op on torch → why


def ops_on_path(qk_norm: bool) -> tuple[str, ...]:
    """The replaceable ops a decoder calls (``runtime/model.py``): Qwen3's QK-norm fuses RoPE and the KV write
    into one op; the Llama family calls RoPE and the KV write separately."""
    # Qwen3's prefill steps: the same inside the QKV projection's epilogue
    rope_kv = ("qk_norm_rope_store_kv", "qkv_proj_norm_rope_store_kv") if qk_norm else ("rotary_embedding", "store_kv")
    # the fused ops: at one row (batch-1 decode) the SwiGLU in the down GEMV; in steps of many rows (prefill) in
    # the gate/up GEMM's epilogue
    mlp = ("silu_and_mul", "linear", "silu_and_mul_linear", "gate_up_swiglu")
    norms = ("rms_norm", "add_rms_norm", "add_rms_norm_linear")  # the last: at one row, the norm in the GEMV
    # Qwen3's decode steps: the QK-norm + RoPE + KV write inside the decode attention (one launch fewer a layer)
    # and at batch 1 with the output projection, which merges a few-slice attention's slices as it loads them
    fused = ("paged_decode_attention_qk_norm_rope", "decode_attention_o_proj") if qk_norm else ()
    # batch-1 decode: the layer's next weights fetched into L2 while the attention runs
    # steps that prefill fresh prompts: their causal attention
    return (
        *norms,
        *rope_kv,
        *mlp,
        "paged_decode_attention",
        *fused,
        "argmax",
        "l2_prefetch",
        "varlen_causal_attention",
    )


def load_status(path: Path = STATUS_FILE) -> dict[str, dict]:
    if not path.exists():
        return {}
    return json.loads(path.read_text()).get("ops", {})


def triton_runs_on(device) -> bool:
    return getattr(device, "type", str(device)) == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def build_ops(
    kernels: str,
    device,
    status: dict[str, dict] | None = None,
    disabled: tuple[str, ...] = (),
    why_none: str | None = None,
) -> Ops:
    """The op table: the torch reference for every op, with the allowed Triton kernels swapped in.
    ``why_none``: the reason reported for ``kernels="none"`` (the default says the setting)."""
    if kernels not in LEVELS:
        raise ValueError(f"kernels must be one of {', '.join(LEVELS)}, got {kernels!r}")
    table = {name: getattr(reference, name) for name in (*REPLACEABLE, *_TORCH_ONLY)}
    enabled: list[str] = []
    reasons: dict[str, str] = {}
    if not LEVELS[kernels]:
        reasons = dict.fromkeys(REPLACEABLE, why_none or f"kernels={kernels!r}")
    elif not triton_runs_on(device):
        reasons = dict.fromkeys(REPLACEABLE, f"no Triton on {getattr(device, 'type', device)}")
    else:
        from kernellab import kernels as lib

        available = lib.KERNELS
        if not available:
            log.warning("Triton is unavailable (%s): torch references everywhere", lib.TRITON_IMPORT_ERROR)
        status = load_status() if status is None else status
        for op in REPLACEABLE:
            entry = status.get(op, {})
            if op not in available:
                reasons[op] = f"Triton unavailable: {lib.TRITON_IMPORT_ERROR}"
            elif op in disabled:
                reasons[op] = "disabled by configuration"
            elif entry.get("status") not in LEVELS[kernels]:
                why = entry.get("reason")
                reasons[op] = f"{entry.get('status', 'no status')} at kernels={kernels!r}" + (
                    f" ({why})" if why else ""
                )
            else:
                table[op] = available[op]
                enabled.append(op)
    return Ops(**table, enabled=tuple(enabled), torch_reasons=reasons)


def ops_for_engine(cfg, device) -> Ops:
    """An engine's op table. ``backend="auto"``: the acceptance dispatcher on a GPU, the torch references on a
    CPU (where Triton would only run under its interpreter); ``"triton"`` forces the dispatcher (tests under the
    interpreter). ``cfg`` is the engine's ``EngineConfig``."""
    use_triton = cfg.backend == "triton" or (cfg.backend == "auto" and device.type == "cuda")
    if not use_triton:
        return build_ops("none", device, why_none=f"backend={cfg.backend!r} on {device.type}: torch references")
    return build_ops(cfg.kernels, device, disabled=cfg.disabled_kernels)


def graph_needs(qk_norm: bool) -> tuple[str, ...]:
    """CUDA-graph capture needs the KV write and the decode attention without host syncs (the Triton kernels)."""
    return ("qk_norm_rope_store_kv" if qk_norm else "store_kv", "paged_decode_attention")


def graph_safe(ops: Ops, qk_norm: bool) -> bool:
    return all(op in ops.enabled for op in graph_needs(qk_norm))


def fast_path(ops: Ops, qk_norm: bool, device, cuda_graphs: bool, decode_window: int) -> dict:
    """What of the fast path a model runs on, and why any part is off (logged at startup, kept by the engine):
    CUDA graphs (captured decode and prefill buckets), multi-step decode windows, and which of the ops on the
    model's path run as Triton kernels."""
    path = ops_on_path(qk_norm)
    graphs_off = None
    if getattr(device, "type", str(device)) != "cuda":
        graphs_off = f"device {getattr(device, 'type', device)}"
    elif not cuda_graphs:
        graphs_off = "cuda_graphs=False"
    elif missing := [op for op in graph_needs(qk_norm) if op not in ops.enabled]:
        graphs_off = "capture needs the Triton " + ", ".join(
            f"{op} (on torch: {ops.torch_reasons.get(op, 'not enabled')})" for op in missing
        )
    return {
        "cuda_graphs": graphs_off is None,
        "cuda_graphs_off": graphs_off,
        "decode_window": decode_window if graphs_off is None else 1,
        "triton_ops": [op for op in path if op in ops.enabled],
        "torch_ops": {op: ops.torch_reasons.get(op, "not enabled") for op in path if op not in ops.enabled},
    }


def describe_fast_path(fp: dict) -> str:
    graphs = "CUDA graphs on" if fp["cuda_graphs"] else f"CUDA graphs off ({fp['cuda_graphs_off']})"
    if fp["cuda_graphs"] and "piecewise_graphs" in fp:  # the runner adds it once it has tried the capture
        graphs += f" (steps that prefill: {'piecewise graphs' if fp['piecewise_graphs'] else 'eager'}"
        if fp.get("fresh_prompt_graphs"):
            graphs += f"; several fresh prompts: {fp['fresh_prompt_graphs']} whole-step graphs"
        graphs += ")"
    by_reason: dict[str, list[str]] = {}
    for op, why in fp["torch_ops"].items():
        by_reason.setdefault(why, []).append(op)
    torch_ops = "; ".join(f"{', '.join(ops)} ({why})" for why, ops in by_reason.items()) or "none"
    window = f"decode window {fp['decode_window']}" + (
        " (asynchronous scheduling)" if fp.get("async_scheduling") else ""
    )
    return f"{graphs}; {window}; Triton: {', '.join(fp['triton_ops']) or 'none'}; torch: {torch_ops}"
