"""The 8-bit KV caches' numerics gate (FP8 and int8) on the embedded real model (SmolLM2-135M, GGUF, CPU).

Sequences: each of the benchmarks' chat questions plus ``--new-tokens`` tokens the fp32 model samples
(temperature 0.8, top-p 0.95). Every position after the first chunk of ``--chunk`` tokens attends a context read
back from the cache (``kernellab.bench.numerics``), so what the cache stores shows in the logits. Scored against
HF transformers fp32 on the same GGUF: our fp32 cache (the path itself, expected exact), our FP8 and int8
caches, and HF bf16 (the gate: an 8-bit cache's agreement no worse than HF bf16's minus 0.5 points).
``--split`` also quantizes only K or only V (quantize → dequantize into an fp32 cache) to show which of the two
carries the loss; ``--int8`` does the same with int8 (one scale per token and head, the same bytes): K alone,
and K and V. ``--hadamard`` simulates an FP8 cache that stores each K and V row rotated by the normalised
Hadamard matrix H of the head dimension (``H·x`` quantized; read back as ``Hᵀ·dequantize(…)``, which is what a
kernel computes when it rotates q by H and the attention output by Hᵀ, or folds Hᵀ into the output projection):
the rotation spreads K's outlier channels over all D values, so FP8's per-value relative error no longer lands on
the few products that dominate ``q·k``.

    python benchmarks/fp8_kv_numerics.py --output results/fp8_kv_cpu.json
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

CHAT_SAMPLING = {"temperature": 0.8, "top_p": 0.95, "seed": 11}


def _engine(kv_cache_dtype: str, chunk: int):
    from kernellab.runtime.config import EngineConfig
    from kernellab.runtime.engine import LLMEngine

    return LLMEngine(
        EngineConfig(
            model="smollm2-135m",
            device="cpu",
            dtype="float32",
            kv_cache_dtype=kv_cache_dtype,
            max_num_batched_tokens=chunk,
            num_kv_blocks=64,
        )
    )


def int8_round_trip(x: torch.Tensor) -> torch.Tensor:
    """``x: (..., D)`` through int8 with one scale per row (``amax / 127``), back to x's dtype: the same bytes per
    value as FP8, with an error that is uniform in absolute terms (FP8's is ~3 significant bits of each value)."""
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127.0
    return (torch.round(xf / scale).clamp(-127, 127) * scale).to(x.dtype)


def hadamard(d: int) -> torch.Tensor:
    """The ``d × d`` Hadamard matrix (Sylvester's construction, ``d`` a power of two) scaled to be orthonormal."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two head dimension, got {d}")
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / d**0.5


def _store_quantizing(ops_table, which: str, fmt: str = "fp8"):
    """An op table whose KV write stores ``dequantize(quantize(x))`` of K and/or V in a full-precision cache
    (``fmt``: fp8 as the FP8 cache stores it, int8 per ``int8_round_trip``, or ``fp8-hadamard``: FP8 of each row
    rotated by the Hadamard matrix, rotated back after)."""
    from kernellab.runtime import ops

    store = ops_table.store_kv

    def fp8(x):
        return ops.dequantize_kv(*ops.quantize_kv(x)).to(x.dtype)

    def round_trip(x):
        if fmt == "int8":
            return int8_round_trip(x)
        if fmt == "fp8-hadamard":
            h = hadamard(x.shape[-1]).to(x.dtype)
            return fp8(x @ h.T) @ h  # rows rotated by H, quantized, rotated back by Hᵀ (x @ H.T = (H x)ᵀ per row)
        return fp8(x)

    def store_kv(k, v, k_cache, v_cache, slot_mapping, *, k_scales=None, v_scales=None):
        if "k" in which:
            k = round_trip(k)
        if "v" in which:
            v = round_trip(v)
        store(k, v, k_cache, v_cache, slot_mapping)

    return dataclasses.replace(ops_table, store_kv=store_kv)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--chunk", type=int, default=32)
    ap.add_argument("--split", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument(
        "--int8", action=argparse.BooleanOptionalAction, default=True, help="also int8 K only and int8 K and V"
    )
    ap.add_argument(
        "--hadamard",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also FP8 of Hadamard-rotated K (alone, and with V)",
    )
    ap.add_argument("--output", default="results/fp8_kv_cpu.json")
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from kernellab.bench.numerics import kv_cache_gate
    from kernellab.bench.workloads import CHAT_QUESTIONS
    from kernellab.results import provenance, write
    from kernellab.runtime.engine import LLM
    from kernellab.runtime.request.registry import resolve_model, wheel_file_path
    from kernellab.runtime.request.sampling import SamplingParams

    sampler = LLM("smollm2-135m", device="cpu", dtype="float32")
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True, **CHAT_SAMPLING)
    questions = CHAT_QUESTIONS[: args.questions]
    outs = sampler.generate([sampler.encode([{"role": "user", "content": q}]) for q in questions], params)
    sequences = [o.prompt_token_ids + o.token_ids for o in outs]
    del sampler
    path = wheel_file_path(resolve_model("smollm2-135m"))
    hf = {
        dt: AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dt).eval()
        for dt in (torch.float32, torch.bfloat16)
    }
    engines = {
        "fp32_cache": _engine("auto", args.chunk),
        "fp8_cache": _engine("fp8", args.chunk),
        "int8_cache": _engine("int8", args.chunk),
    }
    if args.split:
        for which in ("k", "v"):
            eng = _engine("auto", args.chunk)
            eng.runner.model.ops = _store_quantizing(eng.runner.model.ops, which)
            engines[f"fp8_{which}_only_simulated"] = eng
    if args.int8:
        for which, name in (("k", "int8_k_only_simulated"), ("kv", "int8_kv_simulated")):
            eng = _engine("auto", args.chunk)
            eng.runner.model.ops = _store_quantizing(eng.runner.model.ops, which, "int8")
            engines[name] = eng
    if args.hadamard:
        for which, name in (("k", "fp8_hadamard_k_only_simulated"), ("kv", "fp8_hadamard_kv_simulated")):
            eng = _engine("auto", args.chunk)
            eng.runner.model.ops = _store_quantizing(eng.runner.model.ops, which, "fp8-hadamard")
            engines[name] = eng
    gate = kv_cache_gate(engines, hf[torch.float32], hf[torch.bfloat16], sequences, reference="fp32_cache")
    result = {
        "schema": "kernellab.bench.kv_cache_numerics/v1",
        "provenance": provenance("cpu"),
        "model": "smollm2-135m (GGUF Q4_1 dequantized, real weights)",
        "workload": {
            "questions": len(questions),
            "new_tokens": args.new_tokens,
            "sampling": CHAT_SAMPLING,
            "first_chunk_tokens": args.chunk,
            "engine_dtype": "float32",
            "reference": "HF transformers float32 on the same GGUF",
        },
        "kv_cache": "fp8 e4m3 (amax / 448) and int8 (amax / 127), one fp32 scale per token and KV head",
        "gate": gate,
    }
    write(args.output, result)
    pct = gate["agreement_vs_hf_fp32_pct"]
    print(f"{'system':28s} {'agree %':>8s} {'mean KL':>9s}  gate")
    for name, value in pct.items():
        ok = gate["pass"].get(name, "")
        print(f"{name:28s} {value:8.2f} {gate['mean_kl_vs_hf_fp32'][name]:9.5f}  {ok}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
