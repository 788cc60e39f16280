#!/usr/bin/env bash
# What the GPU machine lacks for the serving benchmark, packed into .carry/ (git-ignored; `carry` it along):
# the Python wheels the gateway and worker import (cp312, the versions installed here) and Debian's
# redis-server with the libraries it links, to be unpacked there with dpkg -x. Then, with the device tool:
#   run(command="bash benchmarks/gpu/serve_h200.sh \"$OUT\" --gpus 2", carry=[".carry"], kind="nvidia-h200-x2")
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=.carry
rm -rf "$OUT"
mkdir -p "$OUT/wheels" "$OUT/debs"
grep -qx '/.carry/' .git/info/exclude 2>/dev/null || echo '/.carry/' >> .git/info/exclude
# Not on the GPU image (its package list is in the device tool's KINDS.md): the web stack, redis-py and what
# redis-py imports (opentelemetry-api) or parses with (hiredis, its C RESP parser; without it the gateway pays
# pure-Python parsing on every reply), jsonschema for artifact validation, llguidance for constrained decoding.
PKGS=(fastapi starlette uvicorn sse-starlette pydantic pydantic-core pydantic-settings python-dotenv
      typing-inspection annotated-types annotated-doc opentelemetry-api redis hiredis httptools
      jsonschema jsonschema-specifications referencing rpds-py llguidance)
for p in "${PKGS[@]}"; do
  # the version installed here, else the newest
  v=$("$PY" -c "import importlib.metadata as m; print('==' + m.version('$p'))" 2>/dev/null || true)
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d "$OUT/wheels" "$p$v" 2>&1 | grep -v "is ignored" || true
done
DEBS=(redis-server redis-tools libjemalloc2 liblzf1)
# A fresh machine may have no package lists yet: update them once and try again.
(cd "$OUT/debs" && { apt-get download -q "${DEBS[@]}" >/dev/null 2>&1 \
  || { apt-get update -qq && apt-get download -q "${DEBS[@]}" >/dev/null; }; })
du -sh "$OUT"
