#!/usr/bin/env bash
# The main job on embedded defaults: builds lrkv's own small Llama on the first run (about 2 minutes on
# 2 CPU cores, cached afterwards), converts it to a latent KV cache at ratio 0.5, evaluates it and logs the
# run to MLflow (local SQLite under $LRKV_HOME, default ~/.cache/lrkv). Extra arguments go to `lrkv convert`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
lrkv convert --out lrkv-out/pydoc-llama-r0.5 "$@"
