"""Real `llmchat ask` processes for the reliability tests, with a tiny model that never stops by itself."""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

from tests.tiny import build_tiny_model

ROOT = Path(__file__).resolve().parents[2]


def build_endless_model(directory: Path) -> Path:
    """The tiny random Llama, changed so that greedy decoding never picks its end-of-turn token
    and its context never fills: a greedy answer goes on until it is stopped."""
    from safetensors.torch import load_file, save_file

    build_tiny_model(directory)
    weights_path, config_path = directory / "model.safetensors", directory / "config.json"
    config = json.loads(config_path.read_text())
    weights = load_file(weights_path)
    head = weights["lm_head.weight"]
    # Its logit is then the mean of two others', never above both (ties have measure zero).
    head[config["eos_token_id"]] = (head[0] + head[1]) / 2
    save_file(weights, weights_path, metadata={"format": "pt"})
    config["max_position_embeddings"] = 1_000_000
    config_path.write_text(json.dumps(config))
    return directory


def private_env(tmp_path: Path) -> dict[str, str]:
    """The environment for an llmchat process whose data and config live under tmp_path."""
    env = dict(os.environ)
    env.update(
        PYTHONPATH=str(ROOT),
        LLMCHAT_DATA_DIR=str(tmp_path / "data"),
        LLMCHAT_CONFIG_DIR=str(tmp_path / "config"),
        XDG_CONFIG_HOME=str(tmp_path / "xdg-config"),
        LLMCHAT_COMPILE="0",
    )
    for name in ("COLUMNS", "LINES"):  # set under pytest; the app would take them over the terminal's size
        env.pop(name, None)
    return env


def ask_command(model_dir: Path, *args: str) -> list[str]:
    """`llmchat ask ARGS` with the model, greedy, and no length limit of its own."""
    return [
        sys.executable, "-m", "tui.cli", "ask", *args, "--model", str(model_dir), "--device", "cpu",
        "--temperature", "0", "--max-new-tokens", "1000000",
    ]  # fmt: skip


def read_until_token(lines) -> list[str]:
    """Read JSON Lines until a `token` event with text (the answer is streaming); return what was read."""
    seen = []
    for line in lines:
        seen.append(line)
        event = json.loads(line) if line.lstrip().startswith("{") else {}
        if event.get("event") == "token" and event["text"]:
            return seen
    raise AssertionError("the answer never streamed:\n" + "".join(seen))


class Drain(threading.Thread):
    """Keeps reading a stream (a full pipe would block the writer); `join()` returns all it read."""

    def __init__(self, stream) -> None:
        super().__init__(daemon=True)
        self.stream, self.lines = stream, []
        self.start()

    def run(self) -> None:
        self.lines.extend(self.stream)

    def join(self, timeout: float | None = 60) -> list[str]:
        super().join(timeout)
        return self.lines
