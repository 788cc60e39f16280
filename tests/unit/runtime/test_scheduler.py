"""Scheduler (no torch, no model): budgets, chunking, priorities, preemption, cancellation, deadlines."""

from __future__ import annotations

from kernellab.runtime.request.block_manager import BlockManager
from kernellab.runtime.request.sampling import SamplingParams
from kernellab.runtime.request.scheduler import Scheduler
from kernellab.runtime.request.sequence import Sequence, SequenceStatus

BS = 4
EOS = 0


def make(num_blocks=32, budget=64, max_seqs=8, chunked=True, max_len=256, caching=True):
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=caching)
    return Scheduler(
        bm,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_len,
        eos_token_ids=(EOS,),
        enable_chunked_prefill=chunked,
    )


def seq(rid, n, priority=0, max_tokens=8, deadline=None, arrival=None, start=1000):
    tokens = list(range(start, start + n))
    return Sequence(rid, tokens, SamplingParams(temperature=0.0), max_tokens, priority, deadline, arrival_time=arrival)


def run_step(s: Scheduler, token=7):
    out = s.schedule()
    sampled = [token if out.samples(q, n) else None for q, n in out.scheduled]
    finished = s.postprocess(out, sampled)
    return out, finished


def plan(out):
    return [(q.request_id, n) for q, n in out.scheduled]


def test_chunked_prefill_respects_the_token_budget_and_decodes_first():
    s = make(budget=16)
    s.add(seq("a", 10, arrival=1.0, start=100))
    s.add(seq("b", 20, arrival=2.0, start=200))
    out, _ = run_step(s)
    assert plan(out) == [("a", 10), ("b", 6)]
    out, _ = run_step(s)
    # a now decodes (1 token) before b's next chunk takes the rest of the budget.
    assert plan(out) == [("a", 1), ("b", 14)]
    out, _ = run_step(s)
    assert plan(out) == [("a", 1), ("b", 1)]
    s.check_integrity()


def test_without_chunking_a_prompt_waits_for_a_step_with_room():
    s = make(budget=16, chunked=False)
    s.add(seq("a", 10, arrival=1.0, start=100))
    s.add(seq("b", 12, arrival=2.0, start=200))
    out, _ = run_step(s)
    assert plan(out) == [("a", 10)]
    out, _ = run_step(s)
    assert plan(out) == [("a", 1), ("b", 12)]


def test_long_prompt_runs_alone_when_unchunked():
    s = make(budget=8, chunked=False)
    s.add(seq("long", 30))
    out, _ = run_step(s)
    assert plan(out) == [("long", 30)]


def test_max_num_seqs_caps_running():
    s = make(max_seqs=2)
    for i in range(3):
        s.add(seq(f"r{i}", 3, arrival=float(i), start=100 * i + 100))
    out, _ = run_step(s)
    assert [r for r, _ in plan(out)] == ["r0", "r1"]
    assert [q.request_id for q in s.waiting] == ["r2"]


def test_priority_orders_admission():
    s = make(max_seqs=1)
    s.add(seq("low", 3, priority=5, arrival=1.0, start=100))
    s.add(seq("high", 3, priority=0, arrival=2.0, start=200))
    out, _ = run_step(s)
    assert plan(out) == [("high", 3)]


def test_preemption_by_recompute_when_blocks_run_out():
    # 4 blocks of 4 tokens; two sequences of 7 tokens take 2 blocks each; growing past 8 needs a third.
    s = make(num_blocks=4, caching=False)
    s.add(seq("old", 7, arrival=1.0, start=100, max_tokens=20))
    s.add(seq("new", 7, arrival=2.0, start=200, max_tokens=20))
    run_step(s)  # both prefill; each has 8 tokens now (7 + 1 sampled)
    out, _ = run_step(s)  # decode token 8: fills block 2 exactly; no new block yet
    assert plan(out) == [("old", 1), ("new", 1)]
    out, _ = run_step(s)  # token 9 needs a third block for each: "new" is preempted
    assert [q.request_id for q in out.preempted] == ["new"]
    assert plan(out) == [("old", 1)]
    victim = s.requests["new"]
    assert victim.status is SequenceStatus.WAITING and victim.block_table == []
    assert victim.num_computed_tokens == 0 and victim.num_tokens == 9
    assert s.num_preemptions == 1
    s.check_integrity()


def test_preempted_sequence_resumes_with_its_output_tokens():
    s = make(num_blocks=4, caching=False)
    s.add(seq("old", 7, arrival=1.0, start=100, max_tokens=3))
    s.add(seq("new", 7, arrival=2.0, start=200, max_tokens=20))
    run_step(s)
    run_step(s)
    out, finished = run_step(s)  # "new" is preempted; "old" reaches max_tokens and frees its blocks
    assert [q.request_id for q in out.preempted] == ["new"]
    assert [q.request_id for q in finished] == ["old"]
    out, _ = run_step(s)
    assert plan(out) == [("new", 9)]  # recompute prompt + emitted tokens in one prefill
    s.check_integrity()


def test_abort_frees_blocks_at_once():
    s = make(num_blocks=8)
    s.add(seq("a", 9))
    run_step(s)
    assert s.block_manager.num_free_blocks == 5
    assert s.abort("a") is not None
    assert s.block_manager.num_free_blocks == 8
    assert not s.has_unfinished
    assert s.abort("a") is None
    s.check_integrity()


def test_deadline_expires_waiting_and_running_requests():
    s = make()
    s.add(seq("running", 3, deadline=100.0, start=100))
    s.schedule(now=50.0)
    s.add(seq("waiting", 3, deadline=100.0, start=200))
    out = s.schedule(now=150.0)
    assert sorted(q.finish_reason for q in out.finished) == ["deadline", "deadline"]
    assert out.scheduled == [] and not s.has_unfinished
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks


def test_stop_conditions():
    s = make()
    s.add(seq("eos", 3, start=100))
    s.add(seq("len", 3, max_tokens=2, start=200))
    out = s.schedule()
    finished = s.postprocess(out, [EOS, 5])
    assert [(q.request_id, q.finish_reason) for q in finished] == [("eos", "stop")]
    out = s.schedule()
    finished = s.postprocess(out, [5])
    assert [(q.request_id, q.finish_reason) for q in finished] == [("len", "length")]
    s.check_integrity()


def test_prefix_cache_hit_skips_cached_tokens():
    s = make()
    s.add(seq("a", 13, start=100))
    run_step(s)
    s.add(seq("b", 13, start=100))  # same prompt
    out, _ = run_step(s)
    assert ("b", 1) in plan(out)  # 12 cached tokens (3 full blocks), only the last runs
    assert s.requests["b"].num_cached_tokens == 12


def test_background_prefill_yields_step_time_to_interactive_requests():
    bm = BlockManager(64, BS, enable_prefix_caching=True)
    s = Scheduler(
        bm,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=256,
        eos_token_ids=(EOS,),
        background_prefill_tokens=8,
        foreground_window_s=60.0,
    )
    # Background work alone takes the whole budget.
    s.add(seq("b1", 40, priority=1, arrival=1.0, start=100, max_tokens=50))
    out, _ = run_step(s)
    assert plan(out) == [("b1", 40)]
    # An interactive request arrives with more background prompts: its prefill step carries no background
    # prefill (b1 keeps decoding), and later steps give background prompts at most 8 tokens each.
    s.add(seq("b2", 30, priority=1, arrival=2.0, start=200, max_tokens=50))
    s.add(seq("i1", 12, priority=0, arrival=3.0, start=300, max_tokens=2))
    out, _ = run_step(s)
    assert plan(out) == [("b1", 1), ("i1", 12)]
    out, _ = run_step(s)
    assert plan(out) == [("i1", 1), ("b1", 1), ("b2", 8)]
    out, _ = run_step(s)  # i1 finished (2 tokens); it came within the window, so the cap holds
    assert plan(out) == [("b1", 1), ("b2", 8)]
    # Once interactive traffic is older than the window, background prefill has the budget again.
    s.foreground_window_s = 0.0
    out, _ = run_step(s)
    assert plan(out) == [("b1", 1), ("b2", 14)]
    s.check_integrity()


def _running(rng, caching: bool) -> tuple[Scheduler, Sequence]:
    """A scheduler holding one running sequence past its prefill and first token, its settings drawn from rng."""
    prompt = rng.randint(1, 9)
    max_len = rng.randint(prompt + 2, prompt + 16)
    params = SamplingParams(
        temperature=0.0, stop_token_ids=rng.sample(range(1, 6), rng.randint(0, 2)), ignore_eos=rng.random() < 0.3
    )
    s = make(num_blocks=16, budget=64, max_len=max_len, caching=caching)
    q = Sequence("w", list(range(100, 100 + prompt)), params, min(rng.randint(1, 12), max_len - prompt))
    s.add(q)
    out = s.schedule()
    s.postprocess(out, [9 for _ in out.scheduled])  # prefill and one sampled token (9 ends nothing)
    return s, q


def test_a_decode_window_advances_in_one_pass_exactly_as_token_by_token():
    """advance_window (the engine's path for window rows without stop strings or grammars) against advance()
    per token, the engine's loop for every other row: same tokens kept, same finish, same KV count and blocks."""
    import random

    checked = 0
    for case in range(400):
        (fast, fq), (slow, sq) = (_running(random.Random(case), case % 2 == 0) for _ in range(2))
        if fq.is_finished:
            continue
        rng = random.Random(10_000 + case)
        window = [rng.choice([EOS, 1, 2, 3, 4, 5, 6, 7, 8, 9]) for _ in range(rng.randint(2, 8))]
        for s, q in ((fast, fq), (slow, sq)):
            s.block_manager.allocate_slots(q, len(window))
        kept_slow = []
        for token in window:
            if not slow.advance(sq, 1, token):
                break
            kept_slow.append(token)
            if sq.is_finished:
                break
        assert fast.advance_window(fq, window) == kept_slow, (case, window)
        assert (fq.token_ids, fq.num_computed_tokens) == (sq.token_ids, sq.num_computed_tokens)
        assert (fq.status, fq.finish_reason, fq.stop_reason) == (sq.status, sq.finish_reason, sq.stop_reason)
        assert fq.block_hashes == sq.block_hashes
        assert fast.block_manager.cached == slow.block_manager.cached
        fast.check_integrity()
        slow.check_integrity()
        checked += 1
    assert checked > 300


def test_a_window_for_a_sequence_that_ended_meanwhile_keeps_nothing():
    s = make()
    q = seq("a", 3, max_tokens=8)
    s.add(q)
    run_step(s)
    s.abort("a")
    assert s.advance_window(q, [5, 6, 7]) == []
    assert q.num_output_tokens == 1
