"""Steps that prefill, timed one at a time, and the piecewise CUDA graphs against the eager forward.

A serving engine's prefill steps come in mixes: a burst of fresh prompts (the interactive TTFT), prompts joining
a decoding batch (continuous batching under arrivals), a chat turn after a cached system prompt. ``step_times``
builds each mix in a live engine (decode rows already decoding, then the prompts added) and times the one
``engine.step()`` that runs it, host work and the sampler's sync included, in alternating order: the runner as it
runs (``graph``: a whole-step graph where one is captured, such as several fresh prompts', else the piecewise
graphs), the piecewise graphs alone, and eagerly. ``piecewise_matches_eager`` runs mixed steps through both forwards
of the same runner and compares their logits (the graphs pad a step to its token bucket, so bf16 GEMMs may round
differently); ``fresh_graph_matches_eager`` does the same for the graphs of several fresh prompts. All run on any
device; off a GPU there are no graphs and only the eager side is measured."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kernellab.bench.latency import _random_prompt, _sync

# (name, decode rows, prompt lengths): a 64-client burst's full step, its quarter, arrivals into a decoding batch
MIXES_H200 = (
    ("burst-32x512", 0, (512,) * 32),
    ("burst-8x512", 0, (512,) * 8),
    ("decode64+2x512", 64, (512, 512)),
    ("decode128+1x200", 128, (200,)),
)


# Fresh prompts whose step pads its (tokens, prompts) bucket: rows past the last prompt and empty prompts
FRESH_PADDED_MIXES = (
    ("fresh-5-odd", 0, (300, 77, 512, 129, 40)),
    ("fresh-3-short", 0, (17, 2, 33)),
)


@dataclass
class _Engine:
    engine: object
    gen: torch.Generator
    counter: int = 0

    def add(self, prompt_len: int, max_tokens: int) -> str:
        from kernellab.runtime.request.sampling import SamplingParams

        rid = f"steps{self.counter}"
        self.counter += 1
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        vocab = self.engine.model_config.vocab_size  # type: ignore[attr-defined]
        self.engine.add_request(rid, _random_prompt(prompt_len, vocab, self.gen), params)  # type: ignore[attr-defined]
        return rid


@contextlib.contextmanager
def _computing(engine, seed: int) -> Iterator[_Engine]:
    """The engine with its prefix cache off (every mix computes its prompts), restored after; prompts from ``seed``."""
    prefix_caching = engine.block_manager.enable_prefix_caching
    engine.block_manager.enable_prefix_caching = False
    try:
        yield _Engine(engine, torch.Generator().manual_seed(seed))
    finally:
        engine.block_manager.enable_prefix_caching = prefix_caching


def _decoding(e: _Engine, rows: int) -> list[str]:
    """``rows`` requests past their prefill, decoding (long outputs, so they outlive the measurement)."""
    eng = e.engine
    ids = [e.add(32, eng.max_model_len - 33) for _ in range(rows)]  # type: ignore[attr-defined]
    sched = eng.scheduler  # type: ignore[attr-defined]
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running) or sched.waiting:
        eng.step()  # type: ignore[attr-defined]
    return ids


def _timed_step(e: _Engine, prompts: tuple[int, ...]) -> tuple[float, int, int]:
    """Add the prompts to the engine as it stands and time the step that takes them: (seconds, rows, tokens)."""
    eng = e.engine
    added = [e.add(n, 2) for n in prompts]
    _sync(eng.runner.device)  # type: ignore[attr-defined]
    t0 = time.perf_counter()
    eng.step()  # type: ignore[attr-defined]
    _sync(eng.runner.device)  # type: ignore[attr-defined]
    dt = time.perf_counter() - t0
    rows, tokens = eng.last_schedule  # type: ignore[attr-defined]
    for rid in added:
        eng.abort(rid)  # type: ignore[attr-defined]
    return dt, rows, tokens


def _mode(runner, mode: str) -> None:
    """``graph``: the runner's own choice (whole-step graphs first, then piecewise); ``piecewise``: the piecewise
    graphs only; ``eager``: neither."""
    runner.use_graphs = mode == "graph" and runner.graphs is not None
    runner.use_piecewise = mode in ("graph", "piecewise") and runner.piecewise is not None


def step_times(engine, mixes=MIXES_H200, reps: int = 5, seed: int = 0) -> list[dict]:
    """Per mix: the median wall time of the step that runs it, as the runner runs it (where it has whole-step
    graphs for it), with the piecewise graphs (where it has them) and eagerly, alternating A B C, C B A, … over
    ``reps`` rounds; and how many replays each graph side made."""
    runner = engine.runner
    fresh_graphs = runner.graphs is not None and bool(runner.graphs.fresh_token_buckets)
    modes = (("graph",) if fresh_graphs else ()) + (("piecewise",) if runner.piecewise is not None else ()) + ("eager",)
    out = []
    with _computing(engine, seed) as e, contextlib.ExitStack() as restore:
        restore.callback(_mode, runner, "graph")
        for name, decode_rows, prompts in mixes:
            live = _decoding(e, decode_rows)
            times: dict[str, list[float]] = {m: [] for m in modes}
            shape = None
            replays0 = runner.piecewise.replays if runner.piecewise is not None else 0
            fresh0 = runner.graphs.fresh_replays if fresh_graphs else 0
            for r in range(reps + 1):  # the first round warms up
                order = modes if r % 2 == 0 else modes[::-1]
                for mode in order:
                    _mode(runner, mode)
                    dt, rows, tokens = _timed_step(e, prompts)
                    shape = (rows, tokens)
                    if r:
                        times[mode].append(dt)
            for rid in live:
                engine.abort(rid)
            row = {
                "mix": name,
                "decode_rows": decode_rows,
                "prompts": list(prompts),
                "step_rows": shape[0] if shape else None,
                "step_tokens": shape[1] if shape else None,
                **{f"{m}_ms": round(statistics.median(v) * 1e3, 3) for m, v in times.items()},
                "reps": reps,
            }
            if runner.piecewise is not None:
                row["piecewise_replays"] = runner.piecewise.replays - replays0
                row["bucket"] = runner.piecewise.bucket(shape[1]) if shape else None
                row["speedup"] = round(row["eager_ms"] / row["piecewise_ms"], 3)
            if fresh_graphs:
                row["fresh_graph_replays"] = runner.graphs.fresh_replays - fresh0
            out.append(row)
    return out


def argmax_agreement(ours: torch.Tensor, eager: torch.Tensor) -> tuple[float, int, list[float]]:
    """Two forwards' logits of the same rows: (largest |difference|, rows whose argmax agree, the eager logit gap
    between the two tokens of each row whose argmax differ). Where every logit of a row moved by at most d, only
    tokens whose eager logits lie within 2·d can swap places, so the gaps say how close the swapped tokens were."""
    a, b = ours.float(), eager.float()
    if not b.numel():
        return 0.0, 0, []
    mine, theirs = a.argmax(-1), b.argmax(-1)
    rows = torch.arange(b.shape[0], device=b.device)
    differ = mine != theirs
    gaps = (b[rows, theirs] - b[rows, mine]).abs()[differ]
    return float((a - b).abs().max()), int((~differ).sum()), [round(float(g), 5) for g in gaps]


@torch.inference_mode()
def fresh_graph_matches_eager(engine, mixes=MIXES_H200, seed: int = 2, atol: float = 0.1) -> dict:
    """Each mix of several fresh prompts that a captured (tokens, prompts) graph takes, replayed and run eagerly by
    the same runner: the logits of every sampling row (max abs difference) and whether their greedy tokens agree.
    The graph pads the step to its bucket, so its bf16 GEMMs run at another M than the eager step's and cuBLAS may
    pick other kernels that round differently (a 52-row step padded to 512 rows differed by up to 0.049 on the
    H200, where 1,058 rows padded to 2,048 were identical). With random weights the top logits lie close together,
    so rounding that small can swap two tokens whose eager logits are that close (``argmax_agreement`` records how
    close). Passes when every logit is within ``atol`` (rounding of bf16 GEMMs, as for the piecewise graphs; a wrong
    attention bound or a padding row leaking in moves logits by far more) and a graph replayed for each mix."""
    runner, graphs = engine.runner, engine.runner.graphs
    if graphs is None or not graphs.fresh_token_buckets:
        return {"pass": None, "why": "no graphs of several fresh prompts on this runner"}
    rows_out, agree, total, worst = [], 0, 0, 0.0
    with _computing(engine, seed) as e:
        for name, decode_rows, prompts in mixes:
            if decode_rows or len(prompts) < 2:
                continue
            added = [e.add(n, 2) for n in prompts]
            out = engine.scheduler.schedule()
            bucket = graphs.fresh_bucket(out.num_batched_tokens, len(out.scheduled))
            if bucket is not None:
                ids, meta, _, _ = runner.prepare(out)
                model = runner.model
                with model.graphed_attention():  # the forward the graph captured, attention choice included
                    eager = model.compute_logits(model(ids, meta, runner.kv_caches)[meta.logits_indices])
                before = graphs.fresh_replays
                logits, _ = runner._execute_graph(out, graphs)
                diff, same, gaps = argmax_agreement(logits, eager)
                rows_out.append(
                    {
                        "mix": name,
                        "bucket": list(bucket),
                        "sampling_rows": int(eager.shape[0]),
                        "max_abs_logit_diff": diff,
                        "argmax_agree": same,
                        "disagreeing_eager_gaps": gaps,  # each within 2 x the row's rounding
                        "replayed": graphs.fresh_replays - before,
                    }
                )
                agree, total, worst = agree + same, total + int(eager.shape[0]), max(worst, diff)
            for rid in added:  # undo the step: nothing advanced (it was scheduled, not run)
                engine.abort(rid)
    return {
        "pass": bool(rows_out) and worst <= atol and all(r["replayed"] == 1 for r in rows_out),
        "max_abs_diff": worst,
        "argmax_agree_pct": round(100 * agree / max(total, 1), 3),
        "atol": atol,
        "mixes": rows_out,
    }


@torch.inference_mode()
def piecewise_matches_eager(engine, mixes=MIXES_H200, seed: int = 1, atol: float = 0.1) -> dict:
    """Each mix's step through the eager forward and through the piecewise graphs of the same runner: the final
    hidden states of every row (relative error), the logits of every sampling row (max abs difference) and whether
    their greedy tokens agree. Passes when the hidden states agree within 2e-2, every logit within ``atol`` (bf16
    GEMMs of a padded bucket may round differently) and at least 99 % of the sampling rows' argmax."""
    runner = engine.runner
    pw = runner.piecewise
    if pw is None:
        return {"pass": None, "why": "no piecewise graphs on this runner"}
    rows_out, agree, total, worst = [], 0, 0, 0.0
    with _computing(engine, seed) as e:
        for name, decode_rows, prompts in mixes:
            live = _decoding(e, decode_rows)
            added = [e.add(n, 2) for n in prompts]
            out = engine.scheduler.schedule()
            ids, meta, _, _ = runner.prepare(out)
            model = runner.model
            eager_hidden = model(ids, meta, runner.kv_caches)
            eager = model.compute_logits(eager_hidden[meta.logits_indices])
            plan = runner.plan(out)
            t = plan.rows.shape[1]
            pmeta = runner.metadata(plan, pw.rows(pw.load(plan.rows)))
            hidden = pw.run(t, pmeta)[:t]
            piece = model.compute_logits(hidden[pmeta.logits_indices])
            rel = float((hidden.float() - eager_hidden.float()).norm() / eager_hidden.float().norm())
            diff = float((piece - eager).abs().max()) if eager.numel() else 0.0
            same = int((piece.argmax(-1) == eager.argmax(-1)).sum())
            rows_out.append(
                {
                    "mix": name,
                    "tokens": t,
                    "bucket": pw.bucket(t),
                    "hidden_rel_err": rel,
                    "sampling_rows": int(eager.shape[0]),
                    "max_abs_logit_diff": diff,
                    "argmax_agree": same,
                }
            )
            agree, total, worst = agree + same, total + int(eager.shape[0]), max(worst, diff)
            # undo the step: nothing advanced (it was scheduled, not run), the requests go
            for rid in [*added, *live]:
                engine.abort(rid)
    return {
        "pass": worst <= atol and agree >= 0.99 * total and all(r["hidden_rel_err"] < 2e-2 for r in rows_out),
        "max_abs_diff": worst,
        "argmax_agree_pct": round(100 * agree / max(total, 1), 3),
        "atol": atol,
        "mixes": rows_out,
    }
