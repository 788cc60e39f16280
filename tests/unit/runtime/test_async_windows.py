"""Decode windows and asynchronous scheduling through the model runner's own window path (``GraphRunner``'s
static buffers, alternating host buffers, a window continuing from the last one's tokens on the device, rows
gathered into place when others leave), run on the CPU with the decode buckets' forwards eager
(``ModelRunner.eager_windows``). With real weights (the embedded SmolLM2), greedy: windows launched ahead must
emit exactly the tokens of plain single steps, through rows ending at different lengths, an arrival, an abort
and EOS."""

from __future__ import annotations

import pytest

from kernellab.runtime.config import EngineConfig
from kernellab.runtime.engine import LLMEngine
from kernellab.runtime.request.sampling import SamplingParams

PROMPTS = [
    ("Count with me: one, two, three,", 21),
    ("The capital of France is", 9),
    ("Write a list of colors:", 30),
    ("Q: What is 2 + 2?\nA:", 14),
    ("Once upon a time", 25),
]


@pytest.fixture(scope="module")
def engine():
    engine = LLMEngine(
        EngineConfig(
            model="smollm2-135m",
            device="cpu",
            dtype="float32",
            max_model_len=256,
            num_kv_blocks=160,
            max_num_seqs=8,
            max_num_batched_tokens=512,
        )
    )
    engine.runner.eager_windows(4)
    return engine


def run(engine: LLMEngine, windows: bool, async_scheduling: bool, abort_at: int | None = None):
    runner = engine.runner
    runner.max_window = 4 if windows else 1
    engine.async_scheduling = async_scheduling
    carried = runner.graphs.carried_windows
    tok = engine.tokenizer
    got: dict[str, list] = {}
    for i, (text, n) in enumerate(PROMPTS[:4]):
        engine.add_request(f"r{i}", tok.encode(text), SamplingParams(temperature=0.0, max_tokens=n))
        got[f"r{i}"] = [[], None]
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        if steps == 4:  # an arrival while the others decode (with a window in flight when launched ahead)
            text, n = PROMPTS[4]
            engine.add_request("late", tok.encode(text), SamplingParams(temperature=0.0, max_tokens=n))
            got["late"] = [[], None]
        if steps == abort_at:
            engine.abort("r2")
        for o in engine.step():
            got[o.request_id][0] += o.new_token_ids
            if o.finished:
                got[o.request_id][1] = o.finish_reason
    engine.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return got, runner.graphs.carried_windows - carried


def test_windows_launched_ahead_emit_exactly_what_single_steps_emit(engine):
    single, _ = run(engine, windows=False, async_scheduling=False)
    windowed, carried_sync = run(engine, windows=True, async_scheduling=False)
    launched, carried = run(engine, windows=True, async_scheduling=True)
    assert carried_sync == 0 and carried > 0
    assert windowed == single
    assert launched == single
    assert {r: len(t) for r, (t, _) in single.items()} == {"r0": 21, "r1": 9, "r2": 30, "r3": 14, "late": 25}


def test_an_abort_mid_run_leaves_the_other_rows_exact(engine):
    single, _ = run(engine, windows=False, async_scheduling=False, abort_at=6)
    launched, carried = run(engine, windows=True, async_scheduling=True, abort_at=6)
    assert carried > 0
    assert single["r2"][1] is None and launched["r2"][1] is None  # aborted: never reported finished
    # each emitted its own prefix of r2's answer until the abort (windows emit more tokens per step)
    (short, _), (long, _) = sorted((launched["r2"], single["r2"]), key=lambda r: len(r[0]))
    assert short and short == long[: len(short)]
    for rid in ("r0", "r1", "r3", "late"):
        assert launched[rid] == single[rid], rid


def test_eos_inside_a_window_launched_ahead_is_dropped_after_it(engine):
    """A row whose EOS comes mid-window: the window launched ahead of it computed on past EOS; none of that is
    emitted and the row ends "stop" where single steps end it."""
    tok = engine.tokenizer
    prompt = tok.encode("Q: What is 2 + 2?\nA:")
    engine.runner.max_window = 1
    engine.async_scheduling = False
    engine.add_request("probe", prompt, SamplingParams(temperature=0.0, max_tokens=12))
    probe = []
    while engine.has_unfinished_requests():
        probe += [t for o in engine.step() for t in o.new_token_ids]
    stop = probe[6]  # a token the greedy answer emits mid-stream: treat it as a stop token
    params = SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop])
    outs = {}
    for windows, async_scheduling in ((False, False), (True, True)):
        engine.runner.max_window = 4 if windows else 1
        engine.async_scheduling = async_scheduling
        engine.add_request("eos", prompt, params)
        engine.add_request("long", tok.encode("Once upon a time"), SamplingParams(temperature=0.0, max_tokens=30))
        got: dict[str, list] = {"eos": [], "long": []}
        while engine.has_unfinished_requests():
            for o in engine.step():
                got[o.request_id] += o.new_token_ids
                if o.finished and o.request_id == "eos":
                    assert o.finish_reason == "stop" and o.stop_reason == stop
        outs[windows] = got
        engine.check_integrity()
    assert outs[True] == outs[False]
    assert outs[True]["eos"][-1] == stop and len(outs[True]["eos"]) == probe.index(stop) + 1


def test_the_h200_ab_script_runs_its_path_on_the_cpu(tmp_path):
    """``benchmarks/gpu/async_scheduling_ab.py --device cpu``: the GPU A/B's whole path on a tiny Qwen3 with eager
    decode buckets (so it does not rot between GPU sessions); its artifact validates and its token checks hold."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from kernellab.results import validate

    root = Path(__file__).resolve().parents[3]
    script = root / "benchmarks" / "gpu" / "async_scheduling_ab.py"
    cmd = [sys.executable, str(script), "--out", str(tmp_path), "--device", "cpu", "--rounds", "1"]
    subprocess.run(cmd, check=True, cwd=tmp_path, capture_output=True, timeout=600)
    data = json.loads((tmp_path / "async_scheduling_ab.json").read_text())
    assert validate(data) == "kernellab.bench.async_scheduling_ab/v1"
    assert data["same_tokens"] and data["graph_equals_eager"]["pass"]
    assert {r["variant"] for r in data["runs"]} == {"sync", "async", "async-w8", "async-w4"}
