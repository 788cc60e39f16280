"""The command line, run as a user runs it (subprocesses)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

KL = [sys.executable, "-m", "kernellab"]


def run(*args, env=None, timeout=300):
    return subprocess.run(
        [*KL, *args], capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


@pytest.mark.slow
def test_generate_answers_sensibly_and_streams_only_the_completion():
    proc = run("generate", "smollm2-135m", "What is the capital of France?", "--max-tokens", "32")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "<|im_start|>" not in proc.stdout and "What is the capital" not in proc.stdout


def test_models_lists_the_registry():
    proc = run("models", env={"COLUMNS": "200"})
    assert proc.returncode == 0
    for name in ("smollm2-135m", "qwen3-0.6b", "qwen3-1.7b", "llama-3.2-1b", "llama-3.2-3b"):
        assert name in proc.stdout


def test_preflight_needs_no_weights():
    proc = run("preflight", "qwen3-0.6b", "--memory-gib", "80", env={"COLUMNS": "200", "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "596,049,920" in proc.stdout  # Qwen3-0.6B's parameter count
    assert "114,688 bytes" in proc.stdout  # 2 · 28 layers · 8 KV heads · 128 · 2 bytes
    assert "--kv-cache-dtype int8 would hold" in proc.stderr and "(1.94×)" in proc.stderr  # 114,688 / 59,136 bytes


@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_preflight_plans_an_8bit_kv_cache(kv):
    env = {"COLUMNS": "200", "HF_HUB_OFFLINE": "1"}
    proc = run("preflight", "qwen3-0.6b", "--memory-gib", "80", "--kv-cache-dtype", kv, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "59,136 bytes" in proc.stdout  # 2 · 28 layers · 8 KV heads · (128 one-byte values + a 4-byte scale)
    assert f"{kv} KV" in proc.stdout  # the title names the cache (rich wraps it)
    bad = run("preflight", "qwen3-0.6b", "--kv-cache-dtype", "int4", env=env)
    assert bad.returncode == 2 and "--kv-cache-dtype" in bad.stderr


def test_download_offline_is_one_clear_line():
    proc = run("download", "qwen3-0.6b", env={"HF_HUB_OFFLINE": "1", "HF_HOME": "/nonexistent-kernellab"})
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "qwen3-0.6b" in lines[0] and "kernellab download" in lines[0]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["generate", "no-such-model", "hi"],
        ["generate", "smollm2-135m", "  "],
        ["generate", "smollm2-135m", "hi", "--temperature", "-1"],
    ],
)
def test_bad_input_exits_with_a_message(args):
    proc = run(*args)
    assert proc.returncode == 2
    assert "error:" in proc.stderr and "Traceback" not in proc.stderr


def test_validate_result(tmp_path):
    good = {
        "schema": "kernellab.bench.offline/v1",
        "model": "m",
        "provenance": {"date": "d", "commit": "c", "python": "3", "torch": "t", "device": "cpu"},
        "runs": [
            {
                "system": "kernellab",
                "workload": "batch1",
                "dtype": "float32",
                "num_prompts": 1,
                "output_tokens": 10,
                "seconds": 1.0,
                "output_tok_per_s": 10.0,
            }
        ],
    }
    (tmp_path / "good.json").write_text(json.dumps(good))
    bad = dict(good, runs=[{**good["runs"][0], "seconds": -1}])
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    (tmp_path / "unknown.json").write_text(json.dumps({"schema": "nope/v9"}))
    assert run("validate-result", str(tmp_path / "good.json")).returncode == 0
    for name in ("bad.json", "unknown.json"):
        proc = run("validate-result", str(tmp_path / name))
        assert proc.returncode == 1 and "invalid" in proc.stderr
