"""The kernel-lab rule's statistics (kernellab.bench.ablation): paired effects, their intervals, the decision,
and the interleaving of the two configurations."""

from __future__ import annotations

import math
import random

import pytest

from kernellab.bench.ablation import (
    Effect,
    aa_thresholds,
    decide,
    interleaved,
    paired_effect,
    settled,
    standing_run,
    threshold_of,
    verdict,
)


def test_paired_effect_mean_and_student_interval():
    e = paired_effect([1.10, 1.12, 1.08, 1.10])
    logs = [math.log(r) for r in (1.10, 1.12, 1.08, 1.10)]
    mean = sum(logs) / 4
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / 3)
    half = 3.182 * sd / 2  # t(0.975, 3 df) · sd / sqrt(4)
    assert e.rounds == 4
    assert e.mean_pct == pytest.approx(100 * math.expm1(mean), abs=0.01)
    assert e.lo_pct == pytest.approx(100 * math.expm1(mean - half), abs=0.01)
    assert e.hi_pct == pytest.approx(100 * math.expm1(mean + half), abs=0.01)
    assert e.lo_pct < e.mean_pct < e.hi_pct


def test_one_round_has_no_interval():
    e = paired_effect([1.05])
    assert e.mean_pct == pytest.approx(5.0)
    assert e.lo_pct == -math.inf and e.hi_pct == math.inf
    with pytest.raises(ValueError):
        paired_effect([])


def test_decision_needs_a_confident_gain_and_no_confident_loss():
    gain = Effect(5.0, 3.0, 7.0, 4)
    flat = Effect(0.2, -1.5, 1.9, 8)
    loss = Effect(-4.0, -6.0, -2.0, 4)
    assert decide({"tok_per_s": gain, "itl_ms": flat}, True, 1.0) == "accepted"
    assert decide({"tok_per_s": flat, "itl_ms": flat}, True, 1.0) == "experimental"
    assert decide({"tok_per_s": gain, "itl_ms": loss}, True, 1.0) == "experimental"
    assert decide({"tok_per_s": gain, "itl_ms": gain}, False, 1.0) == "rejected"
    assert settled({"a": gain, "b": loss}, 1.0) and not settled({"a": flat}, 1.0)


def test_an_unsettled_run_keeps_the_standing_decision_and_two_settled_ones_overturn_it():
    near = Effect(3.05, 2.06, 4.05, 8)  # straddles a 2.31 % threshold: this run alone would say experimental
    flat = Effect(-0.6, -2.0, 1.2, 8)
    assert decide({"tok_per_s": flat, "itl_ms": near}, True, 2.31) == "experimental"
    assert decide({"tok_per_s": flat, "itl_ms": near}, True, 2.31, previous="accepted") == "accepted"
    assert decide({"tok_per_s": flat, "itl_ms": near}, True, 2.31, previous="experimental") == "experimental"
    # settled evidence decides whatever stood before: a clear gain promotes, a clear absence of one demotes
    clear_gain = Effect(5.0, 3.0, 7.0, 4)
    tight_flat = Effect(0.1, -0.5, 0.7, 8)
    # settled evidence against the standing decision changes it when the run before said the same
    assert (
        decide({"tok_per_s": tight_flat, "itl_ms": clear_gain}, True, 2.31, "experimental", previous_run="accepted")
        == "accepted"
    )
    assert (
        decide({"tok_per_s": tight_flat, "itl_ms": tight_flat}, True, 2.31, "accepted", previous_run="experimental")
        == "experimental"
    )
    # failed numerics reject, standing decision or not; a rejected op is not kept rejected by noise alone
    assert decide({"tok_per_s": flat, "itl_ms": near}, False, 2.31, previous="accepted") == "rejected"
    assert decide({"tok_per_s": flat, "itl_ms": near}, True, 2.31, previous="rejected") == "experimental"


def _machine(seed: int, speedup: float, spread: float):
    """Two configurations on a noisy machine with a slow drift: the kernel multiplies speed by ``speedup``."""
    rng = random.Random(seed)
    clock = {"t": 0}

    def run(factor: float) -> dict:
        clock["t"] += 1
        drift = 1 - 0.002 * clock["t"]  # the machine slows a little with every measurement
        noise = math.exp(rng.gauss(0, spread))
        return {"tok_per_s": 1000 * factor * drift * noise, "itl_ms": 1.0 / (factor * drift * noise)}

    return (lambda: run(speedup)), (lambda: run(1.0)), clock


def test_interleaving_stops_once_settled_and_alternates_the_order():
    with_k, without_k, clock = _machine(0, speedup=1.5, spread=0.01)
    effects, record = interleaved(with_k, without_k, min_effect_pct=1.0, min_rounds=3, max_rounds=8)
    assert record["settled"] and len(record["rounds"]) == 3 and clock["t"] == 6
    assert effects["tok_per_s"].lo_pct > 40 and effects["itl_ms"].lo_pct > 40
    assert decide(effects, True, 1.0) == "accepted"


def test_no_effect_runs_every_round_and_stays_experimental_on_repeat():
    decisions = []
    for seed in (1, 2):  # two consecutive "runs" of the same kernel: the same decision
        with_k, without_k, _ = _machine(seed, speedup=1.0, spread=0.02)
        effects, record = interleaved(with_k, without_k, min_effect_pct=1.0, min_rounds=3, max_rounds=8)
        assert len(record["rounds"]) == 8 and not record["settled"]
        assert effects["tok_per_s"].lo_pct < 1.0 < effects["tok_per_s"].hi_pct or effects["tok_per_s"].hi_pct < 1.0
        decisions.append(decide(effects, True, 1.0))
    assert decisions == ["experimental", "experimental"]


def test_one_settled_contrary_run_contests_a_decision_and_the_next_confirms_or_not():
    # rms_norm's two gates: ITL +1.28 % [1.04, 1.52] (settled: accepted), then +0.4 % [0.2, 0.5] (settled below 1 %)
    first = {"tok_per_s": Effect(0.63, 0.52, 0.74, 4), "itl_ms": Effect(1.28, 1.04, 1.52, 4)}
    second = {"tok_per_s": Effect(0.6, 0.4, 0.7, 3), "itl_ms": Effect(0.4, 0.2, 0.5, 3)}
    assert verdict(first, True, 1.0) == "accepted" and verdict(second, True, 1.0) == "experimental"
    # the second run alone does not overturn the first's decision: contested, kept
    assert decide(second, True, 1.0, previous="accepted", previous_run="accepted") == "accepted"
    # a third run that agrees with the second changes it; one that agrees with the first keeps it
    assert decide(second, True, 1.0, previous="accepted", previous_run="experimental") == "experimental"
    assert decide(first, True, 1.0, previous="accepted", previous_run="experimental") == "accepted"
    # an unsettled run has no verdict to pass on, and a settled contrary run after it only contests
    near = {"tok_per_s": Effect(1.0, 0.5, 1.5, 8), "itl_ms": Effect(0.0, -0.3, 0.3, 8)}
    assert verdict(near, True, 1.0) is None
    assert decide(second, True, 1.0, previous="accepted", previous_run=None) == "accepted"
    # failed numerics reject at once and are a verdict of their own
    assert verdict(near, False, 1.0) == "rejected"
    assert decide(first, False, 1.0, previous="accepted", previous_run="accepted") == "rejected"


def test_standing_run_reads_the_recorded_verdict_or_infers_it_from_older_entries():
    assert (
        standing_run({"status": "accepted", "e2e": {"run_status": "experimental", "settled": True}}) == "experimental"
    )
    assert standing_run({"status": "accepted", "e2e": {"run_status": None, "settled": False}}) is None
    assert standing_run({"status": "accepted", "e2e": {"settled": True}}) == "accepted"
    assert standing_run({"status": "accepted", "e2e": {"settled": False, "kept": "..."}}) is None
    assert standing_run({"status": "experimental", "reason": "not on the path"}) is None


def test_each_figure_is_judged_against_its_own_threshold():
    """ce2e67b's gate: two builds of one engine differed by ±19 % on a prompt's TTFT and by 0.6 % on throughput.
    One threshold for all (19.3 %) made silu_and_mul's +6.3 % [6.0, 6.5] throughput no gain; per figure it is."""
    aa = {
        "tok_per_s": Effect(-0.35, -0.64, -0.07, 8),
        "itl_ms": Effect(-0.18, -0.38, 0.02, 8),
        "ttft_ms": Effect(-2.13, -19.26, 18.63, 8),
    }
    per_figure = aa_thresholds(aa)
    assert per_figure == {"tok_per_s": 1.0, "itl_ms": 1.0, "ttft_ms": 19.26}
    silu = {
        "tok_per_s": Effect(6.3, 6.0, 6.5, 3),
        "itl_ms": Effect(0.0, -0.3, 0.4, 3),
        "ttft_ms": Effect(-2.9, -14.8, 10.6, 3),
    }
    assert decide(silu, True, 19.26) == "experimental"  # the old single bar
    assert decide(silu, True, per_figure) == "accepted" and settled(silu, per_figure)
    # a TTFT loss inside that figure's own noise does not block, one beyond it does
    slower_ttft = {**silu, "ttft_ms": Effect(-25.0, -30.0, -20.0, 3)}
    assert decide(slower_ttft, True, per_figure) == "experimental"
    # a figure a mapping lacks gets its strictest bar
    assert threshold_of({"tok_per_s": 1.0, "ttft_ms": 19.26}, "itl_ms") == 19.26
    assert threshold_of(2.5, "ttft_ms") == 2.5
    # interleaving stops on the per-figure rule too
    with_k, without_k, _ = _machine(3, speedup=1.5, spread=0.01)
    effects, record = interleaved(with_k, without_k, min_effect_pct={"tok_per_s": 1.0, "itl_ms": 30.0})
    assert record["settled"] and len(record["rounds"]) == 3
    assert decide(effects, True, {"tok_per_s": 1.0, "itl_ms": 30.0}) == "accepted"
