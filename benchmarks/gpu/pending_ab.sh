#!/usr/bin/env bash
# The GPU A/Bs that are prepared and not yet run, most useful first, inside one device call's time. Each step gets
# what is left of the budget (seconds, default 560) up to its own cap, and is skipped when too little is left; each
# step's artifact lands in $1/<step>/ and every step's output in $1/pending_log.txt (six files at most, two folders
# down: the device tool brings back eight).
# Needs .carry (scripts/gpu-carry.sh); from this machine, with the device tool:
#   run(command="KERNELLAB_COMMIT=<sha> bash benchmarks/gpu/pending_ab.sh \"$OUT\" 560", carry=[".carry"],
#       timeout_s=600)
# Steps (docs/gpu-engine.md says what each decides):
#   scales  the int8 cache's scales head-major within a block (ops.INT8_SCALES_HEAD_MAJOR, the default since 0660a50)
#           against dense: the descriptor form's kernel at 64-token blocks in each layout
#           (decode_attention_sweep.py, KERNELLAB_SWEEP_DENSE_SCALES), then the offline workload with the int8 cache
#           on engines of each layout (knob_ab.py)
#   tmaattr INT8_LAUNCH["tma"] False/True with both int8 engines at the 64-token blocks the int8 cache now takes:
#           what the descriptor tiles add over the pointer forms at the same blocks (at 0decfa7 on an H100 the
#           standing 16-token engine against 64-token blocks + TMA measured +4.4 % offline)
#   fp8kv   the gate's 8-bit section (tests/gpu/run.sh --only fp8_kv): the int8 numerics gate and graph == eager at
#           64-token blocks through TMA with head-major scales, offline figures of every cache, the kernel table
# Done on H100s at 43718b3-0decfa7 (results/gpu/engine_h200_dev/*_h100_*.json): the bucket-1 graph's own pool (three
# times), idle slices exiting at once (no change), the int8 forms at 16- and 64-token blocks, the descriptor form's
# sweep, the packed forms, the fused QKV op, the gate's weights.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
export ROOT
OUT_DIR=${1:-${OUT:-$ROOT/out}}
BUDGET=${2:-560}
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/pending_log.txt"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$LOG" || true
source "$ROOT/benchmarks/gpu/env.sh"
T0=$(date +%s)

# step NAME CAP MIN COMMAND...: run COMMAND with min(CAP, what is left) seconds, if at least MIN are left
step() {
  local name=$1 cap=$2 min=$3
  shift 3
  local left=$((BUDGET - ($(date +%s) - T0)))
  if [ "$left" -lt "$min" ]; then
    echo "$name skipped: ${left}s left" | tee -a "$LOG"
    return
  fi
  echo "== $name (at most $((left < cap ? left : cap))s)" | tee -a "$LOG"
  timeout $((left < cap ? left : cap)) "$@" 2>&1 | tee -a "$LOG"
  echo "$name rc=$? at $(($(date +%s) - T0))s" | tee -a "$LOG"
}

SWEEP=(python3 "$ROOT/benchmarks/gpu/decode_attention_sweep.py" --caches int8 --int8-forms tma --tiles 64 --warps 4
  --stages 2 --rounds 0 --block-size 64 --cases 128x1024,192x1024,256x1024,192x512)
for layout in hm dense; do
  step "scales_$layout" 75 40 env KERNELLAB_SWEEP_DENSE_SCALES=$([ $layout = dense ] && echo 1 || echo 0) \
    "${SWEEP[@]}" --out "$OUT_DIR/scales_$layout"
done
step scalesoff 300 200 python3 "$ROOT/benchmarks/gpu/knob_ab.py" --out "$OUT_DIR/scalesoff" \
  --knob kernellab.runtime.ops.INT8_SCALES_HEAD_MAJOR --values False,True --contexts 128 --rounds 1 \
  --offline-blocks 5120 --offline-kv int8 --offline-rounds 3
step tmaattr 330 200 python3 "$ROOT/benchmarks/gpu/knob_ab.py" --out "$OUT_DIR/tmaattr" \
  --knob kernellab.kernels.paged_attention.INT8_LAUNCH --sep ';' --values "$(python3 -c '
from kernellab.kernels.paged_attention import INT8_LAUNCH as L
print(repr({**L, "tma": False}) + "; " + repr({**L, "tma": True}))')" --contexts 2048 --rounds 2 \
  --offline-blocks 5120 --offline-kv int8 --offline-rounds 3
step fp8kv 240 150 bash "$ROOT/tests/gpu/run.sh" "$OUT_DIR/fp8" --only fp8_kv
ls -R "$OUT_DIR"
