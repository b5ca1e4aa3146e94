#!/usr/bin/env bash
# Install gossipdl into the current Python (use a venv if you like); `--test` adds the test tools.
# A torch that is already installed is kept (GPU users keep their CUDA build). Otherwise the CPU
# build is installed first, so that pip does not pull a multi-GB CUDA build as a dependency.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
    "$PYTHON" -m pip install --quiet "${GOSSIPDL_TORCH:-torch==2.13.0}"
fi
"$PYTHON" -m pip install --quiet -e ".${extras}"
