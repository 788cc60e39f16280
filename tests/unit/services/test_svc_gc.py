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
