"""llmchat against llama.cpp on this CPU, same weights, measured interleaved in one run.

    .venv/bin/python scripts/vs_llamacpp.py [--model GGUF] [--rounds 2] [--threads 2] [--json]
                                            [--widths Q4_0,Q8_0]

Builds llama.cpp's `llama-bench` and `llama-quantize` once from the source vendored in PyPI's
llama-cpp-python sdist (cmake, GGML_NATIVE=ON, into llmchat's cache dir; minutes on 2 cores),
requantizes the built-in GGUF (or --model's, any family llama.cpp reads) to F32 / BF16 / Q8_0 / Q4_0 so
both sides run the same weights, then
alternates `llama-bench -p 512 -n 64 -r 3` with `llmchat bench --prompt-lengths 512` for each
width and prints decode and prefill tok/s side by side with their ratio. llama-bench's decode
samples nothing: it is set against our decode step alone, with our chat's whole loop (sampling
with the panels' top-k and entropy, the token and cache events) on the line below. Not part of CI.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tarfile
from pathlib import Path

import platformdirs

SDIST = "llama-cpp-python"
SDIST_VERSION = "0.3.36"
# llama.cpp's type name, llmchat's precision with the same weight width.
WIDTHS = (("F32", "fp32"), ("BF16", "bf16"), ("Q8_0", "w8"), ("Q4_0", "w4"))
# w4 quantizes at load the way llama-quantize makes Q4_0 (tests/test_w4.py: byte for byte against
# gguf's quantizer), from the same dequantized file; its embedding table stays float (only looked up).
PROMPT, DECODE, REPEATS = 512, 64, 3
# Each of our figures and llama.cpp's for the same work: llama-bench's decode samples nothing,
# so it is set against our step alone, and our chat's loop (sampling, the panels' events) beside it.
FIGURES = (
    ("step_tok_s", "decode_tok_s"),
    ("decode_tok_s", "decode_tok_s"),
    ("prefill_tok_s", "prefill_tok_s"),
)
LABELS = {
    "step_tok_s": "decode, step alone",
    "decode_tok_s": "decode, chat loop",
    "prefill_tok_s": f"prefill {PROMPT}",
}


def cache_dir() -> Path:
    path = Path(platformdirs.user_cache_dir("llmchat")) / "llamacpp"
    path.mkdir(parents=True, exist_ok=True)
    return path


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def download_sdist(cache: Path) -> Path:
    """The sdist, fetched by pip itself, so the package index pip is configured with (a mirror, a
    proxy, credentials) is the one asked."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "-d",
            str(cache),
            f"{SDIST}=={SDIST_VERSION}",
        ],
        check=True,
    )
    return cache / f"{SDIST.replace('-', '_')}-{SDIST_VERSION}.tar.gz"


def source(cache: Path) -> Path:
    """llama.cpp's source as vendored in the sdist, downloaded and unpacked once."""
    tree = cache / f"{SDIST}-{SDIST_VERSION}"
    vendored = tree / "vendor" / "llama.cpp"
    if vendored.is_dir():
        return vendored
    archive = cache / f"{SDIST.replace('-', '_')}-{SDIST_VERSION}.tar.gz"
    if not archive.exists():
        say(f"downloading the {SDIST} {SDIST_VERSION} sdist (pip download)")
        archive = download_sdist(cache)
    with tarfile.open(archive) as tar:
        top = tar.getnames()[0].split("/")[0]
        tar.extractall(cache, filter="data")
    (cache / top).rename(tree)
    return vendored


def build(cache: Path) -> Path:
    """`llama-bench` and `llama-quantize` built natively for this CPU, once."""
    src = source(cache)
    out = cache / "build"
    binaries = out / "bin"
    if (binaries / "llama-bench").exists() and (binaries / "llama-quantize").exists():
        return binaries
    say("building llama.cpp (cmake, native flags; a few minutes on 2 cores, once)")
    flags = ["-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF"]
    subprocess.run(["cmake", "-S", str(src), "-B", str(out), "-G", "Ninja", *flags], check=True)
    subprocess.run(["cmake", "--build", str(out), "--target", "llama-bench", "llama-quantize"], check=True)
    return binaries


def builtin_gguf() -> Path:
    from engine import DEFAULT_MODEL
    from engine.models import resolve  # the same file the app loads

    return Path(resolve(DEFAULT_MODEL).location)


def requantized(binaries: Path, cache: Path, kind: str, model: Path) -> Path:
    """The GGUF `model` at `kind`, so llama.cpp runs the weights llmchat dequantizes."""
    name = "smollm2-135m" if model == builtin_gguf() else model.stem
    target = cache / f"{name}-{kind}.gguf"
    if not target.exists():
        say(f"requantizing {model.name} to {kind}")
        command = [
            str(binaries / "llama-quantize"),
            "--allow-requantize",
            str(model),
            str(target),
            kind,
        ]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return target


def llama_bench(binaries: Path, gguf: Path, threads: int) -> dict:
    command = [str(binaries / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-r", str(REPEATS)]
    done = subprocess.run([*command, "-p", str(PROMPT), "-n", str(DECODE), "-o", "json"], capture_output=True)
    if done.returncode >= 0:
        done.check_returncode()
        rows = json.loads(done.stdout)
        prefill = next(r for r in rows if r["n_prompt"] == PROMPT and r["n_gen"] == 0)
        decode = next(r for r in rows if r["n_gen"] == DECODE and r["n_prompt"] == 0)
        return {"prefill_tok_s": prefill["avg_ts"], "decode_tok_s": decode["avg_ts"]}
    # Seen on a 2-core Xeon VM that reports AMX: Q8_0's prefill through the weights ggml repacks
    # for AMX died (SIGILL in one run, SIGSEGV in the next); its decode ran. Each is measured
    # as it runs.
    died = signal.Signals(-done.returncode).name
    say(f"llama-bench died of {died} on {gguf.name}: its prefill again with --repack 0")
    decode = [*command, "-p", "0", "-n", str(DECODE), "-o", "json"]
    prefill = [*command, "-p", str(PROMPT), "-n", "0", "--repack", "0", "-o", "json"]
    runs = (subprocess.run(c, capture_output=True, check=True) for c in (decode, prefill))
    decode, prefill = (json.loads(run.stdout) for run in runs)
    return {"prefill_tok_s": prefill[0]["avg_ts"], "decode_tok_s": decode[0]["avg_ts"]}


def llmchat_bench(precision: str, model: Path) -> dict:
    # --raw: the timed prompts are ids either way, and a base model (Gemma 3 270M) has no template.
    command = [sys.executable, "-m", "tui.cli", "bench", "-m", str(model), "--raw", "-p", precision]
    command += ["--prompt-lengths", str(PROMPT)]
    command += ["--decode-tokens", str(DECODE), "--repeats", str(REPEATS), "--turns", "1", "--json"]
    report = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
    result = report["results"][0]
    return {
        "prefill_tok_s": result["prefill"][0]["prefill_tok_s"],
        "decode_tok_s": result["decode"]["tok_s"],
        "step_tok_s": result["decode_step"]["tok_s"],
        "bound_tok_s": result["bandwidth_bound_tok_s"],
        "compiled": bool(result["compiled"].get("compiled")),
    }


def median_of(rounds: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (median reported)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    parser.add_argument("--model", type=Path, help="a GGUF file (default: the built-in SmolLM2)")
    names = ",".join(kind for kind, _ in WIDTHS)
    parser.add_argument("--widths", default=names, help=f"llama.cpp's types to compare, of {names}")
    args = parser.parse_args()
    wanted = args.widths.split(",")
    if unknown := set(wanted) - {kind for kind, _ in WIDTHS}:
        parser.error(f"--widths: not one of {names}: {','.join(sorted(unknown))}")
    widths = [(kind, precision) for kind, precision in WIDTHS if kind in wanted]
    model = args.model.resolve() if args.model else builtin_gguf()
    cache = cache_dir()
    binaries = build(cache)
    ggufs = {kind: requantized(binaries, cache, kind, model) for kind, _ in widths}
    theirs: dict[str, list[dict]] = {kind: [] for kind, _ in widths}
    ours: dict[str, list[dict]] = {precision: [] for _, precision in widths}
    for round_number in range(1, args.rounds + 1):
        for kind, precision in widths:
            say(f"round {round_number}: llama-bench {kind}, then llmchat bench {precision}")
            theirs[kind].append(llama_bench(binaries, ggufs[kind], args.threads))
            ours[precision].append(llmchat_bench(precision, model))
    rows = []
    for kind, precision in widths:
        row = {"llamacpp": kind, "llmchat": precision}
        for what, same_work in FIGURES:
            a, b = median_of(theirs[kind], same_work), median_of(ours[precision], what)
            row[what] = {"llamacpp": round(a, 1), "llmchat": round(b, 1), "ratio": round(b / a, 3)}
        row["bound_tok_s"] = round(median_of(ours[precision], "bound_tok_s"), 1)
        row["compiled"] = all(r["compiled"] for r in ours[precision])
        rows.append(row)
    if args.json:
        print(
            json.dumps(
                {"model": model.name, "threads": args.threads, "rounds": args.rounds, "rows": rows}, indent=2
            )
        )
        return
    rounds = f"median of {args.rounds} alternating rounds"
    print(f"{model.name}: {rounds}, {args.threads} threads, prompt {PROMPT} tokens")
    print(f"{'':34} {'llama.cpp':>10} {'llmchat':>10} {'ratio':>7} {'bound':>7}")
    for row in rows:
        for what, _ in FIGURES:
            figures = row[what]
            name = f"{LABELS[what]}, {row['llamacpp']} / {row['llmchat']}"
            bound = f"{row['bound_tok_s']:7.1f}" if what == "step_tok_s" else ""
            llama, mine, ratio = figures["llamacpp"], figures["llmchat"], figures["ratio"]
            print(f"{name:34} {llama:10.1f} {mine:10.1f} {ratio:6.2f}x {bound}")


if __name__ == "__main__":
    main()
