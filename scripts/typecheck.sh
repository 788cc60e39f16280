#!/usr/bin/env bash
# mypy over runtime/ and services/ (pyproject's [tool.mypy]); extra arguments go to mypy.
# The code imports kernellab.runtime.* and kernellab.services.*, folders that pyproject's package-dir maps into
# the package. The editable install does that with an import hook, which mypy cannot follow, so .typecheck/
# mirrors the mapping as symlinks (mypy_path), and the report's paths are turned back into the repository's.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
tree=.typecheck/kernellab
rm -rf .typecheck
mkdir -p "$tree"
for entry in kernellab/*; do ln -s "../../$entry" "$tree/"; done
for sub in kernels runtime services; do ln -s "../../$sub" "$tree/$sub"; done
"$VENV/bin/mypy" "$@" | sed -E 's#^\.typecheck/kernellab/(kernels|runtime|services)/#\1/#; s#^\.typecheck/##'
