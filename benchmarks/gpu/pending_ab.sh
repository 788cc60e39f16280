#!/usr/bin/env bash
# The GPU A/Bs that are prepared and not yet run, most useful first, inside one device call's time. Each step gets
# what is left of the budget (seconds, default 560) up to its own cap, and is skipped when too little is left; each
# step's artifact lands in $1/<step>/ and every step's output in $1/pending_log.txt (the device tool brings back eight
# files a call: run the steps in two calls, "balance,gemv,chunks,stack_kernel,stack" and then
# "scales_hm1,scales_dense,scales_hm2,fp8kv", or tar the folder into one file).
# Needs .carry (scripts/gpu-carry.sh); from this machine, with the device tool:
#   run(command="KERNELLAB_COMMIT=<sha> bash benchmarks/gpu/pending_ab.sh \"$OUT\" 560", carry=[".carry"],
#       timeout_s=600)
# A third argument names the steps to run (comma-separated); default: all, in order, as long as the budget lasts.
# Steps (docs/gpu-engine.md says what each decides):
#   balance paged_attention.BALANCE_SLICE_TOKENS 0 against 512: batches whose programs fill the card cut their long
#           contexts into up to 3 slices of at least 512 tokens (length balance), on the offline workload with the
#           int8 cache, and a 256-row step of equal contexts (where it can only cost: idle slices); a list-scheduling
#           model of the workload's full-batch launches puts them 6-13 % faster (decode_balance_model.py)
#   chunks  paged_attention.SEQ_MERGE_CHUNKS 1 against 2: batch-1 contexts of 17-32 slices (1,088-2,048 tokens) merged
#           slice by slice in two chunks of 16 instead of one reduction over the [64, D] tile (the same 159 registers
#           at sm_90); batch-1 ITL at 2,048 (0.843 ms on the H200 against the 0.8 target) and 1,536
#   stack   INT8_LAUNCH["tma"] 1 against 2: the descriptor form with q's and P's 16-bit halves stacked as the rows of
#           one int8 dot a product (half the dots, 96 registers against 126 in the sm_90 SASS, but P's stacked rows
#           reach the dot through byte-wise shared-memory copies): the kernel at 64-token blocks (decode_attention_sweep
#           forms tma,tmastack), then the offline workload with the int8 cache (knob_ab.py)
#   gemv    gemv.M1_GRID (16, 1.8, 16384) against three other batch-1 GEMV grids: the gate/up GEMV's 384 programs of
#           16 rows × 1,024 are ~1.45 waves of two resident programs an SM (128 registers at sm_90); the same rows in
#           two K steps of 512 (76 registers, three an SM: one wave), 32-row tiles (161-168 registers, one an SM) or
#           8-row ones (80, three an SM): batch-1 ITL at 128 and 2,048
#   scales  the kernel with head-major and dense int8 scales once more, in the order hm, dense, hm: at 021b978 on an
#           H100 head-major was 3.5-5.5 % faster at 192-256 rows but 9 % slower at 128 × 1,024, the first case of the
#           call's first sweep (offline: head-major +2.2 %, every round)
#   fp8kv   the gate's 8-bit section (tests/gpu/run.sh --only fp8_kv); on an H200 it belongs to the gate's three calls
# Done on H100s at 43718b3-021b978 (results/gpu/engine_h200_dev/*_h100_*.json): the bucket-1 graph's own pool (three
# times), idle slices exiting at once (no change), the int8 forms at 16- and 64-token blocks, the descriptor form's
# sweep and attribution (+11.8 % offline over the pointer forms at 64-token blocks), head-major scales (+2.2 %), the
# packed forms, the fused QKV op, the gate's weights, the whole gate at 021b978.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
export ROOT
OUT_DIR=${1:-${OUT:-$ROOT/out}}
BUDGET=${2:-560}
ONLY=${3:-}
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/pending_log.txt"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$LOG" || true
source "$ROOT/benchmarks/gpu/env.sh"
T0=$(date +%s)

# step NAME CAP MIN COMMAND...: run COMMAND with min(CAP, what is left) seconds, if at least MIN are left
step() {
  local name=$1 cap=$2 min=$3
  shift 3
  if [ -n "$ONLY" ] && [[ ",$ONLY," != *",$name,"* ]]; then
    return
  fi
  local left=$((BUDGET - ($(date +%s) - T0)))
  if [ "$left" -lt "$min" ]; then
    echo "$name skipped: ${left}s left" | tee -a "$LOG"
    return
  fi
  echo "== $name (at most $((left < cap ? left : cap))s)" | tee -a "$LOG"
  timeout $((left < cap ? left : cap)) "$@" 2>&1 | tee -a "$LOG"
  echo "$name rc=$? at $(($(date +%s) - T0))s" | tee -a "$LOG"
}

SWEEP=(python3 "$ROOT/benchmarks/gpu/decode_attention_sweep.py" --caches int8 --tiles 64 --warps 4 --stages 2
  --rounds 0 --block-size 64 --cases 128x1024,192x1024,256x1024,192x512)
step balance 300 200 python3 "$ROOT/benchmarks/gpu/knob_ab.py" --out "$OUT_DIR/balance" \
  --knob kernellab.kernels.paged_attention.BALANCE_SLICE_TOKENS --values 0,512 --contexts 128 --rounds 1 \
  --decode-batches 256 --offline-blocks 5120 --offline-kv int8 --offline-rounds 3
step gemv 200 120 python3 "$ROOT/benchmarks/gpu/knob_ab.py" --out "$OUT_DIR/gemv" \
  --knob kernellab.kernels.gemv.M1_GRID --sep ';' --values '(16, 1.8, 16384); (16, 1.8, 8192); (32, 0.9, 16384); (16, 3.6, 16384)' \
  --contexts 128,2048 --rounds 6
step chunks 200 120 python3 "$ROOT/benchmarks/gpu/knob_ab.py" --out "$OUT_DIR/chunks" \
  --knob kernellab.kernels.paged_attention.SEQ_MERGE_CHUNKS --values 1,2 --contexts 2048,1536,128 --rounds 6
step stack_kernel 90 40 "${SWEEP[@]}" --int8-forms tma,tmastack --out "$OUT_DIR/stack_kernel"
step stack 300 200 python3 "$ROOT/benchmarks/gpu/knob_ab.py" --out "$OUT_DIR/stack" \
  --knob kernellab.kernels.paged_attention.INT8_LAUNCH --sep ';' --values "$(python3 -c '
from kernellab.kernels.paged_attention import INT8_LAUNCH as L
print(repr({**L, "tma": 1}) + "; " + repr({**L, "tma": 2}))')" --contexts 128 --rounds 1 \
  --offline-blocks 5120 --offline-kv int8 --offline-rounds 3
for layout in hm1 dense hm2; do
  step "scales_$layout" 60 30 env KERNELLAB_SWEEP_DENSE_SCALES=$([ $layout = dense ] && echo 1 || echo 0) \
    "${SWEEP[@]}" --int8-forms tma --out "$OUT_DIR/scales_$layout"
done
step fp8kv 240 150 bash "$ROOT/tests/gpu/run.sh" "$OUT_DIR/fp8" --only fp8_kv
ls -R "$OUT_DIR"
