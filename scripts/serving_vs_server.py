"""Issue 36's targets on this machine: llama.cpp's own server (PyPI's xllamacpp, the built-in GGUF)
with 2 slots, measured by `bench --server`'s serving benchmark.

    PYTHONPATH=. .venv/bin/python scripts/serving_vs_server.py [--parallel 2] [--prompts 16]
        [--output-len 32] [--json FILE]

1. Agreement: one request at a time (nothing waits for a slot), our TTFT and TPOT against the
   server's own prompt time and time per token, as ratios (ours / the server's).
2. The rate sweep: where request throughput stops rising (saturation), and the curve.
Prints both and the machine's CPU share during the runs (a busy machine makes the ratios noise).
"""

import argparse
import json
import tempfile
from pathlib import Path

from engine.contention import ContentionMeter
from engine.remote.serving import ServingBench, ServingConfig, sweep
from engine.remote.target import RemoteTarget
from tests.remote.llama_server import LlamaServer

RATES = (0.5, 1.0, 2.0, 4.0, float("inf"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--json", help="write both results here")
    options = parser.parse_args()
    log = Path(tempfile.mkdtemp()) / "server.log"
    server = LlamaServer(log, n_ctx=2048 * options.parallel, parallel=options.parallel)
    try:
        where = RemoteTarget(server.url, None, None)
        meter = ContentionMeter()
        agreement = ServingBench(where).run(
            ServingConfig(
                where, num_prompts=options.prompts, output_len=options.output_len, max_concurrency=1
            )
        )
        swept = sweep(
            ServingConfig(where, num_prompts=options.prompts, output_len=options.output_len),
            "request_rate",
            RATES,
            report=print,
        )
        contention = meter.stop()
    finally:
        server.stop()
    own = agreement["server_reported"]
    print(f"server: llama.cpp, {options.parallel} slots, 1 thread; {contention.describe()}")
    print(
        f"agreement (one at a time): TTFT ours/server {own['ttft_ours_over_server']:.3f} "
        f"({agreement['mean_ttft_ms']:.1f} vs {own['mean_prompt_ms']:.1f} ms), "
        f"TPOT {own['tpot_ours_over_server']:.3f} "
        f"({agreement['mean_tpot_ms']:.2f} vs {own['mean_tpot_ms']:.2f} ms), "
        f"tokens {agreement['total_output_tokens']} vs {own['generation_tokens']:.0f}"
    )
    for value, run in zip(swept["sweep"]["values"], swept["sweep"]["results"]):
        print(
            f"rate {value}: {run['request_throughput']:.2f} req/s, {run['output_throughput']:.1f} tok/s, "
            f"TTFT median {run['median_ttft_ms']:.0f} ms p99 {run['p99_ttft_ms']:.0f}, "
            f"TPOT median {run['median_tpot_ms']:.1f} ms"
        )
    print(f"saturation: {swept['saturation']}")
    if options.json:
        Path(options.json).write_text(json.dumps({"agreement": agreement, "sweep": swept}, indent=2))


if __name__ == "__main__":
    main()
