"""The H200 A/B scripts' own paths on the CPU (a tiny Qwen3, torch ops, decode buckets run eagerly), so they do not
rot between GPU sessions: each writes an artifact that validates, with the same greedy tokens from every engine.
What they measure needs the GPU; here only the path runs."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kernellab.results import validate

ROOT = Path(__file__).resolve().parents[3]


def run(script: str, tmp_path: Path, *args: str) -> dict:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu" / script), "--out", str(tmp_path), "--device", "cpu", *args]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(next(tmp_path.glob("*.json")).read_text())


def test_the_knob_ab_builds_one_engine_per_value_and_restores_the_constant(tmp_path):
    from kernellab.kernels import paged_attention

    data = run(
        "knob_ab.py",
        tmp_path,
        *("--knob", "kernellab.kernels.paged_attention.MIN_SLICE_TOKENS", "--values", "64,128"),
        *("--contexts", "64", "--decode-batches", "4", "--rounds", "2", "--replay"),
    )
    assert validate(data) == "kernellab.bench.knob_ab/v1"
    assert data["same_tokens"] and data["values"] == ["64", "128"] and data["standing"] == "64"
    assert [(r["value"], r["round"]) for r in data["runs"]] == [("64", 0), ("128", 0), ("128", 1), ("64", 1)]
    assert set(data["summary"]) == {"itl_ms_p50@64", "decode_replay_ms@1", "decode_step_ms@4"}
    assert all(r["decode_replay_ms@1"] > 0 for r in data["runs"])
    assert paged_attention.MIN_SLICE_TOKENS == 64  # this process's constant is untouched (the script's own restored)


def test_the_knob_ab_runs_the_offline_workload_with_the_knob_set_while_each_engine_runs(tmp_path):
    from kernellab.runtime import model

    data = run(
        "knob_ab.py",
        tmp_path,
        *("--knob", "kernellab.runtime.model.WIDEN_LOGITS", "--values", "True,False", "--contexts", "64"),
        *("--rounds", "2", "--offline-blocks", "512", "--offline-kv", "int8"),
    )
    assert validate(data) == "kernellab.bench.knob_ab/v1"
    offline = data["offline"]
    assert offline["engine"]["kv_cache_dtype"] == "int8" and offline["engine"]["num_kv_blocks"] == 512
    assert offline["same_first_prompt_tokens"] and data["same_tokens"]
    assert [(r["value"], r["round"]) for r in offline["runs"]] == [("True", 0), ("False", 0), ("False", 1), ("True", 1)]
    assert all(r["output_tok_per_s"] > 0 for r in offline["runs"])
    assert set(offline["summary"]["output_tok_per_s"]) == {"True", "False", "over_True"}
    assert model.WIDEN_LOGITS is False  # this process's constant is untouched


def test_the_knob_ab_takes_an_engine_config_field_with_pools_of_the_same_tokens(tmp_path):
    data = run(
        "knob_ab.py",
        tmp_path,
        *("--knob", "config:block_size", "--values", "16,64", "--contexts", "64", "--rounds", "2"),
        *("--offline-blocks", "512", "--offline-kv", "int8"),
        *("--set", "kernellab.kernels.paged_attention.INT8_LAUNCH[tma]=True"),
    )
    assert validate(data) == "kernellab.bench.knob_ab/v1"
    assert data["values"] == ["16", "64"] and data["standing"] == "16" and data["same_tokens"]
    assert data["set_in_every_engine"] == ["kernellab.kernels.paged_attention.INT8_LAUNCH[tma]=True"]
    per = data["engine_per_value"]
    assert per["16"]["block_size"] == 16 and per["64"]["block_size"] == 64
    assert per["16"]["num_kv_blocks"] == 4 * per["64"]["num_kv_blocks"]  # the same tokens in either pool
    assert data["offline"]["same_first_prompt_tokens"]


def test_the_knob_ab_takes_dicts_for_launch_settings(tmp_path):
    from kernellab.kernels import paged_attention

    launch = dict(paged_attention.LAUNCH)
    data = run(
        "knob_ab.py",
        tmp_path,
        *("--knob", "kernellab.kernels.paged_attention.LAUNCH", "--sep", ";"),
        *("--values", f'{launch}; {{"block_n": 32, "num_warps": 8, "num_stages": 2}}', "--contexts", "64"),
        *("--rounds", "2"),
    )
    assert data["same_tokens"] and data["values"] == [str(launch), "{'block_n': 32, 'num_warps': 8, 'num_stages': 2}"]
    assert paged_attention.LAUNCH == launch  # noqa: SIM300  (the module constant, restored)


def test_the_knob_ab_turns_one_dispatcher_op_on(tmp_path):
    """``op:NAME``: the default engine against the same engine with that op allowed (here on the CPU's torch
    references, so only the path and the record); the status table of this process is untouched."""
    from kernellab.runtime import dispatch

    standing = dispatch.load_status()
    data = run(
        "knob_ab.py",
        tmp_path,
        *("--knob", "op:decode_attention_o_proj", "--values", "off,on", "--contexts", "64", "--rounds", "1"),
    )
    assert validate(data) == "kernellab.bench.knob_ab/v1"
    assert data["values"] == ["off", "on"] and data["same_tokens"]
    assert data["standing"].startswith("decode_attention_o_proj: ") and data["standing"].endswith("kernel_status.json")
    assert dispatch.load_status() == standing


def test_the_knob_ab_refuses_a_knob_that_does_not_exist(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu" / "knob_ab.py"), "--out", str(tmp_path), "--device", "cpu"]
    for knob, values, says in (
        ("kernellab.runtime.model.NO_SUCH_THING", "1,2", "has no NO_SUCH_THING"),
        ("op:no_such_op", "off,on", "op:NAME takes a dispatcher op"),
    ):
        proc = subprocess.run(
            [*cmd, "--knob", knob, "--values", values], cwd=tmp_path, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode != 0 and says in proc.stderr, knob


def test_the_l2_prefetch_ab_runs_its_path(tmp_path):
    data = run("l2_prefetch_ab.py", tmp_path, "--rounds", "1")
    assert validate(data) == "kernellab.bench.l2_prefetch_ab/v1"
    assert data["same_tokens"] and {r["variant"] for r in data["runs"]} == set(data["variants"])


def test_the_kv_dtype_profile_times_and_profiles_each_cache(tmp_path):
    data = run("kv_dtype_profile.py", tmp_path, "--caches", "bf16,int8@300", "--decode-calls", "3", "--top", "5")
    assert validate(data) == "kernellab.bench.kv_dtype_profile/v1"
    assert list(data["caches"]) == ["bf16", "int8@300"]
    assert [c["run"]["kv_blocks"] for c in data["caches"].values()] == [512, 300]  # a pool named, or the default
    for cache in data["caches"].values():
        calls = cache["run"]["calls"]
        assert calls["prefill"]["n"] >= 1 and calls["decode"]["n"] >= 1 and cache["run"]["output_tok_per_s"] > 0
        first, decode = cache["profile"]["first_step"], cache["profile"]["decode"]
        assert decode["calls"] == 3 and decode["running"] > 0  # the full batch, every prompt in
        assert 0 < len(first["top"]) <= 5 and first["total_ms"] >= first["top"][0]["ms"] > 0


def test_the_tree_ab_runs_each_tree_in_its_own_process_in_alternating_order(tmp_path):
    data = run(
        "tree_ab.py",
        tmp_path,
        *("--trees", f"old={ROOT},new={ROOT}", "--ttft", "48", "--contexts", "64", "--rounds", "2"),
    )
    assert validate(data) == "kernellab.bench.tree_ab/v1"
    assert data["same_tokens"] and set(data["trees"]) == {"old", "new"}
    assert [(r["tree"], r["round"]) for r in data["runs"]] == [("old", 0), ("new", 0), ("new", 1), ("old", 1)]
    assert set(data["summary"]) == {"itl_ms_p50@64", "ttft_ms_p50@48"}
    assert all(r["ttft_ms_p50@48"] > 0 for r in data["runs"])


def test_the_decode_attention_sweep_times_the_packed_int8_forms(tmp_path):
    """``decode_attention_sweep.py --packed``: each packed form's settings checked against the reference and timed
    (here under the interpreter), their settings compiled first in child processes as on the GPU, each form's best
    tiles picked; kernel times only (``--rounds 0``)."""
    data = run(
        "decode_attention_sweep.py",
        tmp_path,
        *("--packed", "--int8-forms", "pack,packsels3,packs1", "--tiles", "16", "--warps", "4", "--stages", "2"),
        *("--rounds", "0", "--precompile", "2"),
    )
    assert validate(data) == "kernellab.bench.decode_attention_sweep/v1"
    assert data["provenance"]["commit"]
    (row,) = data["kernel"]["rows"]
    forms = [(c["pack_heads"], c["pack_select"], c["pack_splits"]) for c in row["int8"]]
    assert forms == [(8, 0, 0), (8, 1, 3), (8, 0, 1)]
    assert all(c["rel_err_vs_reference"] < 1e-2 and c["us"] > 0 for c in row["int8"] + row["bf16"])
    assert set(data["best_pack_launch"]) == {"pack", "packsels3", "packs1"}


def test_the_decode_attention_sweep_times_the_int8_descriptor_form(tmp_path):
    """``--int8-forms tma,tmastack`` at 32-token KV blocks: the one-block tiles copied by tensor descriptors (the
    16-bit halves in two dots or stacked in one), checked against the reference beside the pointer form."""
    data = run(
        "decode_attention_sweep.py",
        tmp_path,
        *("--caches", "int8", "--int8-forms", "mma,tma,tmastack", "--tiles", "32", "--warps", "4", "--stages", "2"),
        *("--rounds", "0", "--precompile", "0", "--block-size", "32"),
    )
    assert validate(data) == "kernellab.bench.decode_attention_sweep/v1"
    assert data["kernel"]["shape"]["block_size"] == 32
    assert data["int8_scales"] == "head-major"  # the engine's layout (ops.scale_zeros)
    for row in data["kernel"]["rows"]:
        forms = {int(c.get("tma") or 0): c for c in row["int8"] if c.get("mma")}
        assert set(forms) == {0, 1, 2}
        assert all(c["rel_err_vs_reference"] < 1e-2 and c["us"] > 0 for c in forms.values())


def test_the_ttft_engines_ab_compares_the_gates_weights_with_the_engines_own(tmp_path):
    data = run("ttft_engines_ab.py", tmp_path, "--rounds", "2")
    assert validate(data) == "kernellab.bench.ttft_engines_ab/v1"
    assert data["holds_hf_weights"] == {"hf": True, "random": False}
    assert [(r["engine"], r["round"]) for r in data["runs"]] == [("hf", 0), ("random", 0), ("random", 1), ("hf", 1)]
    assert all(r["ttft_ms_p50@64"] > 0 for r in data["runs"])


def test_the_prefill_attention_probe_reads_tile_settings():
    """``prefill_attention.py --tiles``: each ``mMnNwWsS`` is the Hopper form's launch at those settings, longest
    tiles first; anything else stops the script with the form it wants (the probe itself needs a GPU)."""
    spec = importlib.util.spec_from_file_location("prefill_probe", ROOT / "benchmarks" / "gpu" / "prefill_attention.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    configs = probe.tile_configs("m64n128w4s3, m128n128w8s3")
    assert configs == [
        {"block_m": 64, "block_n": 128, "num_warps": 4, "num_stages": 3, "tma": True, "heavy_first": True},
        {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3, "tma": True, "heavy_first": True},
    ]
    assert probe.triton_label(configs[0]) == "triton m64 n128 w4 s3 tma heavy_first"  # what prefill_tiles_ab.sh parses
    with pytest.raises(SystemExit, match="m64n64w4s3"):
        probe.tile_configs("m64n64w4")
