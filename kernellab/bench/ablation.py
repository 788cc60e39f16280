"""The kernel-lab rule's measurement: is the complete workload faster with a kernel than without it?

One measurement of each configuration decides nothing on a GPU whose run-to-run spread is several percent: two
gate runs of the same commit flipped four kernels between accepted and experimental. So the two engines (every
kernel on; the one op off) stay built and are measured in alternating rounds (A B, B A, A B, …, which cancels a
slow drift of the machine). Each round gives one paired ratio per figure; the effect is the mean of their logs,
with a Student-t confidence interval, and rounds continue until the interval no longer straddles a decision
threshold or the round budget is spent.

Figures: ``tok_per_s`` (higher is better), ``itl_ms`` and ``ttft_ms`` (lower is better; the last since the prefill
attention became an op); an effect is the kernel's gain in percent, positive when the workload is faster with it.

Decision (``decide``): *accepted* when numerics pass, the kernel's gain on one figure is at least that figure's
threshold with the interval's confidence (its lower bound above it), and no figure is slower by its threshold
with the same confidence (no upper bound below minus it); *rejected* when numerics fail; *experimental*
otherwise. Where an interval still straddles its threshold after the last round, the decision is flagged
``settled: False`` in the artifact.

Thresholds (``min_effect_pct``): one number for every figure, or one per figure. The gate gives each figure its
own (``aa_thresholds``): the larger of ``MIN_EFFECT_PCT`` and how far two builds of one engine differ on that
figure (the A/A interval's extent). One threshold for all let the noisiest figure set the bar for the steady ones:
at ce2e67b a 2,000-token prompt's TTFT moved ±19 % between two builds while throughput moved 0.6 %, and under a
19.3 % bar for everything silu_and_mul's +6.3 % [6.0, 6.5] throughput counted as no gain.

Decisions that hold still (``previous``): an op whose true effect lies near ``min_effect_pct`` straddles it in
some runs and clears it in others, so a rule applied to each run alone flips it between accepted and
experimental from one gate to the next (silu_and_mul_linear: ITL +2.8 % [2.4, 3.2] then +3.1 % [2.1, 4.1] at
thresholds of 2.35 and 2.31 %). So a run whose intervals are not settled does not overturn the standing decision
(``runtime/kernel_status.json``): it keeps it, and only settled evidence that points the other way with the
same confidence changes it. Settled is not enough on its own: a run's interval covers the spread between its own
rounds, not between the lent machines, and two settled runs of the same commit can disagree (rms_norm, ITL gain
+1.28 % [1.04, 1.52] at f611de0, then +0.4 % [0.2, 0.5] at 3fc91bb against a 1 % threshold). So a settled run
that contradicts the standing decision changes it only when the run before it (``previous_run``: its own settled
verdict, kept in the status table) said the same: a decision changes on two consecutive runs, never on one, and a
lone contrary run is recorded as contesting it. A kernel whose numerics fail is rejected whatever came before.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass

# two-sided 95 % Student-t quantiles, by degrees of freedom (1…30); beyond, the normal's 1.96
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131)
_T975 += (2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)

# +1: higher is better. ttft_ms (a 2,000-token prompt's first token) judges the ops of steps that prefill, which
# the decode workload and batch-1 ITL barely run; a measurement without it is judged on the other two.
FIGURES = {"tok_per_s": +1, "itl_ms": -1, "ttft_ms": -1}
# No kernel counts as helping by less than this on any figure, however quiet the machine.
MIN_EFFECT_PCT = 1.0
Threshold = float | Mapping[str, float]  # percent: one for every figure, or per figure


@dataclass(frozen=True)
class Effect:
    """A kernel's gain on one figure, in percent (mean over rounds and its 95 % interval)."""

    mean_pct: float
    lo_pct: float
    hi_pct: float
    rounds: int

    def straddles(self, threshold_pct: float) -> bool:
        return self.lo_pct < threshold_pct < self.hi_pct


def threshold_of(min_effect_pct: Threshold, figure: str) -> float:
    """A figure's threshold; a per-figure mapping without it gives its largest (the strictest bar)."""
    if isinstance(min_effect_pct, Mapping):
        return float(min_effect_pct.get(figure, max(min_effect_pct.values())))
    return float(min_effect_pct)


def aa_thresholds(aa: Mapping[str, Effect], floor_pct: float = MIN_EFFECT_PCT) -> dict[str, float]:
    """Per figure: the larger of ``floor_pct`` and the extent of the A/A interval (two builds of the same engine
    measured against each other), rounded to 0.01 %."""
    return {fig: round(max(floor_pct, abs(e.lo_pct), abs(e.hi_pct)), 2) for fig, e in aa.items()}


def paired_effect(ratios: list[float]) -> Effect:
    """``ratios``: per round, (figure with the kernel) / (figure without), oriented so > 1 means faster with it."""
    if not ratios:
        raise ValueError("no rounds")
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        half = math.inf
    else:
        t = _T975[len(logs) - 2] if len(logs) - 1 <= len(_T975) else 1.96
        half = t * statistics.stdev(logs) / math.sqrt(len(logs))

    def pct(x: float) -> float:
        return round(100 * math.expm1(x), 2) if math.isfinite(x) else math.copysign(math.inf, x)

    return Effect(pct(mean), pct(mean - half), pct(mean + half), len(logs))


def decide(
    effects: dict[str, Effect],
    numerics_pass: bool,
    min_effect_pct: Threshold,
    previous: str | None = None,
    previous_run: str | None = None,
) -> str:
    """The op's status from this run (see the module's "Decision"); ``previous``: the standing status, which an
    unsettled run keeps; ``previous_run``: the last run's own settled verdict, which a contrary settled run needs
    to change it (see "Decisions that hold still")."""
    if not numerics_pass:
        return "rejected"
    helps = any(e.lo_pct > threshold_of(min_effect_pct, f) for f, e in effects.items())
    hurts = any(e.hi_pct < -threshold_of(min_effect_pct, f) for f, e in effects.items())
    status = "accepted" if helps and not hurts else "experimental"
    if previous in ("accepted", "experimental"):
        if not settled(effects, min_effect_pct):
            return previous
        if status != previous and previous_run != status:
            return previous  # a first contrary run contests the decision; a second in a row changes it
    return status


def verdict(effects: dict[str, Effect], numerics_pass: bool, min_effect_pct: Threshold) -> str | None:
    """This run's own settled verdict (what the next run's ``previous_run`` is), or None where it is unsettled."""
    if numerics_pass and not settled(effects, min_effect_pct):
        return None
    return decide(effects, numerics_pass, min_effect_pct)


def standing_run(entry: dict) -> str | None:
    """The last run's own settled verdict on an op, from its entry in runtime/kernel_status.json: recorded since
    3fc91bb's gate; before, a settled run's verdict was its status unless the standing one was kept over it."""
    e2e = entry.get("e2e") or {}
    if "run_status" in e2e:
        return e2e["run_status"]
    return entry.get("status") if e2e.get("settled") and "kept" not in e2e else None


def settled(effects: dict[str, Effect], min_effect_pct: Threshold) -> bool:
    """More rounds could not change the decision's inputs: no interval straddles ± its figure's threshold."""
    return not any(
        e.straddles(threshold_of(min_effect_pct, f)) or e.straddles(-threshold_of(min_effect_pct, f))
        for f, e in effects.items()
    )


def interleaved(
    with_kernel: Callable[[], dict],
    without_kernel: Callable[[], dict],
    *,
    min_effect_pct: Threshold = MIN_EFFECT_PCT,
    min_rounds: int = 3,
    max_rounds: int = 8,
) -> tuple[dict[str, Effect], dict]:
    """Alternate the two measurements (each returns ``{"tok_per_s", "itl_ms"}``) until ``settled`` (after
    ``min_rounds``) or ``max_rounds``; returns each figure's Effect and a JSON record (effects, whether they
    settled, the raw rounds)."""
    rounds: list[tuple[dict, dict]] = []
    effects: dict[str, Effect] = {}
    for i in range(max_rounds):
        if i % 2 == 0:
            a = with_kernel()
            b = without_kernel()
        else:
            b = without_kernel()
            a = with_kernel()
        rounds.append((a, b))
        effects = {
            fig: paired_effect([(x[fig] / y[fig]) ** sign for x, y in rounds])
            for fig, sign in FIGURES.items()
            if fig in a and fig in b
        }
        if i + 1 >= min_rounds and settled(effects, min_effect_pct):
            break
    return effects, {
        "effects": {fig: asdict(e) for fig, e in effects.items()},
        "settled": settled(effects, min_effect_pct),
        "rounds": [{"with": a, "without": b} for a, b in rounds],
    }
