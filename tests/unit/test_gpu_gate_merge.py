"""The engine gate runs in two device calls (tests/gpu/run.sh's comment); ``tests/gpu/merge_sections.py`` joins
their artifacts (three where the gate's call ran past its limit and a section came from one more call). The
committed artifact is such a join: split it back and the merge rebuilds it exactly, and the merge refuses runs of
different commits or a second run without the 8-bit section."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.gpu.merge_sections import add_section, merge

ARTIFACT = Path(__file__).resolve().parents[2] / "results" / "gpu" / "engine_h200.json"


def _extra_sections(d: dict) -> list[str]:
    """The sections that came from a call of their own (``--section``): they carry that call's provenance."""
    return [k for k, v in d.items() if k != "fp8_kv" and isinstance(v, dict) and "run" in v and "provenance" in v]


def _split(d: dict) -> tuple[dict, dict]:
    gate = {k: v for k, v in d.items() if k not in ("fp8_kv", "sections_run", *_extra_sections(d))}
    section = {k: v for k, v in d["fp8_kv"].items() if k not in ("provenance", "run")}
    fp8 = {"schema": d["schema"], "provenance": d["fp8_kv"]["provenance"], "fp8_kv": section, "errors": []}
    return gate, fp8


def test_merge_rebuilds_the_committed_gate_artifact():
    d = json.loads(ARTIFACT.read_text())
    gate, fp8 = _split(d)
    merged = merge(gate, fp8)
    for name in _extra_sections(d):
        section = {k: v for k, v in d[name].items() if k not in ("provenance", "run")}
        other = {"schema": d["schema"], "provenance": d[name]["provenance"], name: section, "errors": []}
        merged = add_section(merged, name, other)
    assert merged == d


def test_a_section_from_another_commit_is_refused():
    gate, fp8 = _split(json.loads(ARTIFACT.read_text()))
    other = {"provenance": {**gate["provenance"], "commit": "0000000"}, "paths": {"x": 1}}
    with pytest.raises(ValueError, match="different commits"):
        add_section(merge(gate, fp8), "paths", other)
    with pytest.raises(ValueError, match="no such section"):
        add_section(merge(gate, fp8), "paths", {"provenance": gate["provenance"]})


def test_merge_refuses_mismatched_runs():
    gate, fp8 = _split(json.loads(ARTIFACT.read_text()))
    with pytest.raises(ValueError, match="different commits"):
        merge(gate, {**fp8, "provenance": {**fp8["provenance"], "commit": "0000000"}})
    with pytest.raises(ValueError, match="no fp8_kv section"):
        merge(gate, {k: v for k, v in fp8.items() if k != "fp8_kv"})
