"""A first start's GGUF conversion: seconds to dequantize a GGUF into the cached HF directory,
in an empty cache each round (what a newcomer's first `make run` waits for before the model loads).

    PYTHONPATH=. .venv/bin/python scripts/convert_cost.py [--model PATH_OR_ALIAS] [--rounds 2]

Each round runs in a process of its own, as a first start does (imports included in the process,
not in the time). BENCHMARKS.md, "A first start's GGUF conversion".
"""

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ONE_ROUND = """
import sys, time
from pathlib import Path
from engine import models
gguf = Path(models.resolve(sys.argv[1]).location)
started = time.perf_counter()
models.convert_gguf(gguf, lambda *a: None)
print(f"{time.perf_counter() - started:.1f}")
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="a .gguf path or the built-in alias")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    for round_ in range(1, args.rounds + 1):
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "XDG_CACHE_HOME": cache, "PYTHONPATH": str(ROOT)}
            done = subprocess.run(
                [sys.executable, "-c", ONE_ROUND, args.model], env=env, capture_output=True, text=True
            )
        if done.returncode != 0:
            sys.exit(done.stderr.strip().splitlines()[-1])
        print(f"round {round_}: converted in {done.stdout.split()[-1]} s", flush=True)


if __name__ == "__main__":
    main()
