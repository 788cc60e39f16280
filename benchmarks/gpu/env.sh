# Sourced by the GPU benchmark scripts on the device machine (no network): installs what scripts/gpu-carry.sh
# packed into .carry/ (wheels into /tmp/site, Debian's redis-server unpacked under /tmp/redis-root with a
# wrapper at $RR/redis-server), puts the package on PYTHONPATH without installing it, and leaves the shell in
# /tmp (at the repo root `python -m kernellab…` would find the bare kernellab/ folder first). Needs ROOT.
[ -d "$ROOT/.carry/wheels" ] || { echo "no .carry/: run scripts/gpu-carry.sh here and carry .carry" >&2; exit 2; }
if [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$ROOT"/.carry/wheels/*.whl
fi
RR=/tmp/redis-root
if [ ! -x "$RR/redis-server" ]; then
  for d in "$ROOT"/.carry/debs/*.deb; do dpkg -x "$d" "$RR"; done
  cat > "$RR/redis-server" <<SH
#!/bin/sh
LD_LIBRARY_PATH=$RR/usr/lib/x86_64-linux-gnu exec $RR/usr/bin/redis-server "\$@"
SH
  chmod +x "$RR/redis-server"
fi
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 PATH="$RR:$PATH"  # redis-server for the benchmarks' private stacks
source "$ROOT/tests/gpu/shim.sh"  # the package without installing it
cd /tmp
