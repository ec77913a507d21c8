#!/bin/sh
# The kernels' AVX2 code paths, tested on a CPU with AVX-512: the step's kernel built without
# AVX-512 (in a library of its own: the flags are part of its build key), then the tests that
# compare its products with torch's. CI's machine may have either; this checks the other.
#   scripts/test_avx2_kernels.sh [pytest args]
set -e
cd "$(dirname "$0")/.."
LLMCHAT_KERNEL_CFLAGS="-mno-avx512f" exec .venv/bin/python -m pytest -q -p no:cacheprovider \
    tests/test_matvec.py tests/test_w4.py tests/test_attention.py "$@"
