#!/usr/bin/env python3
"""Join the engine gate's two device calls into one artifact: the gate run without its 8-bit section and the
``--only fp8_kv`` run at the same commit (one call runs at most 10 minutes; together they take longer).

    python3 tests/gpu/merge_sections.py GATE/engine_h200.json FP8/engine_h200.json -o results/gpu/engine_h200.json

The 8-bit section keeps its own provenance; the commits must match, errors of both runs are kept. A section the
gate's call did not finish (it ran past the call's limit) can come from one more call at the same commit:

    ... -o engine_h200.json --section paths=PATHS/engine_h200.json   # bash tests/gpu/run.sh OUT --only paths
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _check_same_commit(a: dict, b: dict) -> None:
    x, y = a["provenance"].get("commit"), b["provenance"].get("commit")
    if x != y:
        raise ValueError(f"the runs are of different commits ({x} and {y})")


def merge(gate: dict, fp8: dict) -> dict:
    if "fp8_kv" not in fp8:
        raise ValueError("the second artifact has no fp8_kv section (run it with --only fp8_kv)")
    _check_same_commit(gate, fp8)
    out = dict(gate)
    out["fp8_kv"] = {
        **fp8["fp8_kv"],
        "provenance": fp8["provenance"],
        "run": "a second device call at the same commit: bash tests/gpu/run.sh OUT --only fp8_kv",
    }
    out["errors"] = list(gate.get("errors", [])) + list(fp8.get("errors", []))
    out["sections_run"] = (
        "bash tests/gpu/run.sh OUT --skip offline_sweep --skip fp8_kv, then --only fp8_kv (one device call runs at "
        "most 10 minutes)"
    )
    return out


def add_section(merged: dict, name: str, other: dict) -> dict:
    """``merged`` with ``name`` taken from ``other``, a run of the same commit (``--only name``)."""
    if name not in other:
        raise ValueError(f"the artifact for {name!r} has no such section")
    _check_same_commit(merged, other)
    section = other[name]
    if isinstance(section, dict):
        section = {**section, "provenance": other["provenance"], "run": f"bash tests/gpu/run.sh OUT --only {name}"}
    merged[name] = section
    merged["errors"] = list(merged.get("errors", [])) + list(other.get("errors", []))
    merged["sections_run"] += f"; {name} from one more call at the same commit (--only {name})"
    return merged


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("gate")
    ap.add_argument("fp8")
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--section", action="append", default=[], metavar="NAME=PATH", help="a section from another run")
    args = ap.parse_args()
    merged = merge(json.loads(Path(args.gate).read_text()), json.loads(Path(args.fp8).read_text()))
    for spec in args.section:
        name, _, path = spec.partition("=")
        merged = add_section(merged, name, json.loads(Path(path).read_text()))
    Path(args.out).write_text(json.dumps(merged, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
