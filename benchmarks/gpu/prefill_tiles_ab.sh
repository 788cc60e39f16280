#!/usr/bin/env bash
# The prefill attention's Hopper form at 64-row query tiles against the engine's 128 x 128 (kernels/attention.py:
# PREFILL_LAUNCH). A 64-row tile with 4 warps leaves room for two programs an SM, so one's softmax can run beside
# the other's dots; the 06f765e sweep timed only 128-row tiles. First the kernel alone at 2,048 and 4,096 tokens
# (benchmarks/gpu/prefill_attention.py --tiles); then, only where the best 64-row setting is >= 3 % faster at 2,048,
# the TTFT A/B on the complete engine (knob_ab.py --ttft), 6 interleaved rounds in each build order.
#   bash benchmarks/gpu/prefill_tiles_ab.sh "$OUT/prefill_tiles"   (in pending_ab.sh, or after benchmarks/gpu/env.sh)
set -uo pipefail
ROOT=${ROOT:-$(cd "$(dirname "$0")/../.." && pwd)}
dir=${1:?an output folder}
mkdir -p "$dir"

# the standing setting, as the engine has it (a literal knob_ab.py reads back) and as a --tiles part
read -r cur_tiles cur < <(python3 -c 'from kernellab.kernels.attention import PREFILL_LAUNCH as c
print("m{block_m}n{block_n}w{num_warps}s{num_stages}".format(**c), repr(c))')
[ -n "$cur" ] || exit 1
python3 "$ROOT/benchmarks/gpu/prefill_attention.py" --out "$dir/sweep.json" --cases "one prompt" \
  --tiles "$cur_tiles",m64n64w4s2,m64n64w4s3,m64n64w4s4,m64n128w4s2,m64n128w4s3,m64n64w8s3,m64n128w8s2 || exit 1
best=$(
  python3 - "$dir/sweep.json" "$cur" <<'PY'
import ast, json, sys
paths = json.load(open(sys.argv[1]))["cases"]["one prompt 2048"]["paths"]
cur = ast.literal_eval(sys.argv[2])
t = {k: v["us"] for k, v in paths.items() if k.startswith("triton") and v.get("us")}
base = t.get("triton m{block_m} n{block_n} w{num_warps} s{num_stages} tma heavy_first".format(**cur))
m64 = {k: us for k, us in t.items() if " m64 " in k}
if base and m64:
    k = min(m64, key=m64.get)
    print(f"best 64-row setting: {k}, {m64[k]:.1f} us against {base:.1f}", file=sys.stderr)
    if m64[k] <= 0.97 * base:
        bm, bn, w, s = (int(x[1:]) for x in k.split()[1:5])
        print(repr({**cur, "block_m": bm, "block_n": bn, "num_warps": w, "num_stages": s}))
PY
)
if [ -z "$best" ]; then
  echo "no 64-row setting 3 % faster at 2,048 tokens: no TTFT A/B"
  exit 0
fi
ab=(python3 "$ROOT/benchmarks/gpu/knob_ab.py" --knob kernellab.kernels.attention.PREFILL_LAUNCH --sep ';'
  --contexts 128 --ttft 2048,4000 --rounds 6)
"${ab[@]}" --out "$dir/ab_cur_new" --values "$cur;$best"
"${ab[@]}" --out "$dir/ab_new_cur" --values "$best;$cur"
