#!/usr/bin/env bash
# Set up, then run the test suite (CPU; ../shared assets are used when present).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python -m pytest -q --durations=25 "$@"
