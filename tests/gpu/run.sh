#!/usr/bin/env bash
# On a GPU machine whose python3 has torch, triton and transformers (the lent H200): make the package
# importable without installing it (the repo's folders are the kernellab subpackages), then run the gates.
#   bash tests/gpu/run.sh "$OUT"            # engine gate (numerics, speed, HF peer, kernel ablation)
# One device call runs at most 10 minutes; the whole gate takes longer, so split it (at 20fe239 on an H200 the first
# form with paths in it ran 9.6 minutes and was cut inside paths):
#   bash tests/gpu/run.sh "$OUT/gate" --skip offline_sweep --skip fp8_kv --skip paths   # ~7 min
#   bash tests/gpu/run.sh "$OUT/paths" --only paths                                     # ~2.5 min: every model's path
#   bash tests/gpu/run.sh "$OUT/fp8" --only fp8_kv                                      # ~2.5 min: the 8-bit caches
#   python3 tests/gpu/merge_sections.py "$OUT/gate/engine_h200.json" "$OUT/fp8/engine_h200.json" \
#     --section paths="$OUT/paths/engine_h200.json" -o engine_h200.json
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT_DIR=${1:-${OUT:-$ROOT/out}}
export PYTHONPATH="$ROOT" PYTHONUNBUFFERED=1
source "$ROOT/tests/gpu/shim.sh"
mkdir -p "$OUT_DIR"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader || true
python3 "$ROOT/tests/gpu/run_engine.py" --out "$OUT_DIR" "${@:2}" 2>&1 | tee "$OUT_DIR/engine_log.txt"
