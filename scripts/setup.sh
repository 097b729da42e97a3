#!/usr/bin/env bash
# Set up .venv with everything lrkv needs (idempotent). torch is installed first and pinned to the CPU
# build available here (torch==2.13.0); a bare `torch` requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
# The package is installed in editable mode, so only a change of its requirements (or of this script) needs
# the installs again: a second run with both unchanged returns at once.
STAMP=.venv/.lrkv-setup
WANT=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
FOUND="import importlib.util as u; assert all(map(u.find_spec, ('torch', 'lrkv_core', 'lrkv_flows')))"
if [ "$(cat "$STAMP" 2>/dev/null)" = "$WANT" ] && python -c "$FOUND" 2>/dev/null; then exit 0; fi
python -m pip install -q --upgrade pip
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==${LRKV_TORCH_VERSION:-2.13.0}"
python -m pip install -q -e ".[dev,anchor]"  # anchor: hqq + quanto for the QuantizedCache comparison
echo "$WANT" > "$STAMP"
