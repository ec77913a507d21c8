"""A full disk, and a writer killed mid-save: a one-line notice, the saved turns intact, no litter.

Real full disks are small tmpfs mounts (root only; skipped where mounting is not allowed);
one test fakes the full disk inside safetensors so that it runs anywhere.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from safetensors import SafetensorError
from typer.testing import CliRunner

from engine.events import Notice
from engine.sampling import SamplingSettings
from engine.saved import cache_file
from engine.saved.cache_file import load_cache, save_cache
from engine.saved.chat import SavedChat
from engine.saved.store import Store, StoreError
from engine.session import ChatSession

ROOT = Path(__file__).resolve().parents[2]
GREEDY = SamplingSettings(temperature=0.0, max_new_tokens=6)
ENOSPC_TEXT = "Error while serializing: I/O error: No space left on device (os error 28)"


@pytest.fixture
def small_disk():
    """mount(directory, size): a tmpfs of `size` at `directory`, unmounted after the test."""
    mounted = []

    def mount(directory: Path, size: str) -> Path:
        if os.geteuid() != 0 or shutil.which("mount") is None:
            pytest.skip("mounting a small tmpfs needs root")
        directory.mkdir(parents=True, exist_ok=True)
        command = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
        mounted.append(directory)
        return directory

    yield mount
    for directory in reversed(mounted):
        subprocess.run(["umount", "-l", str(directory)], check=False)


def fill(directory: Path) -> Path:
    """Take every free byte of the file system under `directory`; returns the filler file."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 1024)
    except OSError:
        pass
    finally:
        os.close(fd)
    return filler


def chat_with(loaded, store) -> SavedChat:
    chat = SavedChat(ChatSession(loaded, GREEDY), store)
    for _ in chat.send("What is the capital of France?"):
        pass
    return chat


# -- the KV cache file ----------------------------------------------------------------------------
def test_ask_when_the_disk_is_full_for_the_cache_says_so_in_one_line(
    tmp_path, monkeypatch, tiny_model_dir, small_disk
):
    from tui.cli import app

    data = tmp_path / "data"
    monkeypatch.setenv("LLMCHAT_DATA_DIR", str(data))
    caches = small_disk(data / "kv-caches", "4k")  # the store has room, the cache file does not
    result = CliRunner().invoke(app, ["ask", "-m", str(tiny_model_dir), "-t", "0", "-n", "6", "hello"])
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output and "SafetensorError" not in result.output
    notices = [line for line in result.output.splitlines() if "KV cache" in line]
    assert len(notices) == 1 and "the disk is full" in notices[0], result.output
    assert "saved as conversation 1" in result.output
    with Store(data) as store:
        assert [m.role for m in store.path(1)] == ["user", "assistant"]  # the turn stays saved
    assert list(caches.iterdir()) == []  # no half-written temporary file


def test_safetensors_failing_for_lack_of_space_is_a_notice_and_leaves_no_temp_file(
    tmp_path, monkeypatch, tiny_loaded
):
    def full_disk(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 1000)  # what was written before the disk filled up
        raise SafetensorError(ENOSPC_TEXT)

    monkeypatch.setattr(cache_file, "save_file", full_disk)
    with Store(tmp_path) as store:
        chat = chat_with(tiny_loaded, store)
        notice = chat.save_cache()
        assert isinstance(notice, Notice) and "\n" not in notice.message
        assert "the disk is full" in notice.message and "conversation" in notice.message
        assert list(store.cache_path(chat.conversation_id).parent.iterdir()) == []
        assert len(store.path(chat.conversation_id)) == 2


# -- the store ------------------------------------------------------------------------------------
def test_a_full_store_says_the_disk_is_full_and_works_again_once_there_is_room(
    tmp_path, tiny_loaded, small_disk
):
    data = small_disk(tmp_path / "data", "512k")
    with Store(data) as store:
        chat = chat_with(tiny_loaded, store)
        filler = fill(data)
        with pytest.raises(StoreError) as error:
            for i in range(100):
                store.add_message(chat.conversation_id, "user", f"question {i} " * 300)
        message = str(error.value)
        assert "disk is full" in message and "rollback" not in message, message
        # The chat says so too, and goes on.
        events = list(chat.send("And Germany? " * 20))  # fits the tiny context; the disk does not
        notices = [e.message for e in events if isinstance(e, Notice)]
        assert any(n.startswith("saving is off") and "disk is full" in n for n in notices), notices
        filler.unlink()
        store.add_message(chat.conversation_id, "user", "room again")
        assert [m.content for m in store.path(chat.conversation_id)][0] == "What is the capital of France?"
        assert store.path(chat.conversation_id)[-1].content == "room again"


# -- a writer killed mid-save ---------------------------------------------------------------------
KILLED_WRITER = textwrap.dedent(
    """
    import os, sys, time
    from engine import models
    from engine.sampling import SamplingSettings
    from engine.saved import cache_file
    from engine.session import ChatSession

    loaded = models.load(sys.argv[1], "fp32", "cpu")
    session = ChatSession(loaded, SamplingSettings(temperature=0.0, max_new_tokens=4))
    for _ in session.send("hello"):
        pass

    def killed_before_the_rename(source, destination):
        print("STAGED", source, flush=True)
        time.sleep(600)

    cache_file.os.replace = killed_before_the_rename
    cache_file.save_cache(session.cache, loaded, sys.argv[2])
    """
)


def killed_mid_save(tiny_model_dir, path: Path) -> Path:
    """Run a writer, kill -9 it after its temporary file is complete; that file's path."""
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER, str(tiny_model_dir), str(path)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        line = child.stdout.readline()
        assert line.startswith("STAGED"), line
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    staged = Path(line.split(maxsplit=1)[1].strip())
    assert staged.is_file() and staged.parent == path.parent
    return staged


@pytest.mark.parametrize("next_access", ["save", "load"])
def test_the_temporary_file_of_a_writer_killed_mid_save_is_removed(
    tmp_path, tiny_model_dir, tiny_loaded, next_access
):
    caches = tmp_path / "kv-caches"
    caches.mkdir()
    staged = killed_mid_save(tiny_model_dir, caches / "conversation-1.safetensors")
    # A writer that is still running keeps its file, however old: this test process is one.
    live = caches / f".conversation-2.safetensors.{os.getpid()}.tmp"
    live.write_bytes(b"being written")
    an_hour_ago = time.time() - 3600
    for path in (staged, live):
        os.utime(path, (an_hour_ago, an_hour_ago))
    if next_access == "save":
        session = ChatSession(tiny_loaded, GREEDY)
        for _ in session.send("hello"):
            pass
        save_cache(session.cache, tiny_loaded, caches / "conversation-3.safetensors")
    else:
        load_cache(caches / "conversation-1.safetensors", tiny_loaded)
    assert not staged.exists()
    assert live.exists()
