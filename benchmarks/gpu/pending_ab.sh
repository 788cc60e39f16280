#!/usr/bin/env bash
# The GPU A/Bs that are prepared and not yet run, most useful first, inside one device call's time. Each step gets
# what is left of the budget (seconds, default 560) up to its own cap, and is skipped when too little is left; each
# step's artifact lands in $1/<step>/ and every step's output in $1/pending_log.txt (five files at most, two folders
# down: the device tool brings back eight).
# Needs .carry (scripts/gpu-carry.sh); from this machine, with the device tool:
#   run(command="KERNELLAB_COMMIT=<sha> bash benchmarks/gpu/pending_ab.sh \"$OUT\" 560", carry=[".carry"],
#       timeout_s=600)
# Steps (docs/gpu-engine.md says what each decides):
#   widen   model.WIDEN_LOGITS True/False: the fp32 widening of several rows' logits, decode steps of 64 and 256 rows
#   ttft    ttft_engines_ab.py: the gate's latency engine against one drawing its own weights (the 0.27 ms gap)
#   packed  decode_attention_sweep.py --packed: the int8 packed forms (masked, select in 3 slices, one slice)
#   qkv     knob_ab.py op:qkv_proj_norm_rope_store_kv off/on: TTFT at 2,048 and 4,000 tokens
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

step widen 150 90 python3 "$ROOT/benchmarks/gpu/knob_ab.py" --out "$OUT_DIR/widen" \
  --knob kernellab.runtime.model.WIDEN_LOGITS --values True,False --contexts 128 --decode-batches 64,256 --rounds 4
step ttft 150 60 python3 "$ROOT/benchmarks/gpu/ttft_engines_ab.py" --out "$OUT_DIR/ttft" --rounds 6
step packed 330 200 python3 "$ROOT/benchmarks/gpu/decode_attention_sweep.py" --out "$OUT_DIR/packed" --packed \
  --int8-forms pack,packsels3,packs1 --tiles 32 --warps 4 --stages 2,3 --rounds 2
step qkv 300 90 python3 "$ROOT/benchmarks/gpu/knob_ab.py" --out "$OUT_DIR/qkv" \
  --knob op:qkv_proj_norm_rope_store_kv --values off,on --contexts 128 --ttft 2048,4000 --rounds 6
ls -R "$OUT_DIR"
