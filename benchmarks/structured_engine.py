"""What constrained decoding costs the engine: the same batch decoded plain and under grammars, on one device.

    python benchmarks/structured_engine.py --profile h200 --output results/gpu/structured_h200.json   # the GPU
    python benchmarks/structured_engine.py --profile ci --output /tmp/structured_ci.json              # CPU rehearsal

The model is a random-weight checkpoint of the profile's shape with the synthetic tokenizer of its full
vocabulary (``kernellab.bench.synthetic``): llguidance walks every token of it, as it would Qwen3's. The batch:
``num_seqs`` prompts of ``prompt_tokens`` random ids, greedy, ``ignore_eos``, ``output_tokens`` each. Variants:

- ``plain``: no constraint (multi-step decode windows where the runner has CUDA graphs);
- ``plain-1step``: no constraint, one decode step per engine step: what a constrained batch gives up first;
- ``json``: every row under a JSON schema (an object with one long string, which cannot close in the budget);
- ``regex``: every row under ``[a-z ]+`` (words and spaces);
- ``half-json``: half the rows under the JSON schema, half plain, in the same steps.

No grammar can end a row early, so every variant decodes the same number of tokens; output tokens per second is
the figure, with each variant's token count beside it, and every constrained row's tokens are replayed through
a fresh matcher of its grammar (``checked`` / ``valid``). Every variant runs once to
warm up and then ``--repeats`` times, interleaved; the figures are medians.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

SCHEMA = "kernellab.bench.structured_engine/v1"
PROFILES = {
    "h200": {
        "shape": "qwen3-0.6b",
        "device": "cuda",
        "dtype": "bfloat16",
        "num_seqs": 256,
        "prompt_tokens": 128,
        "output_tokens": 256,
        "max_num_seqs": 256,
        "max_num_batched_tokens": 16384,
        "num_kv_blocks": 8192,
    },
    "ci": {
        "shape": "tiny-qwen3",
        "device": "cpu",
        "dtype": "float32",
        "num_seqs": 8,
        "prompt_tokens": 16,
        "output_tokens": 12,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 512,
        "num_kv_blocks": 64,
    },
}
# A JSON object whose one string cannot close within the output budget: every row decodes all its tokens under
# the JSON grammar (string lexemes, escapes), so each variant produces the same tokens and the figures compare
# per-token cost, not batches that shrink as rows finish.
JSON_SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 100000}},
    "required": ["text"],
    "additionalProperties": False,
}
VARIANTS = ("plain", "plain-1step", "json", "regex", "half-json")


def structured_for(variant: str, row: int) -> dict | None:
    if variant == "json" or (variant == "half-json" and row % 2 == 0):
        return {"json_schema": JSON_SCHEMA}
    if variant == "regex":
        return {"regex": "[a-z ]+"}
    return None


def run_variant(engine, variant: str, prompts: list[list[int]], output_tokens: int, tag: str, window: int) -> dict:
    from kernellab.runtime.request.sampling import SamplingParams

    # The runner owns the decode window's width (ModelRunner.max_window, set at start-up from the config; the
    # engine's config is not read again): plain-1step narrows it to one step per engine step, every other
    # variant runs at the start-up width ``window``.
    engine.runner.max_window = 1 if variant == "plain-1step" else window
    for i, p in enumerate(prompts):
        params = SamplingParams(
            temperature=0.0, max_tokens=output_tokens, ignore_eos=True, structured=structured_for(variant, i)
        )
        engine.add_request(f"{tag}-{i}", p, params)
    sync = _sync(engine)
    timers = _instrument(engine)
    sync()
    t0 = time.perf_counter()
    tokens, steps, reasons = 0, 0, {}
    first_decode = None
    produced: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += len(out.new_token_ids)
            produced.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                reasons[out.finish_reason] = reasons.get(out.finish_reason, 0) + 1
        steps += 1
        if first_decode is None and tokens >= len(prompts):  # every row has its first token: prefill is over
            sync()
            first_decode = (time.perf_counter(), tokens)
    sync()
    wall = time.perf_counter() - t0
    _restore(engine)
    out = {
        "variant": variant,
        "output_tokens": tokens,
        "wall_s": round(wall, 4),
        "engine_steps": steps,
        "output_tok_s": round(tokens / wall, 1),
        "finish_reasons": reasons,
        # host time per engine step in the constrained parts: mask fill (overlaps the forward on a GPU) and
        # feeding the sampled tokens to the matchers (after the step's tokens came back)
        "host_ms_per_step": {k: round(v * 1e3 / max(steps, 1), 3) for k, v in timers.items()},
        **_check(engine, variant, produced),
    }
    if first_decode is not None and tokens > first_decode[1]:
        decode_s = wall - (first_decode[0] - t0)
        out["decode_tok_s"] = round((tokens - first_decode[1]) / decode_s, 1)
    return out


def _instrument(engine) -> dict:
    """Time the sampler's host half (constraints: logit_bias lists and grammar masks) and the grammar advance."""
    timers = {"mask_fill": 0.0, "grammar_advance": 0.0}
    sampler = engine.runner.sampler

    def timed(name, fn):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                timers[name] += time.perf_counter() - t

        return wrapper

    sampler.constraints = timed("mask_fill", type(sampler).constraints.__get__(sampler))
    engine._advance_grammars = timed("grammar_advance", type(engine)._advance_grammars.__get__(engine))
    return timers


def _restore(engine) -> None:
    del engine.runner.sampler.constraints
    del engine._advance_grammars


def _check(engine, variant: str, produced: dict[str, list[int]]) -> dict:
    """Every constrained row's tokens replay through a fresh matcher of its grammar (a prefix of its language), and
    a JSON row the grammar ended parses as an array."""
    import json

    from kernellab.runtime.request import structured
    from kernellab.runtime.request.errors import InvalidRequestError

    lltok = structured.ll_tokenizer(engine.tokenizer, engine.model_config.vocab_size, engine.eos_token_ids)
    checked = valid = 0
    for rid, ids in produced.items():
        spec = structured_for(variant, int(rid.rsplit("-", 1)[1]))
        if spec is None:
            continue
        checked += 1
        body = [t for t in ids if t not in engine.eos_token_ids]
        try:
            state = structured.GrammarState(lltok, spec, body)
        except InvalidRequestError:
            continue
        if "json_schema" in spec and state.is_stopped:
            try:
                json.loads(engine.tokenizer.decode(body))
            except ValueError:
                continue
        valid += 1
    return {"checked": checked, "valid": valid}


def _sync(engine):
    import torch

    if engine.runner.device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", choices=sorted(PROFILES), default="ci")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--model-dir", default=None, help="a checkpoint written earlier (else one is written)")
    ap.add_argument("--output", default="results/gpu/structured_h200.json")
    args = ap.parse_args(argv)
    profile = PROFILES[args.profile]

    from kernellab.bench.synthetic import write_checkpoint
    from kernellab.results import provenance, write
    from kernellab.runtime.config import EngineConfig
    from kernellab.runtime.engine import LLMEngine

    model_dir = Path(args.model_dir) if args.model_dir else Path(tempfile.mkdtemp(prefix="kl-structured-")) / "m"
    if not (model_dir / "config.json").exists():
        write_checkpoint(model_dir, profile["shape"], device=profile["device"])
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            device=profile["device"],
            dtype=profile["dtype"],
            max_num_seqs=profile["max_num_seqs"],
            num_kv_blocks=profile["num_kv_blocks"],
            max_num_batched_tokens=profile["max_num_batched_tokens"],
            max_model_len=2048,
        )
    )
    rng = random.Random(0)
    n, plen, olen = profile["num_seqs"], profile["prompt_tokens"], profile["output_tokens"]
    runs = []
    window = engine.runner.max_window
    for rep in range(args.repeats + 1):  # repeat 0 warms every variant up (graphs, grammar caches)
        for k, variant in enumerate(VARIANTS if rep % 2 == 0 else reversed(VARIANTS)):
            prompts = [[rng.randint(0, 10000) for _ in range(plen)] for _ in range(n)]  # fresh: no prefix hits
            r = run_variant(engine, variant, prompts, olen, f"r{rep}-{k}", window)
            r["repeat"] = rep
            runs.append(r)
            print(
                f"repeat {rep} {variant:<12} {r['output_tok_s']:>9.1f} tok/s  {r['output_tokens']:>6} tokens  "
                f"{r['engine_steps']:>5} steps  {r['finish_reasons']}",
                flush=True,
            )
    summary = {}
    for variant in VARIANTS:
        measured = [r for r in runs if r["variant"] == variant and r["repeat"] > 0]
        summary[variant] = {
            "output_tok_s": round(statistics.median(r["output_tok_s"] for r in measured), 1),
            "output_tokens": round(statistics.median(r["output_tokens"] for r in measured)),
        }
    base = summary["plain"]["output_tok_s"]
    for variant in VARIANTS:
        summary[variant]["vs_plain"] = round(summary[variant]["output_tok_s"] / base, 4)
    result = {
        "schema": SCHEMA,
        "provenance": provenance(profile["device"]),
        "profile": args.profile,
        "model": {
            "shape": profile["shape"],
            "weights": "random (kernellab.bench.synthetic, seed 0)",
            "tokenizer": "synthetic byte-level BPE of the model's vocabulary",
        },
        "workload": {
            "num_seqs": n,
            "prompt_tokens": plen,
            "output_tokens": olen,
            "greedy": True,
            "ignore_eos": True,
            "json_schema": JSON_SCHEMA,
            "regex": "[a-z ]+",
        },
        "grammar_engine": {"name": "llguidance", "version": _version("llguidance")},
        "runs": runs,
        "summary": summary,
    }
    write(args.output, result)
    print(f"{'variant':<14}{'tok/s':>10}{'tokens':>9}{'vs plain':>10}")
    for variant, s in summary.items():
        print(f"{variant:<14}{s['output_tok_s']:>10.1f}{s['output_tokens']:>9}{s['vs_plain']:>10.3f}")
    print(f"wrote {args.output}")
    return 0


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
