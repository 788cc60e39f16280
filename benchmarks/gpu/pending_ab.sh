#!/usr/bin/env bash
# The GPU A/Bs that are prepared and not yet run, most useful first, inside one device call's time. Each step gets
# what is left of the budget (seconds, default 560) up to its own cap, and is skipped when too little is left; each
# step's artifact lands in $1/<step>/ and every step's output in $1/pending_log.txt (five files at most, two folders
# down: the device tool brings back eight).
# Needs .carry (scripts/gpu-carry.sh); from this machine, with the device tool:
#   run(command="KERNELLAB_COMMIT=<sha> bash benchmarks/gpu/pending_ab.sh \"$OUT\" 560", carry=[".carry"],
#       timeout_s=600)
# Steps (docs/gpu-engine.md says what each decides):
#   widen   model.WIDEN_LOGITS True/False on the offline workload with the int8 cache (the decode steps of 64 and
#           256 rows were 2.2 % and 4.8 % faster without the widening at 43718b3 on an H100; the complete workload
#           decides)
#   packed  decode_attention_sweep.py --packed: the int8 packed form with its slices a sequence fixed at one
#           (packs1: 200 against 214 µs at 256 × 1,024 and 89 against 103 at 256 × 384 at 43718b3 on an H100)
#           against the standing launch, on the offline workload (10,240 blocks an engine: three fit an H100)
# Done at 43718b3 (results/gpu/engine_h200_dev/*_43718b3.json): widen's decode steps, ttft (the gate's engine
# against one drawing its own weights), qkv (op:qkv_proj_norm_rope_store_kv, no TTFT gain).
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

step widen 240 150 python3 "$ROOT/benchmarks/gpu/knob_ab.py" --out "$OUT_DIR/widen" \
  --knob kernellab.runtime.model.WIDEN_LOGITS --values True,False --contexts 128 --rounds 2 \
  --offline-blocks 10240 --offline-kv int8 --offline-rounds 3
step packed 330 150 python3 "$ROOT/benchmarks/gpu/decode_attention_sweep.py" --out "$OUT_DIR/packed" --packed \
  --int8-forms pack,packs1 --tiles 32 --warps 4 --stages 2 --rounds 3 --offline-blocks 10240
ls -R "$OUT_DIR"
