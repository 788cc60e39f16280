#!/usr/bin/env python3
"""Regenerate runtime/kernel_status.json (the dispatcher's accepted/experimental/rejected table) from the
engine gate's ablation in a GPU artifact. Each op's status carries its evidence: the numerics check at real
shapes and the end-to-end effect of turning it off.

    python benchmarks/update_kernel_status.py results/gpu/engine_h200.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kernellab.bench.ablation import Effect, aa_thresholds, decide, settled, standing_run, verdict

ROOT = Path(__file__).resolve().parents[1]
STATUS = ROOT / "runtime" / "kernel_status.json"
# Ops a model never calls (its decoder uses a fused op instead).
OFF_PATH = {
    "qwen3-0.6b": {
        "rotary_embedding": "Qwen3 uses qk_norm_rope_store_kv",
        "qk_norm_rope": "fused into qk_norm_rope_store_kv",
        "store_kv": "fused into qk_norm_rope_store_kv",
    }
}


def thresholds(rows: dict) -> float | dict[str, float]:
    """The decision thresholds of an ablation section: per figure, as the gate records them since ce2e67b's run. An
    artifact with one threshold for every figure and its A/A record is re-read with per-figure thresholds from
    that record (kernellab.bench.ablation: one bar for all let a noisy TTFT set it for throughput and ITL)."""
    threshold = rows["__rule__"]["min_effect_pct"]
    aa = (rows.get("__aa__") or {}).get("effects")
    if not isinstance(threshold, dict) and aa:
        return aa_thresholds({fig: Effect(**e) for fig, e in aa.items()})
    return threshold


def evidence(
    row: dict, rows: dict, artifact: str, standing: str | None = None, standing_run: str | None = None
) -> dict:
    """An op's status with what decided it: numerics at real shapes and the end-to-end effect of turning it off
    (interleaved rounds with a 95 % interval per figure; older artifacts: one run against a noise band). An
    unsettled run keeps ``standing``, the op's status before this artifact, and a settled contrary one changes it
    only when ``standing_run``, the run before's own verdict, said the same (kernellab.bench.ablation.decide)."""
    e2e = {"throughput_gain_pct": row["e2e_gain_tok_per_s_pct"], "itl_gain_pct": row["e2e_gain_itl_pct"]}
    if "e2e_gain_ttft_pct" in row:
        e2e["ttft_gain_pct"] = row["e2e_gain_ttft_pct"]
    status = row["status"]
    if "effects" in row:
        e2e["interval_95_pct"] = {fig: [e["lo_pct"], e["hi_pct"]] for fig, e in row["effects"].items()}
        e2e["rounds"] = len(row["rounds"])
        threshold = thresholds(rows)
        e2e["rule"] = {**rows["__rule__"], "min_effect_pct": threshold}
        effects = {fig: Effect(**e) for fig, e in row["effects"].items()}
        e2e["settled"] = settled(effects, threshold)
        ok = row["numerics"]["pass"]
        run_status = decide(effects, ok, threshold)
        status = decide(effects, ok, threshold, previous=standing, previous_run=standing_run)
        e2e["run_status"] = verdict(effects, ok, threshold)  # the next run's standing_run
        if status != run_status:
            e2e["kept"] = (
                f"this run alone says {run_status}; unsettled, so the standing decision stays"
                if e2e["run_status"] is None
                else f"this run alone says {run_status} (settled), the run before did not: contested, and the "
                "standing decision stays until a second run in a row says the same"
            )
    else:
        e2e["noise_band_pct"] = rows.get("__noise_pct__")
    return {
        "status": status,
        "numerics": row["numerics"],
        "e2e": e2e,
        "artifact": str(Path(artifact).relative_to(ROOT)) if Path(artifact).is_absolute() else artifact,
    }


def main(artifact: str) -> int:
    data = json.loads(Path(artifact).read_text())
    ablation = data.get("ablation") or {}
    if not ablation:
        print(f"{artifact} has no ablation section", file=sys.stderr)
        return 1
    current = json.loads(STATUS.read_text())["ops"]
    # Ops off the gate model's path are judged on a model whose path has them (the gate's "paths" section runs
    # the Llama family's own ablation on the embedded model's shape).
    path_ablations = {
        key.removeprefix("ablation_"): rows
        for key, rows in (data.get("paths") or {}).items()
        if key.startswith("ablation_") and isinstance(rows, dict)
    }
    ops = {}
    for op, entry in current.items():
        row = ablation.get(op)
        judged_on = next((m for m, rows in path_ablations.items() if isinstance(rows.get(op), dict)), None)
        if op in OFF_PATH.get(data["model"], ()) and judged_on is not None:
            rows = path_ablations[judged_on]
            ops[op] = {
                **evidence(rows[op], rows, artifact, entry.get("status"), standing_run(entry)),
                "path": f"{judged_on} (not on {data['model']}'s: {OFF_PATH[data['model']][op]})",
            }
            continue
        if op in OFF_PATH.get(data["model"], ()) and "path" in entry and not path_ablations:
            # judged on another model's path by an earlier gate, and this artifact ran no path ablation (a run of
            # the ablation section alone): that judgement stands
            ops[op] = entry
            continue
        if op in OFF_PATH.get(data["model"], ()):
            # Turning off an op the model never calls changes nothing: any "gain" measured is noise.
            ops[op] = {
                "status": "experimental",
                "numerics": row["numerics"] if isinstance(row, dict) else None,
                "reason": f"not on {data['model']}'s path ({OFF_PATH[data['model']][op]}); no end-to-end "
                "effect to measure on the GPU model",
                "artifact": artifact,
            }
            if ops[op]["numerics"] is None:
                del ops[op]["numerics"]
            continue
        if not isinstance(row, dict) or "status" not in row:
            # not measured by this artifact (an op the gate does not ablate, such as l2_prefetch, rejected by its
            # own A/B): the standing entry stays as it is, evidence included
            ops[op] = entry if "status" in entry else {"status": "experimental", "reason": "not measured"}
            continue
        ops[op] = evidence(row, ablation, artifact, entry.get("status"), standing_run(entry))
    out = {
        "schema": "kernellab.acceptance/v1",
        "source": {
            "commit": data["provenance"]["commit"],
            "gpu": data["provenance"].get("gpu"),
            "date": data["provenance"]["date"],
        },
        "rule": "accepted = numerics pass at real shapes AND the complete workload (decode 64x128 throughput, "
        "batch-1 ITL or a 2,000-token prompt's TTFT) is faster with the op by at least that figure's min_effect_pct (the "
        "larger of 1 % and the A/A interval's extent on that figure) at 95 % confidence (interleaved rounds against "
        "the engine without it), and no figure is slower by its threshold with the same confidence; "
        "a run whose intervals still straddle the threshold keeps the standing decision, and a settled run changes it "
        "only when the run before it said the same (two consecutive runs)",
        "ops": ops,
    }
    STATUS.write_text(json.dumps(out, indent=2) + "\n")
    for op, e in ops.items():
        print(f"{op:24s} {e['status']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
