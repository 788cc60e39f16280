#!/usr/bin/env bash
# On the GPU machine (its python3 has torch and triton; no .carry needed): the GPU kernel tests and every kernel
# benchmark (tests/gpu/run_kernels.py), the package importable through tests/gpu/shim.sh and benchmarks.kernels
# through the repo root, both on PYTHONPATH. kernels_<gpu>.json and the test logs land under $1 (default $OUT).
#   bash benchmarks/gpu/kernels.sh "$OUT" [--budget 230] [--skip-tests]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT_DIR=${1:-${OUT:-$ROOT/out}}
export PYTHONPATH="$ROOT" PYTHONUNBUFFERED=1
source "$ROOT/tests/gpu/shim.sh"
mkdir -p "$OUT_DIR"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader || true
python3 "$ROOT/tests/gpu/run_kernels.py" --out "$OUT_DIR" "${@:2}" 2>&1 | tee "$OUT_DIR/kernels_log.txt"
