"""`llmchat web` in a real browser: Debian's Chromium, headless, driven over its DevTools protocol.

The test serves the app (the tiny model) with `llmchat web`, opens the page, types a question
into the terminal in the page, and reads what the app sent to the browser: the panels, and the
answer's summary line. The page draws on a canvas, so the text is read from the app's output as
it reaches the page (a WebSocket wrapped before the page's own script runs). A screenshot is kept
beside the test's files. Skipped where Chromium is not installed (CI installs it: .ci/run).
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from engine.saved.store import Store

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium package is not installed"),
]

QUESTION = "What is the capital of France?"
CAPTURE = """
window.__llmchat = [];
const keep = (data) => {
  if (typeof data === "string") window.__llmchat.push(data);
  else if (data instanceof ArrayBuffer) window.__llmchat.push(new TextDecoder().decode(data));
  else if (data instanceof Blob) data.arrayBuffer().then((bytes) => keep(bytes));
};
window.WebSocket = class extends window.WebSocket {
  constructor(url, protocols) {
    super(url, protocols);
    this.addEventListener("message", (event) => keep(event.data));
  }
};
"""
"""Keeps every frame the app sends to the page, as text (the page's own script still gets them)."""


def served_log(tmp_path: Path) -> str:
    return (tmp_path / "web.log").read_text(errors="replace")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_url(url: str, timeout: float, process: subprocess.Popen) -> bytes:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return response.read()
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{url} never answered (exit status {process.poll()})") from None
            time.sleep(0.2)


NAVIGATING = ("navigated or closed", "Cannot find context")
"""Chrome's answers to an evaluation asked while the page navigates."""


class DevTools:
    """Just enough of Chrome's DevTools protocol: a command and its result, events skipped."""

    def __init__(self, socket: aiohttp.ClientWebSocketResponse) -> None:
        self.socket = socket
        self.ids = itertools.count(1)

    async def __call__(self, method: str, **params) -> dict:
        number = next(self.ids)
        await self.socket.send_json({"id": number, "method": method, "params": params})
        while True:
            message = json.loads((await self.socket.receive()).data)
            if message.get("id") == number:
                if "error" in message:
                    raise AssertionError(f"{method}: {message['error']}")
                return message.get("result", {})

    async def evaluate(self, expression: str):
        result = await self("Runtime.evaluate", expression=expression, returnByValue=True)
        return result.get("result", {}).get("value")

    async def seen(self) -> str:
        """What the page's terminal has written so far; "" while the start button's navigation is
        under way (asked mid-navigation, Chrome answers "Inspected target navigated or closed":
        seen once in CI, on a busy machine, when the click took longer than the 1 s sleep)."""
        try:
            return await self.evaluate("window.__llmchat ? window.__llmchat.join('') : ''") or ""
        except AssertionError as e:
            if any(word in str(e) for word in NAVIGATING):
                return ""
            raise

    async def wait_to_see(self, *texts: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            seen = await self.seen()
            if all(text in seen for text in texts):
                return seen
            if time.monotonic() > deadline:
                missing = [t for t in texts if t not in seen]
                raise AssertionError(f"the page never showed {missing}; it showed …{seen[-3000:]!r}")
            await asyncio.sleep(0.25)


@pytest.fixture
def served(tmp_path, tiny_model_dir):
    """`llmchat web` serving the tiny model; each tab's data directory lands in tmp_path."""
    port = free_port()
    env = os.environ | {"TMPDIR": str(tmp_path), "LLMCHAT_COMPILE": "0"}
    app_flags = ["--model", str(tiny_model_dir), "--device", "cpu", "-t", "0", "-n", "8", "--no-compile"]
    server = subprocess.Popen(
        [sys.executable, "-m", "tui.cli", "web", "--port", str(port), *app_flags],
        env=env,
        stdout=(tmp_path / "web.log").open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        page = wait_for_url(f"http://127.0.0.1:{port}/", timeout=60, process=server)
        assert b"textual-terminal" in page
        yield f"http://127.0.0.1:{port}/"
    finally:
        os.killpg(server.pid, 15)  # the server and every tab's app
        server.wait(timeout=30)


@pytest.fixture
def chromium(tmp_path):
    port = free_port()
    browser = subprocess.Popen(
        [
            CHROMIUM,
            *("--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--window-size=1400,900"),
            f"--remote-debugging-port={port}",
            f"--user-data-dir={tmp_path / 'chromium'}",
            "about:blank",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        listing = json.loads(wait_for_url(f"http://127.0.0.1:{port}/json/list", timeout=60, process=browser))
        yield next(t["webSocketDebuggerUrl"] for t in listing if t["type"] == "page")
    finally:
        os.killpg(browser.pid, 15)
        browser.wait(timeout=30)


def test_a_student_asks_in_the_browser_and_sees_the_answer_and_the_panels(served, chromium, tmp_path):
    async def scenario() -> None:
        async with aiohttp.ClientSession() as http, http.ws_connect(chromium, max_msg_size=0) as socket:
            page = DevTools(socket)
            await page("Page.enable")
            await page("Page.addScriptToEvaluateOnNewDocument", source=CAPTURE)
            await page("Page.navigate", url=served)
            await asyncio.sleep(1.0)
            await page.evaluate(
                "document.querySelector('#start') && document.querySelector('#start').click()"
            )
            await page.wait_to_see("Phase", "KV cache", "Top-k", " · fp32 · cpu", timeout=90)
            await page.evaluate("document.querySelector('.xterm-helper-textarea').focus()")
            await page("Input.insertText", text=QUESTION)
            for kind in ("keyDown", "keyUp"):
                await page(
                    "Input.dispatchKeyEvent",
                    type=kind,
                    key="Enter",
                    code="Enter",
                    windowsVirtualKeyCode=13,
                    **({"text": "\r"} if kind == "keyDown" else {}),
                )
            await page.wait_to_see(QUESTION, "TTFT", "stopped at max new tokens", timeout=90)  # -n 8
            shot = await page("Page.captureScreenshot", format="png")
            (tmp_path / "llmchat-web.png").write_bytes(base64.b64decode(shot["data"]))

    asyncio.run(scenario())
    assert (tmp_path / "llmchat-web.png").stat().st_size > 10_000  # a page drawn, not a blank one
    # The question went from the browser to the app, which saved the turn in the tab's own store
    # (a tab's app may start twice as the page loads: textual-serve ends the one left behind).
    asked = []
    for tab in Path(tmp_path).glob("llmchat-web-*"):
        with Store(tab) as store:
            for summary in store.list_conversations():
                asked += [m.content for m in store.messages(summary.id) if m.role == "user"]
    assert asked == [QUESTION], served_log(tmp_path)
