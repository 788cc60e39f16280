#!/usr/bin/env bash
# On the GPU machine (no network): install what scripts/gpu-carry.sh packed into .carry/, then run the serving
# benchmark (benchmarks/serve_gpu.py). Everything lands under /tmp; the artifact under $1 (default $OUT).
#   bash benchmarks/gpu/serve_h200.sh "$OUT" --gpus 2
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT_DIR=${1:-${OUT:-$ROOT/out}}
[ -d "$ROOT/.carry/wheels" ] || { echo "no .carry/: run scripts/gpu-carry.sh here and carry .carry" >&2; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  "$ROOT"/.carry/wheels/*.whl
RR=/tmp/redis-root
for d in "$ROOT"/.carry/debs/*.deb; do dpkg -x "$d" "$RR"; done
cat > "$RR/redis-server" <<SH
#!/bin/sh
LD_LIBRARY_PATH=$RR/usr/lib/x86_64-linux-gnu exec $RR/usr/bin/redis-server "\$@"
SH
chmod +x "$RR/redis-server"
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
source "$ROOT/tests/gpu/shim.sh"  # the package without installing it
mkdir -p "$OUT_DIR"
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader || true
cd /tmp  # not the repo root: there `python -m kernellab…` would find the bare kernellab/ folder first
python3 "$ROOT/benchmarks/serve_gpu.py" --profile h200 --redis-server "$RR/redis-server" \
  --output "$OUT_DIR/serve_h200.json" "${@:2}" 2>&1 | tee "$OUT_DIR/serve_log.txt"
