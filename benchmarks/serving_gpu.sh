#!/usr/bin/env bash
# `lrkv bench` on a GPU machine that has Python, torch and Triton but no lrkv install and no network.
#
#   bash benchmarks/serving_gpu.sh pack     # here, where pip reaches an index: writes .bundle/site.tar.xz
#   bash benchmarks/serving_gpu.sh run      # there, from a copy of this checkout with .bundle beside it
#   bash benchmarks/serving_gpu.sh test     # there: the kernel tests on the GPU (TESTS names them)
#
# pack downloads, for the target's Python (PY_VERSION, default 3.12) on x86-64 Linux, the wheels of the
# packages this checkout's .venv holds at the versions it holds, except torch, Triton, CUDA's libraries, the
# test and anchor extras, and the packages the target already has (HAVE: a file of names, one per line; by
# default the list below, a GPU image's). It unpacks them into one folder, drops what `lrkv bench` never
# reads (MLflow's web UI, botocore's models of services other than S3 and STS) and packs it as
# .bundle/site.tar.xz (about 45 MB).
#
# run unpacks the bundle to /tmp/lrkv-site, saves a Llama of SmolLM2-135M's shape with random weights
# (benchmarks/random_model.py) and runs `lrkv bench` on the GPU over static caches with compiled decode
# steps, writing each run's log and JSON to $OUT (default ./bench-out). Each `lrkv bench` run is named by
# CONTEXTS, KEYS, RATIOS, BITS and BATCH; the runs after the first reuse its conversions from the store.
set -euo pipefail
cd "$(dirname "$0")/.."
BUNDLE=${BUNDLE:-.bundle}

# A GPU image's Python packages (the ones lrkv also needs are read from there, not carried); transformers,
# huggingface-hub, typer, rich, click and protobuf are carried anyway, at the versions lrkv is tested with.
DEFAULT_HAVE="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
certifi charset-normalizer cloudpickle colorama contourpy cycler filelock fonttools frozenlist fsspec grpcio
h11 hf-xet httpcore httpx humanize idna imageio jinja2 joblib kiwisolver lxml markdown markdown-it-py
markupsafe matplotlib mdurl ml-dtypes mpmath msgpack multidict narwhals networkx numpy packaging pandas
pathspec peft pillow pip pluggy portalocker prometheus-client propcache psutil pyarrow pygments pyparsing
python-dateutil pyyaml regex requests safetensors scikit-learn scipy setuptools shellingham six
sortedcontainers sympy tabulate threadpoolctl tokenizers toolz torch tqdm triton typing-extensions
typing-inspect urllib3 werkzeug wheel wrapt xxhash yarl zipp"

pack() {
  local py=${PY_VERSION:-3.12} work names
  work=$(mktemp -d)
  trap 'rm -rf "$work"' RETURN
  if [ -n "${HAVE:-}" ]; then names=$(cat "$HAVE"); else names=$DEFAULT_HAVE; fi
  printf '%s\n' $names | tr 'A-Z_' 'a-z-' | sort -u > "$work/have"
  .venv/bin/python -m pip freeze --exclude-editable | grep '==' | while IFS='=' read -r name _ version; do
    key=$(echo "$name" | tr 'A-Z_' 'a-z-')
    case $key in
      torch | triton | nvidia-* | cuda-* | ruff | pytest* | execnet | iniconfig | moto | hqq | optimum-quanto) continue ;;
    esac
    grep -qx "$key" "$work/have" && continue
    echo "$name==$version"
  done > "$work/wanted"
  echo "pack: $(wc -l < "$work/wanted") packages for CPython $py on x86-64 Linux"
  local tags=() n
  for n in 5 17 24 26 27 28 31 34 35; do tags+=(--platform "manylinux_2_${n}_x86_64"); done
  tags+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
  mkdir -p "$work/wheels" "$work/site"
  while read -r req; do  # one at a time: a package with no wheel (an sdist-only one) is left out and named
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version "$py" \
      --implementation cp "${tags[@]}" -d "$work/wheels" "$req" > /dev/null 2>&1 || echo "pack: no wheel for $req, left out"
  done < "$work/wanted"
  for wheel in "$work"/wheels/*.whl; do .venv/bin/python -m zipfile -e "$wheel" "$work/site"; done
  rm -rf "$work/site/mlflow/server/js"
  find "$work/site/botocore/data" -mindepth 1 -maxdepth 1 -type d ! -name s3 ! -name sts -exec rm -rf {} +
  mkdir -p "$BUNDLE"
  tar -C "$work/site" -cf - . | xz -6 -T0 > "$BUNDLE/site.tar.xz.tmp"
  mv "$BUNDLE/site.tar.xz.tmp" "$BUNDLE/site.tar.xz"
  echo "pack: wrote $BUNDLE/site.tar.xz ($(du -h "$BUNDLE/site.tar.xz" | cut -f1))"
}

environment() {  # the bundle unpacked (once) and the checkout's packages on PYTHONPATH
  local site=/tmp/lrkv-site pkgs=/tmp/lrkv-packages
  mkdir -p "$OUT" "$site" "$pkgs"
  [ -f "$site/.unpacked" ] || { tar -C "$site" -xJf "$BUNDLE/site.tar.xz" && touch "$site/.unpacked"; }
  # the checkout's folders under the names lrkv imports them by (pyproject's package-dir)
  ln -sfn "$PWD/lrkv_core" "$pkgs/lrkv_core"
  ln -sfn "$PWD/kernels" "$pkgs/lrkv_kernels"
  ln -sfn "$PWD/demo" "$pkgs/lrkv_demo"
  ln -sfn "$PWD/tasks" "$pkgs/lrkv_tasks"
  ln -sfn "$PWD/flows" "$pkgs/lrkv_flows"
  export PYTHONPATH="$pkgs:$site:." PYTHONUNBUFFERED=1 LRKV_HOME=${LRKV_HOME:-/tmp/lrkv-home}
  "$PYTHON" -c "import torch, transformers, triton, prefect, mlflow; print('torch', torch.__version__, \
'transformers', transformers.__version__, 'triton', triton.__version__, 'device', \
torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')" | tee "$OUT/versions.txt"
}

kernel_tests() {
  environment
  set -o pipefail
  "$PYTHON" -m pytest -q -p no:cacheprovider ${TESTS:-tests/kernels/test_flash_absorbed.py \
    tests/kernels/test_flash_decode_packed.py tests/core/test_cuda.py} 2>&1 | tee "$OUT/pytest.log"
}

run() {
  local model=/tmp/${SHAPE:-smollm2}-random python=$PYTHON out=$OUT
  environment
  [ -d "$model" ] || "$python" benchmarks/random_model.py --shape "${SHAPE:-smollm2}" --out "$model"
  local contexts=${CONTEXTS:-65536} keys=${KEYS:-rotated,rebuilt} ratios=${RATIOS:-0.5} bits=${BITS-3}
  local name="bench-${contexts//,/_}-${keys//,/_}"
  set -o pipefail
  "$python" -c "from lrkv_flows.main import main; main()" bench --model "$model" --ratios "$ratios" \
    ${bits:+--bits "$bits"} --keys "$keys" --contexts "$contexts" --batch "${BATCH:-8}" --dtype bfloat16 \
    --static --compile --device "${DEVICE:-cuda}" --steps "${STEPS:-16}" --json-out "$out/$name.json" \
    2>&1 | tee "$out/$name.log"
}

OUT=${OUT:-bench-out}
PYTHON=${PYTHON:-python3}
case ${1:-} in
  pack) pack ;;
  run) run ;;
  test) kernel_tests ;;
  *) echo "usage: bash benchmarks/serving_gpu.sh pack|run|test" >&2; exit 2 ;;
esac
