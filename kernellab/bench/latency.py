"""Batch-1 latency: time to first token for a prompt of N tokens, and inter-token latency at a context C,
through the engine's own step loop (scheduling, input preparation and sampling included)."""

from __future__ import annotations

import contextlib
import gc
import statistics
import time

import torch

from kernellab.results import provenance


def _sync(device) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


@contextlib.contextmanager
def _no_collection():
    """A timed request without Python's cycle collector: off until the request is done, so a collection the
    request's allocations would trigger runs after it instead (no collection first: in a process holding several
    engines one takes long, and the gate calls this hundreds of times). Such a process (the gate's ablation) has
    a large heap, and a full collection landing inside a ~6 ms request may be what made its TTFT bimodal on the
    H200 (6.1 or 8-10 ms medians of one engine, 5-12 ms for SmolLM2's); the serving worker freezes its heap at
    startup for the same reason."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _random_prompt(n: int, vocab: int, gen: torch.Generator) -> list[int]:
    return torch.randint(0, min(vocab, 10000), (n,), generator=gen).tolist()


def engine_ttft(engine, prompt_len: int, reps: int = 10, seed: int = 0, prefix: list[int] | None = None) -> list[float]:
    """Seconds from add_request to the first token, fresh random prompts (no prefix-cache hits). ``prefix``:
    every prompt starts with these tokens (a shared system prompt), then ``prompt_len`` fresh ones; the warm-ups
    put the prefix in the engine's prefix cache, so the timed requests compute only their own tokens. Each
    request runs with the cycle collector off (``_no_collection``)."""
    from kernellab.runtime.request.sampling import SamplingParams

    gen = torch.Generator().manual_seed(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    for i in range(reps + 2):
        prompt = (prefix or []) + _random_prompt(prompt_len, vocab, gen)
        _sync(engine.runner.device)
        with _no_collection():
            t0 = time.perf_counter()
            engine.add_request(f"ttft{i}", prompt, params)
            while engine.has_unfinished_requests():
                engine.step()
            elapsed = time.perf_counter() - t0
        if i >= 2:  # two warm-ups
            times.append(elapsed)
    return times


def engine_decode_step(engine, num_seqs: int, prompt_len: int = 40, new_tokens: int = 256, seed: int = 2) -> dict:
    """The decode step at a batch of ``num_seqs``: that many greedy requests of ``prompt_len`` random tokens
    and ``new_tokens`` outputs each (``ignore_eos``), added at once and stepped to the end. ``step_ms`` is the
    decode phase's wall time per output token of a sequence (a multi-step window of 8 counts as 8 steps), so
    models compare whatever their window; ``tok_per_s`` counts every output token over the whole run."""
    from kernellab.runtime.request.sampling import SamplingParams

    gen = torch.Generator().manual_seed(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(f"dec{i}", _random_prompt(prompt_len, vocab, gen), params)
    _sync(engine.runner.device)
    t0 = time.perf_counter()
    first_done = None  # every sequence has its first token: the prefill phase is over
    produced: dict[str, int] = {}
    calls = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            produced[o.request_id] = produced.get(o.request_id, 0) + len(o.new_token_ids)
        calls += 1
        if first_done is None and len(produced) == num_seqs and all(produced.values()):
            _sync(engine.runner.device)
            first_done = (time.perf_counter(), min(produced.values()))
    _sync(engine.runner.device)
    end = time.perf_counter()
    assert first_done is not None and sum(produced.values()) == num_seqs * new_tokens, "lost or extra tokens"
    decode_tokens = new_tokens - first_done[1]
    return {
        "num_seqs": num_seqs,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "step_ms": round((end - first_done[0]) / max(decode_tokens, 1) * 1e3, 3),
        "tok_per_s": round(num_seqs * new_tokens / (end - t0), 1),
        "step_calls": calls,
        "wall_s": round(end - t0, 3),
    }


def engine_itl(engine, context: int, new_tokens: int = 64, seed: int = 1) -> list[float]:
    """Seconds per output token of one sequence whose context starts at ``context`` tokens: each step's
    time divided among the tokens it produced (a multi-step window yields several)."""
    from kernellab.runtime.request.sampling import SamplingParams

    gen = torch.Generator().manual_seed(seed)
    prompt = _random_prompt(context, engine.model_config.vocab_size, gen)
    engine.add_request("itl", prompt, SamplingParams(temperature=0.0, max_tokens=new_tokens + 1, ignore_eos=True))
    engine.step()  # prefill
    times: list[float] = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        produced = sum(len(o.new_token_ids) for o in engine.step())
        elapsed = time.perf_counter() - t0
        times += [elapsed / max(produced, 1)] * max(produced, 1)
    return times


@torch.inference_mode()
def hf_latency(hf, prompt_len: int, context: int, device: str, new_tokens: int = 32, reps: int = 5) -> dict:
    gen = torch.Generator().manual_seed(2)
    vocab = hf.config.vocab_size
    ttft = []
    for i in range(reps + 1):
        ids = torch.tensor([_random_prompt(prompt_len, vocab, gen)], device=device)
        _sync(device)
        t0 = time.perf_counter()
        hf(ids).logits[:, -1].argmax(-1).item()
        if i:
            ttft.append(time.perf_counter() - t0)
    ids = torch.tensor([_random_prompt(context, vocab, gen)], device=device)
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    hf.generate(ids, max_new_tokens=2, **kwargs)
    _sync(device)
    t0 = time.perf_counter()
    hf.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
    _sync(device)
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    hf.generate(ids, max_new_tokens=new_tokens + 1, min_new_tokens=new_tokens + 1, **kwargs)
    _sync(device)
    itl = (time.perf_counter() - t0 - prefill) / new_tokens
    return {"ttft_ms_p50": round(statistics.median(ttft) * 1e3, 2), "itl_ms": round(itl * 1e3, 2)}


def bench_latency(engine, prompt_lens=(2048,), contexts=(128, 2048), hf=None) -> dict:
    device = str(engine.runner.device)
    rows = []
    for n in prompt_lens:
        t = engine_ttft(engine, n)
        rows.append(
            {
                "system": "kernellab",
                "metric": "ttft",
                "tokens": n,
                "ms_p50": round(statistics.median(t) * 1e3, 3),
                "ms_min": round(min(t) * 1e3, 3),
                "reps": len(t),
            }
        )
    for c in contexts:
        t = engine_itl(engine, c)
        rows.append(
            {
                "system": "kernellab",
                "metric": "itl",
                "tokens": c,
                "ms_p50": round(statistics.median(t) * 1e3, 3),
                "ms_min": round(min(t) * 1e3, 3),
                "reps": len(t),
            }
        )
    if hf is not None:
        for n, c in zip(prompt_lens, contexts, strict=False):
            r = hf_latency(hf, n, c, device)
            rows.append({"system": "hf-transformers", "metric": "ttft", "tokens": n, "ms_p50": r["ttft_ms_p50"]})
        for c in contexts:
            r = hf_latency(hf, 16, c, device)
            rows.append({"system": "hf-transformers", "metric": "itl", "tokens": c, "ms_p50": r["itl_ms"]})
    return {
        "schema": "kernellab.bench.latency/v1",
        "provenance": provenance(device),
        "model": engine.spec.name,
        "dtype": str(engine.runner.dtype).removeprefix("torch."),
        "rows": rows,
        "config": {
            "cuda_graphs": engine.runner.graphs is not None,
            "kernels": list(getattr(engine.runner.model.ops, "enabled", ())),
        },
    }
