"""The garbage collector's share of a serving process: the pause clock the worker's step trace and metrics read,
and the heap freeze the worker and each gateway process do once started (``gc_freeze``)."""

import gc
import json
import subprocess
import sys
import textwrap

from prometheus_client import CollectorRegistry, generate_latest

from kernellab.services.observability import GC_PAUSES


def test_the_pause_clock_counts_each_collection_by_generation():
    GC_PAUSES.install()
    GC_PAUSES.install()  # idempotent: one callback, not two
    assert gc.callbacks.count(GC_PAUSES._callback) == 1
    before_n, before_s = list(GC_PAUSES.collections), GC_PAUSES.total()
    gc.collect()
    gc.collect(0)
    assert GC_PAUSES.collections[2] == before_n[2] + 1
    assert GC_PAUSES.collections[0] == before_n[0] + 1
    assert GC_PAUSES.total() > before_s
    registry = CollectorRegistry()
    registry.register(GC_PAUSES)
    text = generate_latest(registry).decode()
    assert 'kernellab:gc_pause_seconds_total{generation="2"}' in text


_FREEZE = textwrap.dedent(
    """
    import gc, json
    from kernellab.services.observability import freeze_heap
    keep = [{"i": i, "l": [i]} for i in range(100_000)]  # long-lived, as a tokenizer's or a model's objects are
    tracked_before = len(gc.get_objects())
    frozen = freeze_heap()
    print(json.dumps({"before": tracked_before, "frozen": frozen, "after": len(gc.get_objects()), "kept": len(keep)}))
    """
)


def test_freezing_the_heap_leaves_the_collector_nothing_of_what_startup_built():
    # In a process of its own: a freeze is for the rest of the process's life.
    out = json.loads(subprocess.run([sys.executable, "-c", _FREEZE], capture_output=True, text=True, check=True).stdout)
    assert out["before"] > 200_000 and out["kept"] == 100_000
    assert out["frozen"] >= 200_000  # the dicts and lists above, and every module's objects
    assert out["after"] < 1_000  # a full collection now walks almost nothing


def test_each_collection_is_also_timed_on_the_collecting_threads_cpu_clock():
    GC_PAUSES.install()
    before = GC_PAUSES.snapshot()
    junk = [[i] for i in range(50_000)]  # work for the collector to do
    gc.collect(0)
    after = GC_PAUSES.snapshot()
    del junk
    d = [a - b for a, b in zip(after, before, strict=True)]
    assert d[3] >= 1  # a generation-0 collection ran
    assert d[6] > 0  # and its thread spent CPU time in it
    assert d[6] <= d[0] + 1e-3  # not more than its wall time (the clocks' resolutions aside)


_PROBE = textwrap.dedent(
    """
    import gc, json
    from kernellab.services.observability import GC_PAUSES
    GC_PAUSES.install()
    gc.collect()
    gc.freeze()  # what a serving process froze at startup is not young: the census must not count it
    GC_PAUSES.probe(0.0)  # keep every young collection's census
    class Request:
        def __init__(self, ids):
            self.ids = ids
    young = [Request(list(range(1000))) for _ in range(300)]  # 300 young lists holding 1,000 ints each
    gc.collect(0)
    slow = GC_PAUSES.take_census()
    GC_PAUSES.probe(None)
    gc.collect(0)
    print(json.dumps({"census": slow, "after_off": GC_PAUSES.take_census(), "kept": len(young)}))
    """
)


def test_the_probe_says_what_a_young_collection_walked():
    # In a process of its own: the probe and the freeze are process-wide.
    out = json.loads(subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True).stdout)
    assert out["after_off"] == [] and out["kept"] == 300
    census = [c for c in out["census"] if c["generation"] == 0]
    assert census, out["census"]
    c = census[-1]  # the explicit collection
    assert 600 <= c["objects"] < 2_000  # the 300 requests and their lists (and a few of the interpreter's)
    assert c["by_count"]["Request"][0] == 300
    assert c["by_refs"]["list"][1] >= 300_000  # the lists' elements: the visits that make such a collection slow
    assert c["refs"] >= 300_000 and c["ms"] >= 0 and c["cpu_ms"] >= 0 and c["collected"] == 0


def test_a_bursts_requests_leave_no_reference_per_token_for_young_collections(tmp_path):
    """benchmarks/burst_heap.py, small: what the worker holds per request of a burst (the wire's ids, the sequence,
    its prefix-cache blocks) holds references per block at most, never per token: 64 prompts of 512 tokens once
    left ~111,000 references (tuples per block, lists of ids) that each young collection walked."""
    from tests.support.benchmarks import run_benchmark

    requests, prompt = 8, 256
    out, proc = run_benchmark(
        "burst_heap.py",
        "--requests",
        str(requests),
        "--prompt",
        str(prompt),
        "--repeats",
        "2",
        output=tmp_path / "burst_heap.json",
        schema="kernellab.bench.burst_heap/v1",
        timeout=120,
    )
    (run,) = out["runs"]
    census = run["census"]
    blocks = requests * prompt // 16
    assert census["objects"] >= blocks + 2 * requests  # the census saw the burst (blocks, sequences, their ids)
    assert census["refs"] < 6 * blocks < requests * prompt  # a few per block (tables, chains), not one per token
    assert "young objects" in proc.stdout and len(run["gen0_ms"]["all"]) == 2
