"""The shared loop of the in-process engine A/B scripts (``benchmarks/gpu/*_ab.py``): engines built one per variant,
measured in interleaved rounds (the order reversed every other round, so drift does not favour one), their greedy
tokens compared, and the medians summarized against the first variant."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import torch


def interleaved_rounds(
    engines: dict,
    rounds: int,
    key: str,
    measure: Callable[[object], dict],
) -> list[dict]:
    """``rounds`` rows per engine: ``{key: name, "round": r, **measure(engine)}``, engines in order on even rounds
    and reversed on odd ones; each row printed as it comes."""
    names = list(engines)
    runs: list[dict] = []
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            row = {key: name, "round": r, **measure(engines[name])}
            runs.append(row)
            figures = "  ".join(f"{k} {v:.4f}" for k, v in row.items() if k not in (key, "round"))
            print(f"round {r} {name:12s} {figures}", flush=True)
    return runs


def itl_figures(engine, contexts: Sequence[int], new_tokens: int) -> dict:
    """Batch-1 inter-token latency (ms, median) at each context: ``itl_ms_p50@<context>``."""
    from kernellab.bench.latency import engine_itl

    return {
        f"itl_ms_p50@{ctx}": round(statistics.median(engine_itl(engine, ctx, new_tokens=new_tokens)) * 1e3, 4)
        for ctx in contexts
    }


def same_greedy_tokens(engines: dict, max_tokens: int, prompt_len: int = 300, seed: int = 7) -> bool:
    """One greedy request (``max_tokens`` after a random ``prompt_len``-token prompt) through every engine: the
    same tokens from all of them."""
    from kernellab.runtime.request.sampling import SamplingParams

    prompt = torch.randint(0, 10000, (prompt_len,), generator=torch.Generator().manual_seed(seed)).tolist()
    seen = set()
    for eng in engines.values():
        eng.add_request("check", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        out: list[int] = []
        while eng.has_unfinished_requests():
            out += [t for o in eng.step() for t in o.new_token_ids]
        seen.add(tuple(out))
    return len(seen) == 1


def median_summary(runs: list[dict], key: str, names: Sequence[str]) -> dict:
    """Per figure: each variant's median over its rounds, and ``over_<first>``: each other variant's median over
    the first's (printed as a table too)."""
    figures = [k for k in runs[0] if k not in (key, "round")]
    summary: dict = {}
    for m in figures:
        med = {v: statistics.median([x[m] for x in runs if x[key] == v]) for v in names}
        summary[m] = {v: round(x, 4) for v, x in med.items()}
        summary[m][f"over_{names[0]}"] = {v: round(med[v] / med[names[0]], 4) for v in names[1:]}
        print(f"{m:20s} " + "  ".join(f"{v} {med[v]:.4f}" for v in names), flush=True)
    return summary
