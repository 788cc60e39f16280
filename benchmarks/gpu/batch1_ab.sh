#!/usr/bin/env bash
# On the GPU machine: the batch-1 decode A/Bs prepared without a GPU, each one knob (benchmarks/gpu/knob_ab.py,
# interleaved rounds, one engine per value, the same greedy tokens required), ~3 minutes in all:
#   - kernels/paged_attention.B1_LAUNCH: one 128-token tile per slice at batch 1 (no merge at context 128) against
#     today's 64-token slices and their merge;
#   - runtime/model.FUSED_FINAL_NORM: the final RMSNorm inside the LM head's GEMV at one row.
# Artifacts: $1/b1/knob_ab.json, $1/final_norm/knob_ab.json (default $OUT); logs beside them.
#   bash benchmarks/gpu/batch1_ab.sh "$OUT"        (carry .carry; export KERNELLAB_COMMIT first)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT_DIR=${1:-${OUT:-$ROOT/out}}
DEVICE=${KNOB_DEVICE:-cuda}  # cpu: the scripts' path on a CPU (tiny model, torch ops), not the knobs' effect
if [ "$DEVICE" = cuda ]; then source "$ROOT/benchmarks/gpu/env.sh"; fi
mkdir -p "$OUT_DIR/b1" "$OUT_DIR/final_norm"
python3 "$ROOT/benchmarks/gpu/knob_ab.py" --device "$DEVICE" --out "$OUT_DIR/b1" \
  --knob kernellab.kernels.paged_attention.B1_LAUNCH --sep ';' \
  --values 'None; {"block_n": 128, "num_warps": 8, "min_slice": 128}; {"block_n": 128, "num_warps": 4, "min_slice": 128}' \
  --contexts 128,512,2048 2>&1 | tee "$OUT_DIR/b1/log.txt"
python3 "$ROOT/benchmarks/gpu/knob_ab.py" --device "$DEVICE" --out "$OUT_DIR/final_norm" \
  --knob kernellab.runtime.model.FUSED_FINAL_NORM --values False,True --contexts 128,2048 \
  2>&1 | tee "$OUT_DIR/final_norm/log.txt"
