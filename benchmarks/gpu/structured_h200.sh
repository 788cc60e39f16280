#!/usr/bin/env bash
# On the GPU machine: what constrained decoding costs the engine (benchmarks/structured_engine.py), with the
# llguidance wheel from .carry/. The artifact under $1 (default $OUT).
#   bash benchmarks/gpu/structured_h200.sh "$OUT"
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT_DIR=${1:-${OUT:-$ROOT/out}}
source "$ROOT/benchmarks/gpu/env.sh"
mkdir -p "$OUT_DIR"
python3 "$ROOT/benchmarks/structured_engine.py" --profile h200 --output "$OUT_DIR/structured_h200.json" "${@:2}" \
  2>&1 | tee "$OUT_DIR/structured_log.txt"
