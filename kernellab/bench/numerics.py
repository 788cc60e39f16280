"""Numerics probes through the engine's own model and KV cache (the CPU tests and the GPU gate share them)."""

from __future__ import annotations

import torch


def cached_context_logits(engine, token_ids: list[int], collect: list | None = None) -> torch.Tensor:
    """Next-token logits at every position after the engine's first prefill chunk, each computed over K/V read
    back from the paged cache: ``(len(token_ids) - first_chunk, vocab)`` fp32.

    A one-step prefill attends a fresh prompt's own K/V and never reads the cache, so it cannot show what the
    cache's storage (FP8 included) costs. Here the prompt goes through the scheduler in chunks of the engine's
    ``max_num_batched_tokens``: every chunk after the first attends its whole context, its own tokens
    included, from the cache. ``collect``, when given, receives the residual stream after each layer for those
    positions. Prefix caching is off for the call, so nothing earlier is reused."""
    from kernellab.runtime.request.sampling import SamplingParams

    budget = engine.config.max_num_batched_tokens
    if len(token_ids) <= budget:
        raise ValueError(f"{len(token_ids)} tokens fit one chunk of {budget}: nothing would read the cache")
    prefix_caching = engine.block_manager.enable_prefix_caching
    engine.block_manager.enable_prefix_caching = False
    request_id = "numerics-cached-context"
    engine.add_request(request_id, token_ids, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    logits, layers = [], []
    try:
        first = True
        while True:
            out = engine.scheduler.schedule()
            (seq, n), *others = out.scheduled
            assert not others and seq.request_id == request_id, "the engine must be idle for a numerics probe"
            ids, meta, _, _ = engine.runner.prepare(out)
            per_layer: list | None = [] if collect is not None and not first else None
            with torch.inference_mode():
                hidden = engine.runner.model(ids, meta, engine.runner.kv_caches, collect=per_layer)
                if not first:
                    logits.append(engine.runner.model.compute_logits(hidden))
            if per_layer is not None:
                layers.append([h.float() for h in per_layer])
            first = False
            if seq.num_computed_tokens + n >= len(token_ids):
                break
            engine.scheduler.advance(seq, n, None)
    finally:
        engine.abort(request_id)
        engine.block_manager.enable_prefix_caching = prefix_caching
    if collect is not None:
        collect.extend(torch.cat(parts) for parts in zip(*layers, strict=True))
    return torch.cat(logits)


def _agreement(logits: torch.Tensor, ref: torch.Tensor) -> tuple[int, float]:
    """(positions whose argmax agrees, summed KL(ref ‖ logits)) over the rows."""
    agree = int((logits.argmax(-1) == ref.argmax(-1)).sum())
    kl = torch.nn.functional.kl_div(
        logits.float().log_softmax(-1), ref.float().log_softmax(-1), log_target=True, reduction="sum"
    )
    return agree, float(kl)


def kv_cache_gate(
    engines: dict, hf_fp32, hf_bf16, sequences: list[list[int]], reference: str | None = None, margin: float = 0.5
) -> dict:
    """The KV-cache numerics gate: teacher-forced next-token argmax agreement with ``hf_fp32`` at every position
    whose context is read back from each engine's cache (``cached_context_logits``), next to ``hf_bf16``'s own
    agreement over the same positions. An engine passes when it agrees no worse than HF bf16 minus ``margin``
    points. Also the mean KL divergence from HF fp32 and, against the engine named ``reference`` (a
    full-precision cache), the cosine of every layer's residual stream at those positions.

    ``engines`` maps a name to an ``LLMEngine``; all must share ``max_num_batched_tokens`` (the first chunk,
    whose positions are not scored)."""
    chunks = {e.config.max_num_batched_tokens for e in engines.values()}
    if len(chunks) != 1:
        raise ValueError(f"engines must share max_num_batched_tokens, got {sorted(chunks)}")
    chunk = chunks.pop()
    device = next(hf_fp32.parameters()).device
    agree = dict.fromkeys([*engines, "hf_bf16"], 0)
    kl = dict.fromkeys([*engines, "hf_bf16"], 0.0)
    cos: dict[str, list[list[torch.Tensor]]] = {name: [] for name in engines if name != reference}
    total = 0
    for seq in sequences:
        ids = torch.tensor([seq], device=device)
        with torch.inference_mode():
            ref = hf_fp32(ids).logits[0, chunk:].float()
            a, k = _agreement(hf_bf16(ids).logits[0, chunk:], ref)
        agree["hf_bf16"] += a
        kl["hf_bf16"] += k
        layers: dict[str, list[torch.Tensor]] = {}
        for name, eng in engines.items():
            collect: list[torch.Tensor] | None = [] if reference is not None else None
            a, k = _agreement(cached_context_logits(eng, seq, collect), ref)
            agree[name] += a
            kl[name] += k
            if collect is not None:
                layers[name] = collect
        for name in cos:
            assert reference is not None
            cos[name].append(
                [
                    torch.nn.functional.cosine_similarity(o, r, dim=-1)
                    for o, r in zip(layers[name], layers[reference], strict=True)
                ]
            )
        total += ref.shape[0]
    pct = {name: round(100 * n / total, 3) for name, n in agree.items()}
    report = {
        "positions": total,
        "sequences": len(sequences),
        "first_chunk_tokens": chunk,
        "agreement_vs_hf_fp32_pct": pct,
        "mean_kl_vs_hf_fp32": {name: round(v / total, 6) for name, v in kl.items()},
        "gate": f"agreement >= hf_bf16 - {margin} points",
        "pass": {name: pct[name] >= pct["hf_bf16"] - margin for name in engines},
    }
    if reference is not None:
        report["layer_cosine_vs"] = reference
        report["layer_cosine"] = {
            name: [
                {"layer": i, "mean": round(float(c.mean()), 6), "min": round(float(c.min()), 6)}
                for i, c in enumerate(torch.cat(per_layer) for per_layer in zip(*rows, strict=True))
            ]
            for name, rows in cos.items()
        }
    return report


def graph_equals_eager(engine, prompts: list[list[int]], max_tokens: int = 64) -> dict:
    """Greedy output of the runner's CUDA-graph replays (multi-step windows, scheduled as the engine is set to)
    against eager single steps of the same runner, on the same prompts (prefix caching off), every row
    ``max_tokens`` long: identical. Then the
    replays with each window launched before the last one is read (asynchronous scheduling) against the same
    replays with every window read first, rows of different lengths (``max_tokens`` down to about half of it, so
    windows launched ahead leave finished rows out and gather the others' tokens into place): identical too.
    Eager steps are not compared at different lengths: once rows finish, a graph replays a larger batch bucket
    than the eager step's batch, whose GEMMs may round differently (the fresh-prompt graphs showed it)."""
    from kernellab.runtime.request.sampling import SamplingParams

    prefix_caching = engine.block_manager.enable_prefix_caching
    async_scheduling = engine.async_scheduling
    engine.block_manager.enable_prefix_caching = False
    staggered = [max_tokens - (7 * i) % (max_tokens // 2) for i in range(len(prompts))]
    results = {}
    pw = engine.runner.piecewise
    replays = pw.replays if pw is not None else 0
    graphs = engine.runner.graphs
    carried = graphs.carried_windows if graphs is not None else 0
    runs = {
        "graph": (True, async_scheduling, None),  # the engine's own setting
        "eager": (False, False, None),
        "graph_async_staggered": (True, True, staggered),
        "graph_sync_staggered": (True, False, staggered),
    }
    try:
        for name, (graphs_on, launch_ahead, lengths) in runs.items():
            engine.runner.graphs_on(graphs_on)
            engine.async_scheduling = launch_ahead
            for i, prompt in enumerate(prompts):
                n = lengths[i] if lengths else max_tokens
                engine.add_request(
                    f"{name}:{i}", prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                )
            tokens: dict[int, list[int]] = {}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    tokens.setdefault(int(out.request_id.split(":")[1]), []).extend(out.new_token_ids)
            results[name] = tokens
            if name == "graph_async_staggered" and graphs is not None:
                carried = graphs.carried_windows - carried
    finally:
        engine.runner.graphs_on(True)
        engine.async_scheduling = async_scheduling
        engine.block_manager.enable_prefix_caching = prefix_caching
    launched_ahead = results["graph_async_staggered"] == results["graph_sync_staggered"]
    return {
        "pass": results["graph"] == results["eager"] and launched_ahead,
        "graph_equals_eager": results["graph"] == results["eager"],
        "async_equals_sync": launched_ahead,
        "sequences": len(prompts),
        "tokens": max_tokens,
        "staggered_lengths": staggered,
        "graphs_used": graphs is not None,
        # windows launched before the last was read, in the asynchronous run
        "windows_launched_ahead": carried if graphs is not None else 0,
        "piecewise_replays": (pw.replays - replays) if pw is not None else 0,  # steps that prefilled, replayed
    }


def chunk_graph_matches_eager(engine, prefix: list[int], suffixes: list[list[int]], atol: float = 0.05) -> dict:
    """Chat turns after a cached prefix, one request at a time, as the chunk-after-context CUDA graph replays
    them and as the eager step runs them: the first token and its top-5 log-probabilities must agree. The graph
    pads the chunk to its bucket, so its bf16 GEMMs may round differently from the eager shapes (``atol`` on the
    log-probabilities). Suffixes shorter than a KV block keep the prefix cache the same for both runs."""
    from kernellab.runtime.request.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=5)
    graphs = engine.runner.graphs
    replays = graphs.chunk_replays if graphs is not None else 0
    results: dict[str, list] = {}
    prefix_caching = engine.block_manager.enable_prefix_caching
    engine.block_manager.enable_prefix_caching = True  # the turns continue the cached prefix
    try:
        engine.add_request("chunk-warm", prefix + suffixes[0], params)  # the prefix into the cache
        while engine.has_unfinished_requests():
            engine.step()
        for name in ("graph", "eager"):
            engine.runner.graphs_on(name == "graph")
            rows = []
            for i, suffix in enumerate(suffixes):
                engine.add_request(f"chunk-{name}{i}", prefix + suffix, params)
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        lp = out.new_logprobs[0] if out.new_logprobs else None
                        rows.append((out.new_token_ids[0], dict(lp.top) if lp else {}))
            results[name] = rows
    finally:
        engine.runner.graphs_on(True)
        engine.block_manager.enable_prefix_caching = prefix_caching
    diffs = [
        abs(g[1][t] - e[1][t])
        for g, e in zip(results["graph"], results["eager"], strict=True)
        for t in g[1]
        if t in e[1]
    ]
    same = sum(g[0] == e[0] for g, e in zip(results["graph"], results["eager"], strict=True))
    worst = max(diffs, default=float("inf"))
    used = (graphs.chunk_replays - replays) if graphs is not None else 0
    return {
        "pass": same == len(suffixes) and worst <= atol and used >= len(suffixes),
        "requests": len(suffixes),
        "same_first_token": same,
        "max_abs_logprob_diff": round(worst, 5),
        "atol": atol,
        "chunk_graph_replays": used,
    }
