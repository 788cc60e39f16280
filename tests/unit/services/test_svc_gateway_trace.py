"""The gateway's request trace: one line per request, and a write that fails turns it off instead of failing
the request it was recording."""

from __future__ import annotations

import json
import os

from kernellab.services.gateway.trace import RequestTrace


def test_lines_carry_the_times_given_and_drop_missing_ones(tmp_path):
    path = tmp_path / "t.jsonl"
    trace = RequestTrace(str(path))
    trace.request("cmpl-1", {"in": 1.0, "enq": 1.25, "sent": None})
    trace.request("cmpl-2", {"in": 2.0})
    trace.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["rid"] for x in lines] == ["cmpl-1", "cmpl-2"]
    assert lines[0]["enq"] == 1.25 and "sent" not in lines[0] and isinstance(lines[0]["pid"], int)


def test_a_failed_write_turns_the_trace_off(tmp_path, caplog):
    trace = RequestTrace(str(tmp_path / "t.jsonl"))
    os.close(trace._fd)  # the descriptor goes bad under it (as a full disk or a closed file would fail a write)
    trace._fd = os.open(os.devnull, os.O_RDONLY)  # writes to a read-only descriptor raise OSError
    with caplog.at_level("WARNING", logger="kernellab.gateway"):
        trace.request("cmpl-1", {"in": 1.0})  # no exception
        trace.request("cmpl-2", {"in": 2.0})
    assert trace._fd is None
    assert sum("gateway trace off" in r.message for r in caplog.records) == 1
