#!/usr/bin/env bash
# One prepared run on a lent GPU machine (see ../shared and the device tool's README):
# install the carried wheels, run the CUDA tests, then benchmark every precision.
# The default model's package is too large to carry, so speed is measured on its exact
# architecture with random weights (speed does not depend on the values).
#   carry: [".whl"]    command: bash scripts/gpu_check.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
timeout 240 python3 -m pytest -q tests/test_cuda.py 2>&1 | tee "$OUT/cuda_tests.txt"
timeout 300 python3 -m tui.cli bench --random-weights --device cuda -p bf16 -p fp16 -p int8 -p nf4 \
  --decode-tokens 256 --repeats 3 --long-context 4000 --json 2>&1 | tee "$OUT/bench.json"
