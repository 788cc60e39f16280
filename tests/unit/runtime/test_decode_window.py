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
        self.carried = 0  # windows launched before the one before them was read (asynchronous scheduling)
        self.last: list = []

    def decode_window(self, out) -> int:
        for seq, n in out.scheduled:
            p = seq.params
            if n != 1 or not out.samples(seq, n) or not p.greedy or p.has_logits_processors or p.logprobs is not None:
                return 1
        return self.width

    def execute(self, out, before_wait=None):
        if out.window > 1:
            return self.window_tokens(self.launch_window(out)), {}
        if before_wait is not None:  # the engine's block registration while the device would compute
            before_wait()
        rows = [[self.script[s.request_id][s.num_output_tokens]] if out.samples(s, n) else [] for s, n in out.scheduled]
        return rows, {}

    def launch_window(self, out, carry=None):
        """The window's tokens as the device would compute them at launch: row i starts ``out.ahead`` tokens past
        what its sequence holds (the window before it not read yet), and continues that window's row carry[i]."""
        assert out.window > 1 and (carry is None) == (out.ahead == 0)
        rows = []
        for i, (seq, _) in enumerate(out.scheduled):
            if carry is not None:
                assert self.last[carry[i]] is seq  # the row it continues is the same sequence's
            start = seq.num_computed_tokens + out.ahead
            # The window writes K/V for positions start .. start + allowed - 1: reserved?
            assert len(seq.block_table) * self.bs >= start + out.allowed[i]
            script = self.script[seq.request_id]
            rows.append([script[seq.num_output_tokens + out.ahead + k] for k in range(out.allowed[i])])
        self.last = [s for s, _ in out.scheduled]
        self.windows += 1
        self.carried += carry is not None
        return rows

    def window_tokens(self, rows):
        return rows


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


def run(engine: LLMEngine, requests, script, width: int, async_scheduling: bool = False, at=None):
    """Run ``requests`` to the end; ``at``: {step number: callable(engine)} called before that step (arrivals,
    aborts). Returns {request: [tokens, finish_reason, stop_reason]}, steps taken, windows launched."""
    engine.runner = ScriptedRunner(engine, script, width)
    engine.async_scheduling = async_scheduling
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    got: dict[str, list] = {rid: [[], None, None] for rid, _, _ in requests}
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        if at and steps in at:
            for rid, *_ in at[steps](engine) or []:
                got[rid] = [[], None, None]
        for o in engine.step():
            got[o.request_id][0] += o.new_token_ids
            if o.finished:
                got[o.request_id][1:] = [o.finish_reason, o.stop_reason]
    engine.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine._window is None
    if not async_scheduling:
        assert engine.runner.carried == 0
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
    # asynchronous scheduling: each window launched before the last is read, rows that end by length left out
    # of the next, what a window made past EOS or a stop string discarded
    launched, _, _ = run(engine, requests, script, 4, async_scheduling=True)
    assert launched == single and engine.runner.carried > 0
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


def _words(engine, n=48):
    tok = engine.tokenizer
    return (tok.encode(" alpha beta gamma delta epsilon zeta eta theta", add_special_tokens=False) * 8)[:n]


def test_asynchronous_windows_stop_for_an_arrival_and_resume(engine):
    """A request that arrives while a window is in flight: the step that reads that window launches no next one,
    so the following step schedules the arrival's prefill with the running rows; then windows run ahead again."""
    words = _words(engine)
    prompt = engine.tokenizer.encode("Greek letters:", add_special_tokens=False)
    greedy = dict(temperature=0.0)
    seen = {}

    def arrive(e):
        seen["in_flight_before"] = e._window is not None
        e.add_request("late", prompt, SamplingParams(max_tokens=9, **greedy))
        return [("late",)]

    def after(e):
        seen["in_flight_after"] = e._window is not None  # the arrival's step launched nothing ahead

    requests = [("early", prompt, SamplingParams(max_tokens=30, **greedy))]
    script = {"early": words, "late": words[3:]}
    got, _, _ = run(engine, requests, script, 4, async_scheduling=True, at={3: arrive, 4: after})
    assert seen == {"in_flight_before": True, "in_flight_after": False}
    assert got["early"] == [words[:30], "length", None]
    assert got["late"] == [words[3:12], "length", None]
    assert engine.runner.carried >= 3  # before the arrival and again after it


def test_an_abort_while_a_window_is_in_flight_drops_the_row_and_keeps_the_others(engine):
    """Aborted between steps with a window in flight: the aborted row's blocks are freed at once, what the windows
    in flight computed for it is dropped, and the next window carries the other rows on (its first row left out:
    the runner gathers the others' last tokens into place)."""
    words = _words(engine)
    prompt = engine.tokenizer.encode("Greek letters:", add_special_tokens=False)
    greedy = dict(temperature=0.0)
    got_before = {}

    def abort(e):
        assert e._window is not None
        got_before["free"] = e.block_manager.num_free_blocks
        assert e.abort("first")
        assert e.block_manager.num_free_blocks > got_before["free"]

    requests = [
        ("first", prompt, SamplingParams(max_tokens=40, **greedy)),
        ("second", prompt, SamplingParams(max_tokens=40, **greedy)),
    ]
    script = {"first": words, "second": words[1:]}
    got, _, _ = run(engine, requests, script, 4, async_scheduling=True, at={3: abort})
    assert got["second"] == [words[1:41], "length", None]
    first, reason, _ = got["first"]
    assert reason is None and first == words[: len(first)] and 0 < len(first) < 40


def test_a_row_ending_at_a_window_boundary_is_left_out_of_the_next(engine):
    """Rows of different lengths: each window launched ahead holds only rows with tokens left after the window
    in flight, row lengths ending exactly at a boundary included, and every row still emits exactly its own."""
    words = _words(engine)
    prompt = engine.tokenizer.encode("Greek letters:", add_special_tokens=False)
    greedy = dict(temperature=0.0)
    # prefill emits 1 token, then windows of 4: max_tokens 5 ends at the first window's end, 9 at the second's
    lengths = {"a": 5, "b": 9, "c": 11, "d": 17}
    requests = [(r, prompt, SamplingParams(max_tokens=m, **greedy)) for r, m in lengths.items()]
    script = {r: words[i:] for i, r in enumerate(lengths)}
    single, _, _ = run(engine, requests, script, 1)
    launched, _, _ = run(engine, requests, script, 4, async_scheduling=True)
    assert launched == single
    assert all(launched[r] == [words[i : i + m], "length", None] for i, (r, m) in enumerate(lengths.items()))


def test_a_deadline_stops_the_windows_ahead(engine):
    """A row whose deadline has passed: no window is launched ahead for it, so the next scheduled step ends it
    ("deadline") as it would without asynchronous scheduling."""
    words = _words(engine)
    prompt = engine.tokenizer.encode("Greek letters:", add_special_tokens=False)

    def expire(e):
        seq = e.scheduler.requests["timed"]
        seq.deadline = 0.0  # long past

    requests = [("timed", prompt, SamplingParams(temperature=0.0, max_tokens=40))]
    got, _, _ = run(engine, requests, {"timed": words}, 4, async_scheduling=True, at={3: expire})
    tokens, reason, _ = got["timed"]
    assert reason == "deadline" and tokens == words[: len(tokens)] and len(tokens) < 40


def test_a_request_waiting_for_a_seat_does_not_stop_the_look_ahead(engine):
    """Every seat taken (max_num_seqs 2) and a third request waiting: it could not join before a row ends, so
    windows go on being launched ahead while it waits; the window in which a row ends by its length launches
    none, and the waiting request joins at the next step."""
    words = _words(engine)
    prompt = engine.tokenizer.encode("Greek letters:", add_special_tokens=False)
    greedy = dict(temperature=0.0)
    seen: list[tuple[int, bool]] = []

    def watch(e):
        seen.append((len(e.scheduler.waiting), e._window is not None))

    requests = [
        ("a", prompt, SamplingParams(max_tokens=30, **greedy)),
        ("b", prompt, SamplingParams(max_tokens=13, **greedy)),  # 1 + 3 windows of 4: ends at a boundary
        ("c", prompt, SamplingParams(max_tokens=9, **greedy)),
    ]
    script = {"a": words, "b": words[1:], "c": words[2:]}
    seats = engine.scheduler.max_num_seqs
    engine.scheduler.max_num_seqs = 2
    try:
        got, _, _ = run(engine, requests, script, 4, async_scheduling=True, at={k: watch for k in range(2, 12)})
    finally:
        engine.scheduler.max_num_seqs = seats
    assert got == {
        "a": [words[:30], "length", None],
        "b": [words[1:14], "length", None],
        "c": [words[2:11], "length", None],
    }
    assert (1, True) in seen  # c waited while a window was in flight, launched ahead
