"""Issue 31: with a read-only `$XDG_CACHE_HOME`, `ask` on a GGUF said "cannot read GGUF" (after the
whole ~30 s read) when the problem was writing its converted copy. It says what failed, at once."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOBODY = 65534


def _as_a_user_the_folder_refuses() -> list[str]:
    """The command prefix that makes a chmod 555 folder read-only for the child: root writes anyway."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: no way to make a folder read-only")
    return [setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]


@pytest.fixture
def shared_dir():
    """A folder another user can use (pytest's tmp_path is private to this one)."""
    folder = Path(tempfile.mkdtemp(prefix="llmchat-ro-"))
    folder.chmod(0o777)
    yield folder
    for path in folder.rglob("*"):  # let this user remove what was made read-only
        if path.is_dir():
            path.chmod(0o755)
    shutil.rmtree(folder)


def test_a_read_only_cache_is_named_as_such_before_the_gguf_is_read(shared_dir):
    prefix = _as_a_user_the_folder_refuses()
    cache, writable = shared_dir / "cache", shared_dir / "home"
    cache.mkdir(mode=0o555)
    cache.chmod(0o555)
    writable.mkdir(mode=0o777)
    writable.chmod(0o777)
    gguf = shared_dir / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))  # never read: the cache is checked first
    gguf.chmod(0o644)
    env = {
        **os.environ,
        "HOME": str(writable),
        "XDG_CACHE_HOME": str(cache),
        "LLMCHAT_DATA_DIR": str(writable / "data"),
        "LLMCHAT_CONFIG_DIR": str(writable / "config"),
    }
    done = subprocess.run(
        [*prefix, sys.executable, "-m", "tui.cli", "ask", "--model", str(gguf), "-n", "2", "hi"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"cannot write the cache at {cache}" in lines[0], lines[0]
    assert "set XDG_CACHE_HOME to a writable folder" in lines[0]
    assert "cannot read GGUF" not in lines[0]
