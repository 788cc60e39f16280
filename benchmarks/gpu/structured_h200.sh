#!/usr/bin/env bash
# On the GPU machine: what constrained decoding costs the engine (benchmarks/structured_engine.py) and the whole
# stack (benchmarks/structured_overhead.py --profile h200), with the wheels from .carry/. Artifacts under $1.
#   bash benchmarks/gpu/structured_h200.sh "$OUT"
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT_DIR=${1:-${OUT:-$ROOT/out}}
source "$ROOT/benchmarks/gpu/env.sh"
mkdir -p "$OUT_DIR"
python3 "$ROOT/benchmarks/structured_engine.py" --profile h200 --output "$OUT_DIR/structured_h200.json" "${@:2}" \
  2>&1 | tee "$OUT_DIR/structured_log.txt"
python3 "$ROOT/benchmarks/structured_overhead.py" --profile h200 --output "$OUT_DIR/structured_stack_h200.json" \
  2>&1 | tee "$OUT_DIR/structured_stack_log.txt"
