"""Schemathesis against the gateway's OpenAPI document (tests/support/gateway_openapi.py): bounded cases per
operation (``KERNELLAB_FUZZ_EXAMPLES``, 10 in CI, plus schemathesis' coverage cases), sent with a valid key to
the running stack. Every response must be no 5xx, have a documented status and content type, and match its
documented schema.

With ``KERNELLAB_FUZZ_REPORT=path`` the last test writes the figures (cases, statuses, failures) as a
``kernellab.reliability.fuzz/v1`` artifact: that is how results/reliability/fuzz.json is made."""

from __future__ import annotations

import os
from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from tests.support.gateway_openapi import gateway_openapi
from tests.support.reliability import auth

pytestmark = pytest.mark.integration

EXAMPLES = int(os.environ.get("KERNELLAB_FUZZ_EXAMPLES", "10"))
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
schema = schemathesis.openapi.from_dict(gateway_openapi())
FIGURES: dict = {"cases": 0, "statuses": Counter(), "failures": [], "operations": Counter()}


@schema.parametrize()
@settings(
    max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)
def test_gateway_conforms_to_its_schema_and_never_answers_5xx(case, rstack):
    FIGURES["cases"] += 1
    FIGURES["operations"][f"{case.method} {case.path}"] += 1
    try:
        response = case.call(base_url=rstack.url, headers=auth(), timeout=60)
        FIGURES["statuses"][str(response.status_code)] += 1
        case.validate_response(response, checks=CHECKS)
    except BaseException as exc:  # schemathesis raises a FailureGroup (an exception group)
        FIGURES["failures"].append(f"{case.method} {case.path}: {type(exc).__name__}: {str(exc)[:300]}")
        raise


def test_fuzz_figures(rstack):
    """Runs after the fuzzing (file order): the stack still serves, and the figures go to an artifact."""
    assert rstack.ready_workers() == 2, rstack.log_tail()
    assert FIGURES["cases"] > 0
    server_errors = sum(n for status, n in FIGURES["statuses"].items() if status.startswith("5"))
    out = os.environ.get("KERNELLAB_FUZZ_REPORT")
    if out:
        from kernellab import results

        results.write(
            out,
            {
                "schema": "kernellab.reliability.fuzz/v1",
                "provenance": results.provenance("cpu"),
                "config": {
                    "examples_per_operation": EXAMPLES,
                    "schemathesis": schemathesis.__version__,
                    "checks": [c.__name__ for c in CHECKS],
                    "command": f"KERNELLAB_FUZZ_EXAMPLES={EXAMPLES} KERNELLAB_FUZZ_REPORT={out} "
                    "pytest tests/integration/reliability/test_fuzz.py",
                },
                "cases": FIGURES["cases"],
                "operations": dict(FIGURES["operations"]),
                "statuses": dict(FIGURES["statuses"]),
                "server_errors": server_errors,
                "failures": FIGURES["failures"][:50],
                "passed": not FIGURES["failures"] and server_errors == 0,
            },
        )
    assert server_errors == 0 and not FIGURES["failures"], FIGURES["failures"][:5]
