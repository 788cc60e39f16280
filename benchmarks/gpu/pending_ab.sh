#!/usr/bin/env bash
# The GPU A/Bs that are prepared and not yet run, most useful first, inside one device call's time. Each step gets
# what is left of the budget (seconds, default 560) up to its own cap, and is skipped when too little is left; each
# step's artifact lands in $1/<step>/ and every step's output in $1/pending_log.txt (six files at most, two folders
# down: the device tool brings back eight).
# Needs .carry (scripts/gpu-carry.sh); from this machine, with the device tool:
#   run(command="KERNELLAB_COMMIT=<sha> bash benchmarks/gpu/pending_ab.sh \"$OUT\" 560", carry=[".carry"],
#       timeout_s=600)
# Steps (docs/gpu-engine.md says what each decides), for the next H200 (every figure so far is an H100's):
#   tma     decode_attention_sweep.py at 64-token KV blocks: the int8 cache's one-block tiles copied by tensor
#           descriptors (paged_attention._paged_decode_i8_tma_kernel; its copies in 2-3 shared buffers, where the
#           pointer form's gathered tile gets one) against the pointer form, warps × stages
#   tmaoff  knob_ab.py config:block_size 16/64 with INT8_LAUNCH["tma"] on: the standing int8 engine (16-token
#           blocks, pointer forms) against 64-token blocks read through descriptors, offline workload + batch-1 ITL
#   idle    paged_attention.IDLE_SLICES_WAIT True/False: idle slices of the fused batch-1 attention exit at once,
#           so the o_proj GEMV's PDL programs find their SMs free sooner
#   pool    graphs.DECODE_B1_OWN_POOL False/True: the bucket-1 decode graph in a pool of its own (H100: replay 0.821 →
#           0.803 ms at context 128), batch-1 ITL and the graph replayed alone
#   bs16, bs64  decode_attention_sweep.py: the int8 one-head form (and bf16) at 16- and 64-token KV blocks. A
#           64-token tile of one block reads the block table once and takes V as one [D, 64] run per head, without
#           the permute of four blocks' [D, 16] runs that goes through shared memory
#   blocks  knob_ab.py config:block_size 16/64 on the offline workload with the int8 cache (pools of equal tokens)
#   widen   model.WIDEN_LOGITS True/False: 256-row decode steps and the offline workload with the int8 cache (H100:
#           −4.8 % a step, +1.3 % offline), at the H200's 20,480 blocks an engine
# Done on H100s at 43718b3-1e89f97 (results/gpu/engine_h200_dev/*_h100_{43718b3,8319336,43ac9ce,4395e96,94b5be2,
# 1e89f97}.json): the gate's engine against one drawing its own weights (alike), the fused QKV op (no TTFT gain),
# the int8 packed forms at 128-256 rows (no offline gain).
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

step tma 150 60 python3 "$ROOT/benchmarks/gpu/decode_attention_sweep.py" --out "$OUT_DIR/tma" --caches int8 \
  --int8-forms mma,tma --tiles 64 --warps 4,8 --stages 2,3,4 --rounds 0 --block-size 64 \
  --cases 64x1024,128x1024,192x1024,256x1024,192x512,1x4096
step tmaoff 330 200 python3 "$ROOT/benchmarks/gpu/knob_ab.py" --out "$OUT_DIR/tmaoff" --knob config:block_size \
  --values 16,64 --set 'kernellab.kernels.paged_attention.INT8_LAUNCH[tma]=True' --contexts 2048 --rounds 2 \
  --offline-blocks 20480 --offline-kv int8 --offline-rounds 3
step idle 100 60 python3 "$ROOT/benchmarks/gpu/knob_ab.py" --out "$OUT_DIR/idle" \
  --knob kernellab.kernels.paged_attention.IDLE_SLICES_WAIT --values True,False --contexts 2048,128 --replay --rounds 4
step pool 150 60 python3 "$ROOT/benchmarks/gpu/knob_ab.py" --out "$OUT_DIR/pool" \
  --knob kernellab.runtime.graphs.DECODE_B1_OWN_POOL --values False,True --contexts 2048,128 --replay --rounds 4
for bs in 16 64; do
  step "bs$bs" 90 45 python3 "$ROOT/benchmarks/gpu/decode_attention_sweep.py" --out "$OUT_DIR/bs$bs" --caches int8 \
    --int8-forms mma --tiles 64 --warps 4 --stages 2,3 --rounds 0 --block-size "$bs" \
    --cases 128x1024,192x1024,256x1024,192x512
done
step blocks 240 180 python3 "$ROOT/benchmarks/gpu/knob_ab.py" --out "$OUT_DIR/blocks" --knob config:block_size \
  --values 16,64 --contexts 128,2048 --rounds 2 --offline-blocks 10240 --offline-kv int8 --offline-rounds 3
step widen 300 200 python3 "$ROOT/benchmarks/gpu/knob_ab.py" --out "$OUT_DIR/widen" \
  --knob kernellab.runtime.model.WIDEN_LOGITS --values True,False --contexts 128 --decode-batches 256 --rounds 2 \
  --offline-blocks 20480 --offline-kv int8 --offline-rounds 3
ls -R "$OUT_DIR"
