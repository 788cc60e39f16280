#!/usr/bin/env bash
# The GPU A/Bs that are prepared and not yet run, most useful first, inside one device call's time. Each step gets
# what is left of the budget (seconds, default 560) up to its own cap, and is skipped when too little is left; each
# step's artifact lands in $1/<step>/ and every step's output in $1/pending_log.txt (the device tool brings back eight
# files a call: tar the folder into one file when more come).
# Needs .carry (scripts/gpu-carry.sh); from this machine, with the device tool:
#   run(command="KERNELLAB_COMMIT=<sha> bash benchmarks/gpu/pending_ab.sh \"$OUT\" 560", carry=[".carry"],
#       timeout_s=600)
# A third argument names the steps to run (comma-separated); default: all, in order, as long as the budget lasts.
# Steps (docs/gpu-engine.md says what each decides):
#   balance_bf16  paged_attention.BALANCE_SLICE_TOKENS 0 against 512 with the bf16 cache on the offline workload (and
#            a 256-row step of equal contexts, where it can only cost), in both build orders: none on an H200 at
#            a116037 (20,848 → 20,752 tok/s, one run); a decision needs two agreeing runs
#   prefill_tiles  the prefill attention's Hopper form at 64-row query tiles (two programs an SM, one's softmax
#            beside the other's dots; never timed: the 06f765e sweep had only 128-row tiles) against the engine's
#            128 x 128, kernel alone at 2,048 and 4,096 tokens; then the best 64-row setting against
#            attention.PREFILL_LAUNCH on the TTFT in both build orders (knob_ab --ttft), where it is >= 3 % faster
#   fp8kv    the gate's 8-bit section (tests/gpu/run.sh --only fp8_kv); on an H200 it belongs to the gate's three calls
# Done at 84c2ae3 (H100, results/gpu/engine_h200_dev/*_h100_84c2ae3*): both K steps' weights fetched
# before the PDL wait (gemv.PDL_PREFETCH_STEPS = 2, adopted), length balance with the int8 cache
# (paged_attention.BALANCE_SLICE_TOKENS_INT8 = 512, adopted). At d840afb-a116037
# (results/gpu/engine_h200_dev/*_{h100_d840afb,h200_a116037}*): the batch-1 GEMV grid (8K weights a tile, adopted),
# the chunked merge and the stacked int8 halves (rejected), head-major scales re-timed. Before, on H100s at
# 43718b3-021b978: the bucket-1 graph's own pool (three times), idle slices exiting at once (no change), the int8
# forms at 16- and 64-token blocks, the descriptor form's sweep and attribution, head-major scales (+2.2 %), the
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

BALANCE=(python3 "$ROOT/benchmarks/gpu/knob_ab.py" --knob kernellab.kernels.paged_attention.BALANCE_SLICE_TOKENS
  --contexts 128 --rounds 1 --decode-batches 256 --offline-blocks 10240 --offline-kv auto --offline-rounds 3)
step balance_bf16 300 200 "${BALANCE[@]}" --out "$OUT_DIR/balance_bf16" --values 0,512
step balance_bf16_2 300 200 "${BALANCE[@]}" --out "$OUT_DIR/balance_bf16_2" --values 512,0
step prefill_tiles 420 200 bash "$ROOT/benchmarks/gpu/prefill_tiles_ab.sh" "$OUT_DIR/prefill_tiles"
step fp8kv 240 150 bash "$ROOT/tests/gpu/run.sh" "$OUT_DIR/fp8" --only fp8_kv
ls -R "$OUT_DIR"
