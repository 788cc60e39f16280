#!/usr/bin/env bash
# The GPU A/Bs that are prepared and not yet run, most useful first, inside one device call's time. Each step gets
# what is left of the budget (seconds, default 560) up to its own cap, and is skipped when too little is left; each
# step's artifact lands in $1/<step>/ and every step's output in $1/pending_log.txt (five files at most, two folders
# down: the device tool brings back eight).
# Needs .carry (scripts/gpu-carry.sh); from this machine, with the device tool:
#   run(command="KERNELLAB_COMMIT=<sha> bash benchmarks/gpu/pending_ab.sh \"$OUT\" 560", carry=[".carry"],
#       timeout_s=600)
# Steps (docs/gpu-engine.md says what each decides):
#   rows    decode_attention_sweep.py: the int8 forms (one head a program; 8 heads packed, slices as the count
#           picks, one, two) at the mid batches where most of the offline workload's decode steps run (the packed
#           form is used from 256 rows only, the bucket of 225-256, ~a fifth of the workload's steps); kernel only
#   pmin    knob_ab.py INT8_LAUNCH with pack_min_rows 256 (standing) / 128 / 192 on the offline workload, int8
# Done at 43718b3 and 8319336 (results/gpu/engine_h200_dev/*_43718b3.json, *_8319336.json): the logits' widening
# (kept off: +1.3 % offline with int8), the gate's engine against one drawing its own weights (alike), the fused QKV
# op (no TTFT gain), the packed form in one slice (200 against 214 µs at 256 × 1,024, no offline gain).
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

step rows 150 90 python3 "$ROOT/benchmarks/gpu/decode_attention_sweep.py" --out "$OUT_DIR/rows" --caches int8 \
  --int8-forms mma,pack,packs1,packs2 --tiles 32,64 --warps 4 --stages 2,3 --rounds 0 \
  --cases 128x1024,160x1024,192x1024,192x512,224x768
step pmin 360 200 python3 "$ROOT/benchmarks/gpu/knob_ab.py" --out "$OUT_DIR/pmin" \
  --knob kernellab.kernels.paged_attention.INT8_LAUNCH --sep ';' --contexts 128 --rounds 2 \
  --offline-blocks 10240 --offline-kv int8 --offline-rounds 3 \
  --values "{'block_n': 64, 'num_warps': 4, 'num_stages': 3, 'widen': 'f16', 'i8_asm': True, 'mma': True, 'pack_heads': 8, 'pack_min_rows': 256, 'pack_launch': {'block_n': 32, 'num_stages': 2}}; {'block_n': 64, 'num_warps': 4, 'num_stages': 3, 'widen': 'f16', 'i8_asm': True, 'mma': True, 'pack_heads': 8, 'pack_min_rows': 128, 'pack_launch': {'block_n': 32, 'num_stages': 2}}; {'block_n': 64, 'num_warps': 4, 'num_stages': 3, 'widen': 'f16', 'i8_asm': True, 'mma': True, 'pack_heads': 8, 'pack_min_rows': 192, 'pack_launch': {'block_n': 32, 'num_stages': 2}}"
ls -R "$OUT_DIR"
