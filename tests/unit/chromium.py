"""Headless Chromium driven over the DevTools protocol, for tests that check a page as a browser renders it.

    async with Browser.start() as b:          # None from find_chromium(): not installed
        await b.navigate("http://127.0.0.1:8000/dashboard")
        await b.wait_for("document.querySelector('#main') !== null")
        value = await b.eval("document.title")
        png = await b.screenshot()
    b.problems                                 # JS exceptions and console/CSP errors seen

Chromium is Debian's ``chromium`` package (``make install`` installs it); ``LMFLEET_CHROMIUM`` names another
binary. It runs with its own throw-away profile and a DevTools port on 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp


def find_chromium() -> str | None:
    env = os.environ.get("LMFLEET_CHROMIUM")
    if env:
        return env if Path(env).exists() else shutil.which(env)
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if path := shutil.which(name):
            return path
    return None


def _end_group(pgid: int, timeout_s: float = 5.0) -> None:
    """SIGKILL whatever is left of Chromium's process group and wait until none of it runs, so that no renderer
    keeps a core busy into the next test (zombies waiting for their reaper count as gone)."""
    import psutil

    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        running = []
        for q in psutil.process_iter(["status"]):
            try:
                if os.getpgid(q.pid) == pgid and q.info["status"] != psutil.STATUS_ZOMBIE:
                    running.append(q.pid)
            except (ProcessLookupError, PermissionError, OSError):
                continue
        if not running:
            return
        time.sleep(0.05)


class Browser:
    def __init__(self, proc: subprocess.Popen, profile: str, session: aiohttp.ClientSession,
                 ws: aiohttp.ClientWebSocketResponse):
        self.proc, self.profile, self.session, self.ws = proc, profile, session, ws
        self._ids = 0
        self._replies: dict[int, asyncio.Future] = {}
        self.problems: list[str] = []
        """JS exceptions, console errors and CSP violations, as one line each."""
        self._reader = asyncio.ensure_future(self._read())

    @classmethod
    @contextlib.asynccontextmanager
    async def start(cls, binary: str | None = None, width: int = 1280, height: int = 900, timeout_s: float = 30):
        binary = binary or find_chromium()
        if binary is None:
            raise FileNotFoundError("chromium not found")
        profile = tempfile.mkdtemp(prefix="lmfleet-chromium-")
        args = [binary, "--headless", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                "--no-default-browser-check", "--disable-extensions", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--mute-audio", "--hide-scrollbars",
                f"--user-data-dir={profile}", "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
                f"--window-size={width},{height}", "about:blank"]
        if os.geteuid() == 0:  # Chromium refuses to run as root with its sandbox
            args.insert(1, "--no-sandbox")
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        session = aiohttp.ClientSession()
        b = None
        try:
            port_file = Path(profile) / "DevToolsActivePort"
            deadline = time.monotonic() + timeout_s
            while not (port_file.exists() and port_file.read_text().strip()):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"chromium did not open its DevTools port (exit code {proc.poll()})")
                await asyncio.sleep(0.05)
            port = int(port_file.read_text().split()[0])
            async with session.get(f"http://127.0.0.1:{port}/json/list") as r:
                targets = await r.json()
            page = next(t for t in targets if t.get("type") == "page")
            ws = await session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)
            b = cls(proc, profile, session, ws)
            for domain in ("Page", "Runtime", "Log"):
                await b.call(f"{domain}.enable")
            yield b
        finally:
            if b is not None:
                b._reader.cancel()
                await b.ws.close()
            await session.close()
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
            _end_group(proc.pid)  # its renderer, GPU and utility processes (its own session: start_new_session)
            shutil.rmtree(profile, ignore_errors=True)

    async def _read(self) -> None:
        async for msg in self.ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                continue
            m = json.loads(msg.data)
            if "id" in m:
                fut = self._replies.pop(m["id"], None)
                if fut is not None and not fut.done():
                    fut.set_result(m)
            elif m.get("method") == "Runtime.exceptionThrown":
                d = m["params"]["exceptionDetails"]
                self.problems.append(f"exception: {d.get('exception', {}).get('description') or d.get('text')}")
            elif m.get("method") == "Log.entryAdded" and m["params"]["entry"]["level"] == "error":
                e = m["params"]["entry"]
                self.problems.append(f"{e.get('source')}: {e.get('text')}")
            elif m.get("method") == "Runtime.consoleAPICalled" and m["params"]["type"] == "error":
                self.problems.append(f"console: {[a.get('value') for a in m['params']['args']]}")

    async def call(self, method: str, timeout_s: float = 30, **params: Any) -> dict[str, Any]:
        self._ids += 1
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._replies[self._ids] = fut
        await self.ws.send_json({"id": self._ids, "method": method, "params": params})
        reply = await asyncio.wait_for(fut, timeout_s)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply["result"]

    async def eval(self, expression: str) -> Any:
        r = await self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression[:80]!r} threw: {r['exceptionDetails'].get('text')}")
        return r["result"].get("value")

    async def navigate(self, url: str) -> None:
        await self.call("Page.navigate", url=url)
        await self.wait_for("document.readyState === 'complete'")

    async def wait_for(self, expression: str, timeout_s: float = 20) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            value = await self.eval(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout_s:g} s for {expression!r}")
            await asyncio.sleep(0.1)

    async def screenshot(self) -> bytes:
        """The whole page (not only the viewport), as PNG."""
        m = await self.call("Page.getLayoutMetrics")
        size = m.get("cssContentSize") or m["contentSize"]
        clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
        r = await self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True, clip=clip)
        return base64.b64decode(r["data"])
