#!/usr/bin/env bash
# Create the kvpress peer's virtual environment (outside the repository): bash setup.sh [VENV_DIR]
# Default VENV_DIR: $KVPRESS_VENV, else /work/peer/kvpress-venv. torch goes in first, on its own, so that
# kvpress's dependency on torch is already met by the CPU build and pip pulls no CUDA build.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${1:-${KVPRESS_VENV:-/work/peer/kvpress-venv}}"
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q "$(grep -E '^torch==' "$here/requirements.txt")"
"$venv/bin/python" -m pip install -q -r "$here/requirements.txt"
"$venv/bin/python" -c "import kvpress, torch, transformers; print('kvpress', kvpress.__version__ if hasattr(kvpress, '__version__') else '0.5.5', 'torch', torch.__version__, 'transformers', transformers.__version__)"
