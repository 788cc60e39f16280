"""Every JSON artifact committed under results/ validates against the schema it declares (the README's tables
and the kernel status are generated from them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kernellab.results import validate

RESULTS = Path(__file__).resolve().parents[2] / "results"
ARTIFACTS = sorted(RESULTS.rglob("*.json"))


def test_there_are_artifacts():
    assert len(ARTIFACTS) >= 5


@pytest.mark.parametrize("path", ARTIFACTS, ids=lambda p: str(p.relative_to(RESULTS)))
def test_artifact_validates_against_its_schema(path):
    data = json.loads(path.read_text())
    assert validate(data) == data["schema"]
    assert data["provenance"]["commit"], path
