#!/usr/bin/env bash
# One prepared run on a lent GPU machine (see ../shared and the device tool's README):
# install the carried wheels, run the CUDA tests, then benchmark every precision.
# The default model's package is too large to carry, so speed is measured on its exact
# architecture with random weights (speed does not depend on the values), and on a 1B-class
# Llama's (TinyLlama-1.1B's shape), where the GPU's bandwidth rather than its launches bounds
# decode. Issue 15's target: >= 1,000 tok/s bf16 decode for the built-in model's shape.
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
timeout 180 python3 -m pytest -q tests/test_cuda.py 2>&1 | tee "$OUT/cuda_tests.txt"
timeout 240 python3 -m tui.cli bench --random-weights --device cuda -p bf16 -p fp16 -p int8 -p nf4 \
  --decode-tokens 256 --repeats 3 --long-context 4000 --json 2>&1 | tee "$OUT/bench.json"
mkdir -p /tmp/llama1b
cat > /tmp/llama1b/config.json <<'JSON'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
 "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
 "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 2048,
 "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": false}
JSON
timeout 150 python3 -m tui.cli bench --model /tmp/llama1b --random-weights --device cuda -p bf16 \
  --decode-tokens 256 --repeats 3 --json 2>&1 | tee "$OUT/bench_1b.json"
