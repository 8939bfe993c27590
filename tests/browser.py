"""A page opened in headless Chromium (Debian's `chromium`), as a person's browser shows it.

Why the DevTools protocol over `--remote-debugging-pipe`: `--dump-dom` shows the markup but
not whether an image decoded, and console lines on stderr (`--enable-logging`) are mixed
with Chromium's own logging. Over the pipe (fd 3 into the browser, fd 4 out of it, JSON
messages ended by a NUL byte) the page's console errors, uncaught exceptions and log
entries arrive as events, and the page itself is asked what it shows: each image's decoded
size and its size on the page, the headings. No port, no network, no client library.

`render` returns what a check needs; a test asserts on it. Chromium runs with a profile of
its own in a temporary directory and is ended (Browser.close, then killed) in every case.
"""
from __future__ import annotations

import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

TIMEOUT_S = 60.0
# what the page is asked once it has loaded
SHOWN = """JSON.stringify({
  images: Array.from(document.images).map(i => ({alt: i.alt, complete: i.complete, natural: i.naturalWidth,
                                                 shown: i.getBoundingClientRect().width})),
  headings: Array.from(document.querySelectorAll('h2')).map(h => h.innerText),
  text: document.body.innerText})"""
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
         "--no-default-browser-check", "--disable-extensions", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--remote-debugging-pipe"]


def chromium() -> str:
    """The browser's path, installed with apt first where this is root (as the Slurm tests
    install Slurm: `make test` alone works on a fresh machine), or a skip saying how to
    install it (a failure under CI=true)."""
    if shutil.which("chromium") is None and os.geteuid() == 0:
        subprocess.run([str(Path(__file__).resolve().parents[1] / "tools" / "install-chromium.sh")],
                       capture_output=True, timeout=900)
    path = shutil.which("chromium")
    if path is None:
        pytest.skip("chromium is not installed here: apt-get install chromium (tools/install-chromium.sh)")
    return path


@dataclass
class Shown:
    images: list[dict[str, Any]]  # alt, complete, natural (decoded width), shown (width on the page)
    headings: list[str]
    text: str
    errors: list[str] = field(default_factory=list)  # console errors, uncaught exceptions, error log entries


class _Pipe:
    """One DevTools connection: commands by id, events kept until asked for."""

    def __init__(self, to_browser: int, from_browser: int) -> None:
        self.out, self.inp, self.buf, self.events, self.next_id = to_browser, from_browser, b"", [], 0

    def _read(self, deadline: float) -> dict:
        while b"\0" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.inp], [], [], left)[0]:
                raise TimeoutError("chromium did not answer over the DevTools pipe")
            chunk = os.read(self.inp, 1 << 16)
            if not chunk:
                raise EOFError("chromium closed the DevTools pipe")
            self.buf += chunk
        message, self.buf = self.buf.split(b"\0", 1)
        return json.loads(message)

    def call(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self.out, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            reply = self._read(deadline)
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]
            self.events.append(reply)

    def wait_event(self, method: str) -> dict:
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            for i, event in enumerate(self.events):
                if event.get("method") == method:
                    return self.events.pop(i)
            self.events.append(self._read(deadline))


def _errors(events: list[dict]) -> list[str]:
    out = []
    for e in events:
        p = e.get("params", {})
        if e.get("method") == "Runtime.consoleAPICalled" and p["type"] in ("error", "assert"):
            out.append("console: " + " ".join(str(a.get("value", a.get("description", ""))) for a in p["args"]))
        elif e.get("method") == "Runtime.exceptionThrown":
            details = p["exceptionDetails"]
            out.append("exception: " + details.get("exception", {}).get("description", details["text"]))
        elif e.get("method") == "Log.entryAdded" and p["entry"]["level"] == "error":
            out.append(f"log ({p['entry']['source']}): {p['entry']['text']}")
    return out


def _above_4(fd: int) -> int:
    """`fd` moved to a number above 4, so that the shell's `3<&N 4>&M` never closes a pipe
    that already is at 3 or 4 when it closes N and M."""
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
    os.close(fd)
    return moved


def render(page: Path) -> Shown:
    """Open `page` (a file) in headless Chromium, wait for its load event, and return what it
    shows and every error it raised while loading."""
    binary = chromium()
    to_r, to_w = os.pipe()
    from_r, from_w = os.pipe()
    to_r, from_w = _above_4(to_r), _above_4(from_w)
    with tempfile.TemporaryDirectory(prefix="astraflow-chromium-") as profile:
        # the browser reads commands on fd 3 and writes on fd 4: the shell puts the pipes there
        stderr = Path(profile) / "stderr.log"  # a file: a pipe nobody reads would fill and stall it
        proc = subprocess.Popen(["bash", "-c", f'exec "$@" 3<&{to_r} 4>&{from_w} {to_r}<&- {from_w}>&-', "_",
                                 binary, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
                                pass_fds=(to_r, from_w), stdout=subprocess.DEVNULL, stderr=stderr.open("wb"))
        os.close(to_r)
        os.close(from_w)
        pipe = _Pipe(to_w, from_r)
        try:
            target = pipe.call("Target.createTarget", {"url": "about:blank"})["targetId"]
            session = pipe.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
            for domain in ("Runtime", "Log", "Page"):
                pipe.call(f"{domain}.enable", session=session)
            pipe.events.clear()  # what about:blank said is not the page's
            pipe.call("Page.navigate", {"url": page.resolve().as_uri()}, session=session)
            pipe.wait_event("Page.loadEventFired")
            result = pipe.call("Runtime.evaluate", {"expression": SHOWN, "returnByValue": True}, session=session)
            shown = Shown(**json.loads(result["result"]["value"]), errors=_errors(pipe.events))
            pipe.call("Browser.close")
        except (TimeoutError, EOFError) as e:
            proc.kill()
            raise AssertionError(f"{e}; chromium's stderr: {stderr.read_text(errors='replace')[-2000:]}") from None
        finally:
            os.close(to_w)
            os.close(from_r)
            if proc.poll() is None:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    return shown


def assert_shows_report(shown: Shown, sections: list[str]) -> None:
    """A report as a reader sees it: no errors, every section, every plot decoded and drawn."""
    assert shown.errors == [], shown.errors
    assert shown.headings == sections
    assert shown.images, "no plots"
    for image in shown.images:
        assert image["complete"] and image["natural"] > 0 and image["shown"] > 0, image
