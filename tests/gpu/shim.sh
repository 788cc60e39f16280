# Sourced by the GPU scripts: makes the package importable without installing it (the repo's folders are the
# kernellab subpackages) by putting a folder named kernellab, whose entries link to them, on PYTHONPATH.
# Needs ROOT (the repo root); prepends the shim to PYTHONPATH.
SHIM=$(mktemp -d)
mkdir -p "$SHIM/kernellab"
for f in "$ROOT"/kernellab/*; do ln -s "$f" "$SHIM/kernellab/"; done
ln -s "$ROOT/kernels" "$SHIM/kernellab/kernels"
ln -s "$ROOT/runtime" "$SHIM/kernellab/runtime"
ln -s "$ROOT/services" "$SHIM/kernellab/services"
export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
