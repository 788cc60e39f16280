"""Offline throughput: our engine and HF transformers (and llama.cpp when installed) on the same prompts,
same machine, same run. Writes a ``kernellab.bench.offline/v1`` artifact."""

from __future__ import annotations

import gc
import importlib.util
import time
from collections.abc import Callable

import torch

from kernellab.bench.workloads import chat_prompts, nanovllm
from kernellab.results import provenance
from kernellab.runtime.request.registry import resolve_model, wheel_file_path

Progress = Callable[[str], None]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _peak_gib(device: str) -> float | None:
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.startswith("cuda") else None


def warm_up(engine, prompts) -> None:
    """Allocations, kernel compilation for the prefill shapes and first-call costs, kept out of a timing: a few
    real prompts through a mixed prefill + decode step."""
    from kernellab.runtime.request.sampling import SamplingParams

    for i, p in enumerate(prompts[:8]):
        engine.add_request(f"warmup{i}", p, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def run_engine(engine, prompts, max_tokens: list[int], label: str, dtype: str) -> dict:
    from kernellab.runtime.request.sampling import SamplingParams

    device = str(engine.runner.device)
    warm_up(engine, prompts)
    _sync(device)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    for i, (p, n) in enumerate(zip(prompts, max_tokens, strict=True)):
        engine.add_request(f"b{i}", p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    produced = 0
    first: list[int] = []  # the first prompt's tokens: greedy agreement between the configurations
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for o in engine.step():
            produced += len(o.new_token_ids)
            if o.request_id == "b0":
                first.extend(o.new_token_ids)
    _sync(device)
    seconds = time.perf_counter() - t0
    quant = engine.config.weight_quant
    return {
        "system": "kernellab",
        "workload": label,
        "dtype": dtype if quant == "none" else f"{dtype}+{quant}",
        "weight_quant": quant,
        "first_prompt_token_ids": first,
        "num_prompts": len(prompts),
        "input_tokens": sum(map(len, prompts)),
        "output_tokens": produced,
        "seconds": round(seconds, 3),
        "output_tok_per_s": round(produced / seconds, 1),
        "peak_memory_gib": _peak_gib(device),
        "config": {
            "max_num_seqs": engine.config.max_num_seqs,
            "backend": engine.config.backend,
            "max_num_batched_tokens": engine.config.max_num_batched_tokens,
            "kv_blocks": engine.runner.num_blocks,
            "kv_cache_dtype": engine.config.kv_cache_dtype,
            "cuda_graphs": engine.config.cuda_graphs,
            "int4_max_rows": engine.config.int4_max_rows if quant != "none" else None,
        },
    }


def gate_offline_setup(device: str, **overrides) -> tuple[dict, list[list[int]], list[int]]:
    """The engine gate's offline run as the in-process A/B scripts repeat it: ``(EngineConfig keywords, prompts,
    max_tokens)``. On CUDA: random weights of the exact Qwen3-0.6B shape, 256 sequences, 16,384-token steps,
    decode windows as the engine sets them, nano-vllm's 256 prompts. On a CPU (a rehearsal of a script's path, not
    of the effect): a tiny Qwen3 checkpoint written to a temporary folder, 16 short prompts. ``overrides`` replace
    keywords."""
    gpu = device == "cuda"
    model = "qwen3-0.6b"
    if not gpu:
        import tempfile
        from pathlib import Path

        from kernellab.bench.synthetic import write_checkpoint

        model = str(Path(tempfile.mkdtemp()) / "tiny")
        write_checkpoint(Path(model), "tiny-qwen3", device="cpu")
    cfg = dict(
        model=model,
        device=device,
        dtype="bfloat16" if gpu else "float32",
        random_weights=gpu,
        max_model_len=2048 if gpu else 512,
        max_num_seqs=256 if gpu else 16,
        max_num_batched_tokens=16384 if gpu else 512,
        kernels="experimental",
        num_kv_blocks=None if gpu else 512,
        num_scheduler_steps=0,  # the engine's own (4, launched ahead; 16 read one by one before async scheduling)
    )
    cfg.update(overrides)
    prompts, outs = nanovllm() if gpu else nanovllm(16, 8, 40)
    return cfg, prompts, outs


def load_hf(model: str, device: str, dtype: torch.dtype, random_weights: bool):
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = resolve_model(model)
    if random_weights:
        cfg = AutoConfig.for_model(**{"model_type": spec.architecture, **(spec.hf_config or {})})
        with torch.device(device):
            hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        return hf.eval()
    if spec.is_gguf:
        path = wheel_file_path(spec)
        return (
            AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).to(device).eval()
        )
    from kernellab.runtime.loader import checkpoint_path

    return AutoModelForCausalLM.from_pretrained(str(checkpoint_path(spec)), dtype=dtype).to(device).eval()


@torch.inference_mode()
def run_hf_generate(hf, prompts, max_new: int, label: str, dtype: str, device: str, pad_id: int = 0) -> dict:
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    kwargs = dict(attention_mask=mask, do_sample=False, eos_token_id=None, pad_token_id=pad_id)
    hf.generate(input_ids=ids[:, -8:], max_new_tokens=2, **{**kwargs, "attention_mask": mask[:, -8:]})
    _sync(device)
    t0 = time.perf_counter()
    out = hf.generate(input_ids=ids, max_new_tokens=max_new, min_new_tokens=max_new, **kwargs)
    _sync(device)
    seconds = time.perf_counter() - t0
    produced = (out.shape[1] - width) * len(prompts)
    return {
        "system": "hf-transformers",
        "workload": label,
        "dtype": dtype,
        "num_prompts": len(prompts),
        "input_tokens": sum(map(len, prompts)),
        "output_tokens": produced,
        "seconds": round(seconds, 3),
        "output_tok_per_s": round(produced / seconds, 1),
        "peak_memory_gib": _peak_gib(device),
        "config": {"api": "generate", "padding": "left"},
    }


def run_llama_cpp(model: str, prompt: list[int], max_new: int, label: str) -> dict | None:
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    import os

    from llama_cpp import Llama

    path = wheel_file_path(resolve_model(model))
    llm = Llama(model_path=str(path), n_ctx=2048, n_threads=os.cpu_count(), verbose=False)
    eos = llm.token_eos()
    llm.create_completion(prompt=prompt, max_tokens=4)
    t0 = time.perf_counter()
    out = llm.create_completion(prompt=prompt, max_tokens=max_new, temperature=0.0, logit_bias={eos: -1e9})
    seconds = time.perf_counter() - t0
    produced = out["usage"]["completion_tokens"]
    return {
        "system": "llama.cpp",
        "workload": label,
        "dtype": "q4_1",
        "num_prompts": 1,
        "input_tokens": len(prompt),
        "output_tokens": produced,
        "seconds": round(seconds, 3),
        "output_tok_per_s": round(produced / seconds, 1),
        "peak_memory_gib": None,
        "config": {"llama_cpp_python": importlib.metadata.version("llama_cpp_python")},
    }


def bench_offline(
    model: str,
    num_prompts: int = 32,
    max_tokens: int = 128,
    dtypes: tuple[str, ...] = ("auto",),
    device: str = "auto",
    workload: str = "chat",
    peers: tuple[str, ...] = ("hf",),
    random_weights: bool = False,
    engine_kwargs: dict | None = None,
    progress: Progress = lambda _: None,
    weight_quants: tuple[str, ...] = ("none",),
) -> dict:
    from kernellab.runtime.config import EngineConfig
    from kernellab.runtime.engine import LLMEngine

    runs = []
    engine_kwargs = engine_kwargs or {}
    workloads = []
    for dtype, quant in [(d, q) for q in weight_quants for d in dtypes]:
        progress(f"loading {model} ({dtype}, weight_quant={quant})")
        engine = LLMEngine(
            EngineConfig(
                model=model,
                device=device,
                dtype=dtype,
                random_weights=random_weights,
                weight_quant=quant,
                **engine_kwargs,
            )
        )
        real_dtype = str(engine.runner.dtype).removeprefix("torch.")
        dev = str(engine.runner.device)
        if workload == "nanovllm":
            prompts, outs = nanovllm()
            workloads = [("nanovllm-256", prompts, outs)]
        else:
            prompts = chat_prompts(engine.tokenizer, num_prompts)
            workloads = [
                ("batch1", prompts[:1], [max_tokens]),
                (f"batch{num_prompts}", prompts, [max_tokens] * num_prompts),
            ]
        for label, p, n in workloads:
            progress(f"kernellab {real_dtype} {label}")
            runs.append(run_engine(engine, p, n, label, real_dtype))
        del engine
        gc.collect()
        if dev.startswith("cuda"):
            torch.cuda.empty_cache()
    if "hf" in peers and workload != "nanovllm":
        hf_dtype = torch.float32 if dev == "cpu" else torch.bfloat16
        progress(f"loading HF transformers ({hf_dtype})")
        hf = load_hf(model, dev, hf_dtype, random_weights)
        for label, p, n in workloads:
            progress(f"hf-transformers {label}")
            runs.append(run_hf_generate(hf, p, n[0], label, str(hf_dtype).removeprefix("torch."), dev))
        del hf
    if "llama.cpp" in peers and resolve_model(model).is_gguf:
        progress("llama.cpp batch1")
        result = run_llama_cpp(model, workloads[0][1][0], max_tokens, "batch1")
        if result:
            runs.append(result)
    _agreement(runs)
    return {"schema": "kernellab.bench.offline/v1", "provenance": provenance(dev), "model": model, "runs": runs}


def _agreement(runs: list[dict]) -> None:
    """Each quantized run's first-prompt greedy tokens against the dense run of the same dtype and workload:
    how many leading tokens are equal (decode paths differ in summation order, so long outputs may part)."""
    dense = {(r["workload"], r["dtype"]): r for r in runs if r.get("weight_quant") == "none"}
    for r in runs:
        if r.get("weight_quant", "none") == "none":
            continue
        ref = dense.get((r["workload"], r["dtype"].split("+")[0]))
        if ref is None:
            continue
        a, b = r["first_prompt_token_ids"], ref["first_prompt_token_ids"]
        same = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        r["first_prompt_equal_prefix_vs_dense"] = {"tokens": same, "of": min(len(a), len(b))}
