"""The length-balance model (benchmarks/kernels/decode_balance_model.py): its slicing is the kernel's
(``paged_attention._slice_of``) and its schedule a plain list schedule, so what it says about balance follows from the
workload's lengths, not from the model."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
spec = importlib.util.spec_from_file_location(
    "decode_balance_model", ROOT / "benchmarks/kernels/decode_balance_model.py"
)
assert spec is not None and spec.loader is not None
model = importlib.util.module_from_spec(spec)
spec.loader.exec_module(model)


def test_slices_are_the_kernels():
    # 3 slices of at least 512 tokens: 300 stays whole (two idle slices), 2,048 is cut into 704 + 704 + 640
    units = model.jobs([300, 2048], kv_heads=1, splits=3, min_slice=512, tile=64, idle=0.25, merge=0.5)
    assert units == [5, 11.5, 0.25, 11.5, 0.25, 10.5]  # grid order: the sequence fastest, then the slice


def test_a_list_schedule_ends_with_its_longest_chain():
    assert model.launch_time([4, 1, 1, 1, 1], slots=2) == 4
    assert model.launch_time([1, 1, 1, 1, 4], slots=2) == 6  # a long job launched last runs alone at the end


def test_balance_cannot_help_equal_contexts_and_helps_mixed_ones():
    equal = [1024] * 256
    one = model.launch_time(model.jobs(equal, 8, 1, 64, 64, 0.2, 0.5), 528)
    cut = model.launch_time(model.jobs(equal, 8, 3, 512, 64, 0.2, 0.5), 528)
    assert cut > one  # idle slices and merges only cost when every program is as long
    mixed = [100 + (i * 37) % 1900 for i in range(256)]
    one = model.launch_time(model.jobs(mixed, 8, 1, 64, 64, 0.2, 0.5), 528)
    cut = model.launch_time(model.jobs(mixed, 8, 3, 512, 64, 0.2, 0.5), 528)
    assert cut < one
