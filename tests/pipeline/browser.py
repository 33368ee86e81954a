"""A real headless Chromium for page tests, driven over the DevTools protocol (a websocket, no driver).

    with Browser.start(tmp_path) as b:           # pytest.skip()s with the reason when no chromium
        b.open("file:///.../view.html", ready="document.body.dataset.ready === '1'")
        n = b.js("document.querySelectorAll('.episode-item').length")
        b.click("#episode-list .episode-item")
        b.screenshot(tmp_path / "view.png")

Debian's ``chromium`` package (``make setup`` installs it where it can; MEMPO_CHROMIUM names another
binary). Runs as root need --no-sandbox, which is fine for a local file under test.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest


def chromium_binary() -> str | None:
    named = os.environ.get("MEMPO_CHROMIUM")
    if named:
        return named
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


class Browser:
    def __init__(self, proc: subprocess.Popen, ws):
        self.proc, self.ws = proc, ws
        self._ids = itertools.count(1)

    @classmethod
    def start(cls, tmp: Path, timeout: float = 60.0) -> "Browser":
        binary = chromium_binary()
        if binary is None:
            pytest.skip("no chromium on this machine (apt-get install chromium; `make setup` tries it as root)")
        from websockets.sync.client import connect

        profile = tmp / "chromium-profile"
        profile.mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen([binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                                 "--disable-dev-shm-usage", "--window-size=1400,1000", "--remote-debugging-port=0",
                                 f"--user-data-dir={profile}", "about:blank"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while not (port_file.is_file() and port_file.read_text().strip()):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"{binary} did not start (exit {proc.poll()})")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
            pages = [t for t in json.loads(r.read()) if t["type"] == "page"]
        return cls(proc, connect(pages[0]["webSocketDebuggerUrl"], max_size=None, open_timeout=timeout))

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def call(self, method: str, **params) -> dict:
        """One DevTools command; its result (events in between are skipped)."""
        i = next(self._ids)
        self.ws.send(json.dumps({"id": i, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=120))
            if msg.get("id") == i:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    def js(self, expression: str):
        """The value of a JavaScript expression in the page (promises awaited); a thrown error raises."""
        out = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in out:
            raise AssertionError(f"page error in {expression!r}: {out['exceptionDetails']}")
        return out["result"].get("value")

    def open(self, url: str, ready: str, timeout: float = 60.0) -> None:
        """Navigate and wait until ``ready`` (a JS expression) is true."""
        self.call("Page.navigate", url=url)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.js(ready):
                    return
            except AssertionError:
                pass  # the new document is not there yet
            if time.monotonic() > deadline:
                raise AssertionError(f"{url}: not ready ({ready}) within {timeout:g}s")
            time.sleep(0.1)

    def click(self, selector: str) -> None:
        if not self.js(f"(() => {{ const e = document.querySelector({json.dumps(selector)}); if (!e) return false; "
                       f"e.click(); return true; }})()"):
            raise AssertionError(f"nothing matches {selector!r}")

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        try:
            self.ws.close()
        finally:
            self.proc.kill()
            self.proc.wait(timeout=30)
