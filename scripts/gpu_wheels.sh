#!/usr/bin/env bash
# The wheels scripts/gpu_check.sh installs on a lent GPU machine, into .whl (git-ignored): the
# packages its image lacks (textual, bitsandbytes, gguf) and the versions this project is tested
# with where the image's are older (transformers and what it needs), all at this .venv's versions.
# bitsandbytes keeps only its CUDA 13 and CPU libraries: the whole wheel (43 MB) with the tree
# passes the 64 MiB a run may carry. The image runs Python 3.12 with torch 2.11 (CUDA 13.0).
set -euo pipefail
cd "$(dirname "$0")/.."
PACKAGES="textual bitsandbytes gguf transformers huggingface_hub platformdirs mdit-py-plugins
  linkify-it-py httpx2 httpcore2 truststore kernels tomlkit click rich markdown-it-py pygments"
rm -rf .whl && mkdir .whl
for name in $PACKAGES; do
  version=$(.venv/bin/python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "$name==$version"
done
zip -q -d .whl/bitsandbytes-*.whl 'bitsandbytes/libbitsandbytes_cuda11*' \
  'bitsandbytes/libbitsandbytes_cuda12*' 'bitsandbytes/libbitsandbytes_rocm*'
du -cb .whl/* | tail -n 1
