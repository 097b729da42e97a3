#!/usr/bin/env bash
# Set up .venv with everything lrkv needs (idempotent). torch is installed first and pinned to the CPU
# build available here (torch==2.13.0); a bare `torch` requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==${LRKV_TORCH_VERSION:-2.13.0}"
python -m pip install -q -e ".[dev,anchor]"  # anchor: hqq + quanto for the QuantizedCache comparison
