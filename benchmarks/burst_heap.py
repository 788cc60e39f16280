"""What a burst of requests leaves for the worker's young garbage collections (CPU, no model).

    python benchmarks/burst_heap.py --output results/burst_heap_cpu.json

A GPU worker met 1-2 ms generation-0 collections in an interactive burst's first steps (docs/deploy.md), inside
the burst's time to first token. A collection walks every young container's references one by one, so what
matters is which per-request objects are containers and how many references they hold. This builds, for
``--requests`` prompts of ``--prompt`` tokens, what the worker holds for each request once its prefill is
launched: the ids unpacked from the wire (``unpack_token_ids``), the engine's ``Sequence``, its blocks taken
and registered in the prefix cache (``BlockManager``: the lookup, the allocation, the registration the engine does
once the prefill is launched). Then it takes the census of generation 0 (``observability.young_census``) and
times one generation-0 collection of it, ``--repeats`` times (the heap collected and frozen before each, as a
serving process's startup objects are).

Each invocation appends one run (the commit of the package it imported) to ``--output``, so one artifact can
hold a tree and the tree before it, run one after the other on the same machine; the artifact's own
``provenance`` is its latest run's.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

SCHEMA = "kernellab.bench.burst_heap/v1"


def burst(requests: int, prompt: int, block_size: int, salt: int) -> list:
    """What the worker holds for each request of a burst once its prefill is launched."""
    from kernellab.runtime.request.block_manager import BlockManager
    from kernellab.runtime.request.sampling import SamplingParams
    from kernellab.runtime.request.sequence import Sequence
    from kernellab.runtime.request.token_ids import pack_token_ids, unpack_token_ids

    bm = BlockManager(requests * (prompt // block_size + 2), block_size)
    held: list = [bm]
    for i in range(requests):
        ids = unpack_token_ids(pack_token_ids([(i * 7919 + j * 31 + salt) % 151_936 for j in range(prompt)]))
        seq = Sequence(f"cmpl-{salt}-{i}", ids, SamplingParams(), 128)
        if not bm.allocate_slots(seq, prompt, bm.get_computed_blocks(seq)):
            raise SystemExit("the pool is too small for the burst")
        bm.cache_full_blocks(seq, upto=prompt)
        held.append((ids, seq))
    return held


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--output", type=Path)
    args = ap.parse_args(argv)

    import kernellab
    from kernellab.results import provenance, write
    from kernellab.services.observability import young_census

    info = provenance("cpu")
    info["commit"] = os.environ.get("KERNELLAB_COMMIT") or info["commit"]
    info["package"] = str(Path(kernellab.__path__[0]).resolve())
    gc.collect()
    gc.freeze()
    gc.disable()  # only the collections this script runs
    census, ms = None, []
    for rep in range(args.repeats):
        held = burst(args.requests, args.prompt, args.block_size, rep)
        census = young_census(0, 6)
        t = time.perf_counter()
        gc.collect(0)
        ms.append((time.perf_counter() - t) * 1e3)
        del held
        gc.collect()
        gc.freeze()
    gc.enable()
    run = {
        "provenance": info,
        "workload": {"requests": args.requests, "prompt_tokens": args.prompt, "block_size": args.block_size},
        "census": census,
        "gen0_ms": {
            "median": round(statistics.median(ms), 3),
            "min": round(min(ms), 3),
            "all": [round(m, 3) for m in ms],
        },
    }
    print(
        f"{info['commit']}: {census['objects']} young objects holding {census['refs']} references; one generation-0 "
        f"collection {run['gen0_ms']['median']} ms (median of {args.repeats}); by references {census['by_refs']}"
    )
    if args.output:
        doc = json.loads(args.output.read_text()) if args.output.exists() else {"schema": SCHEMA, "runs": []}
        doc["runs"].append(run)
        doc["provenance"] = info  # the artifact's: its latest run's (each run keeps its own)
        write(args.output, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
