"""Decode windows (multi-step decode) on the CPU: the scheduler reserves look-ahead KV slots, the runner says how
wide a window may be, and ``LLMEngine.step`` takes each row's tokens one by one. A scripted runner (each
request's k-th output token fixed in advance) stands in for the GPU's graph loop, so an engine run with windows
of 4 must emit exactly what the same engine emits one step at a time: lengths cut inside a window, EOS and stop
strings ending a row mid-window, the model length, blocks all returned."""

from __future__ import annotations

import pytest

from kernellab.runtime.config import EngineConfig
from kernellab.runtime.engine import LLMEngine
from kernellab.runtime.request.sampling import SamplingParams


class ScriptedRunner:
    """decode_window / execute as the model runner has them; request r's k-th output token is script[r][k]."""

    def __init__(self, engine: LLMEngine, script: dict[str, list[int]], width: int):
        self.script, self.width, self.bs = script, width, engine.config.block_size
        self.windows = 0

    def decode_window(self, out) -> int:
        for seq, n in out.scheduled:
            p = seq.params
            if n != 1 or not out.samples(seq, n) or not p.greedy or p.has_logits_processors or p.logprobs is not None:
                return 1
        return self.width

    def execute(self, out):
        rows = []
        for i, (seq, n) in enumerate(out.scheduled):
            if out.window > 1:
                # The window writes K/V for positions num_computed .. num_computed + allowed - 1: reserved?
                assert len(seq.block_table) * self.bs >= seq.num_computed_tokens + out.allowed[i]
                rows.append([self.script[seq.request_id][seq.num_output_tokens + k] for k in range(out.allowed[i])])
            else:
                rows.append([self.script[seq.request_id][seq.num_output_tokens]] if out.samples(seq, n) else [])
        self.windows += out.window > 1
        return rows, {}


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(
        EngineConfig(
            model="smollm2-135m",
            device="cpu",
            dtype="float32",
            max_model_len=96,
            num_kv_blocks=64,
            max_num_seqs=8,
            max_num_batched_tokens=256,
        )
    )


def run(engine: LLMEngine, requests, script, width: int):
    engine.runner = ScriptedRunner(engine, script, width)
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    got: dict[str, list] = {rid: [[], None, None] for rid, _, _ in requests}
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        for o in engine.step():
            got[o.request_id][0] += o.new_token_ids
            if o.finished:
                got[o.request_id][1:] = [o.finish_reason, o.stop_reason]
    engine.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return got, steps, engine.runner.windows


def test_windows_emit_exactly_what_single_steps_emit(engine):
    tok = engine.tokenizer
    words = tok.encode(
        " one two three four five six seven eight nine ten eleven twelve thirteen fourteen", add_special_tokens=False
    )
    eos = sorted(engine.eos_token_ids)[0]
    filler = words * 8
    script = {
        "length5": filler,  # max_tokens 5: cut after one token of the second window
        "eos6": [*words[:6], eos, *filler],  # EOS mid-window: what the window made past it is dropped
        "stop": filler,  # a stop string completed mid-window
        "long": filler,  # 13 tokens: windows of 4, 4, 4, 1
        "cap": filler,  # runs into max_model_len (96) mid-window
        "stopid": filler,  # a stop token id mid-window (the window's one-pass scan, not the per-token loop)
    }
    prompt = tok.encode("Count with me:", add_special_tokens=False)
    greedy = dict(temperature=0.0)
    requests = [
        ("length5", prompt, SamplingParams(max_tokens=5, **greedy)),
        ("eos6", prompt, SamplingParams(max_tokens=30, **greedy)),
        ("stop", prompt, SamplingParams(max_tokens=30, stop=[" seven"], **greedy)),
        ("long", prompt, SamplingParams(max_tokens=13, **greedy)),
        ("cap", [prompt[0]] * 86, SamplingParams(max_tokens=None, **greedy)),  # 10 left
        ("stopid", prompt, SamplingParams(max_tokens=30, stop_token_ids=[words[5]], **greedy)),
    ]
    single, steps1, windows1 = run(engine, requests, script, 1)
    windowed, steps4, windows4 = run(engine, requests, script, 4)
    assert windows1 == 0 and windows4 > 0 and steps4 < steps1
    assert windowed == single
    assert single["length5"] == [filler[:5], "length", None]
    assert single["eos6"] == [[*words[:6], eos], "stop", eos]
    assert single["stop"][1:] == ["stop", " seven"]
    assert single["long"][0] == filler[:13] and single["cap"] == [filler[:10], "length", None]
    assert single["stopid"] == [filler[:6], "stop", words[5]]


def test_no_window_when_a_row_needs_the_full_sampler(engine):
    tok = engine.tokenizer
    words = tok.encode(" a b c d e f g h", add_special_tokens=False) * 4
    prompt = tok.encode("Letters:", add_special_tokens=False)
    requests = [
        ("plain", prompt, SamplingParams(temperature=0.0, max_tokens=8)),
        ("logprobs", prompt, SamplingParams(temperature=0.0, max_tokens=8, logprobs=1)),
    ]
    got, _steps, windows = run(engine, requests, {"plain": words, "logprobs": words}, 4)
    assert windows == 0  # the logprobs row keeps the whole batch on single steps
    assert got["plain"][0] == got["logprobs"][0] == words[:8]
