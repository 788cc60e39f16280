#!/usr/bin/env bash
# On the GPU machine (no network): install what scripts/gpu-carry.sh packed into .carry/, then run the serving
# benchmark (benchmarks/serve_gpu.py). Everything lands under /tmp; the artifact under $1 (default $OUT).
#   bash benchmarks/gpu/serve_h200.sh "$OUT" --gpus 2
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT_DIR=${1:-${OUT:-$ROOT/out}}
source "$ROOT/benchmarks/gpu/env.sh"
mkdir -p "$OUT_DIR"
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader || true
python3 "$ROOT/benchmarks/serve_gpu.py" --profile h200 --redis-server "$RR/redis-server" \
  --output "$OUT_DIR/serve_h200.json" "${@:2}" 2>&1 | tee "$OUT_DIR/serve_log.txt"
