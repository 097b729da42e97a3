#!/usr/bin/env bash
# Set up, then run the test suite (CPU; ../shared assets are used when present).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
# Two workers by default (LRKV_TEST_WORKERS=N for another count, 0 for none), each test file on one worker so
# its module fixtures are built once and its tests keep their order, the files in collection order
# (tests/conftest.py puts the slow tests/flows first and gives each worker one thread).
python -m pytest -q -n "${LRKV_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder --durations=25 "$@"
