"""Debian's Chromium, headless, driven over the Chrome DevTools protocol with aiohttp's websocket client — no
selenium, no driver, no browser download.

    browser = await Chromium.start(tmp_path / "profile")
    page = await browser.new_page()
    await page.goto("http://127.0.0.1:18700/ui")
    await page.wait_js("the table", "document.querySelectorAll('#components tbody tr').length")
    await page.screenshot(tmp_path / "ui.png")
    await browser.close()

Every page records what it requested (`requests`) and every script error or console error (`errors`), so a test
can assert that nothing came from elsewhere and that the page's script never failed.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp

FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-default-apps", "--disable-extensions", "--mute-audio", "--hide-scrollbars",
)  # fmt: skip
"""--no-sandbox: the tests run as root, where Chromium's sandbox refuses to start; the page is our own."""
START_TIMEOUT_S = 30.0


def chromium_binary() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class CdpError(Exception):
    pass


class Page:
    """One tab: commands by id, events collected in the background."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._loaded = asyncio.Event()
        self.requests: list[str] = []
        self.errors: list[str] = []
        self._reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        async for msg in self.ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                continue
            data = json.loads(msg.data)
            if "id" in data:
                fut = self._pending.pop(data["id"], None)
                if fut is not None and not fut.done():
                    fut.set_result(data)
                continue
            method, params = data.get("method"), data.get("params", {})
            if method == "Page.loadEventFired":
                self._loaded.set()
            elif method == "Network.requestWillBeSent":
                self.requests.append(params["request"]["url"])
            elif method == "Runtime.exceptionThrown":
                details = params["exceptionDetails"]
                self.errors.append(details.get("exception", {}).get("description") or details.get("text", "?"))
            elif method == "Runtime.consoleAPICalled" and params.get("type") == "error":
                self.errors.append(" ".join(str(a.get("value", a.get("description"))) for a in params["args"]))
            elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
                entry = params["entry"]
                self.errors.append(f"{entry.get('source')}: {entry.get('text')} {entry.get('url', '')}".strip())
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(CdpError("the browser closed the connection"))

    async def send(self, method: str, timeout: float = 15.0, **params: Any) -> dict[str, Any]:
        msg_id = next(self._ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[msg_id] = fut
        await self.ws.send_str(json.dumps({"id": msg_id, "method": method, "params": params}))
        answer = await asyncio.wait_for(fut, timeout)
        if "error" in answer:
            raise CdpError(f"{method}: {answer['error']}")
        return answer.get("result", {})  # type: ignore[no-any-return]

    async def goto(self, url: str, width: int = 1400, height: int = 1000) -> None:
        for domain in ("Page", "Runtime", "Network", "Log"):
            await self.send(f"{domain}.enable")
        await self.send("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1,
                        mobile=False)  # fmt: skip
        self._loaded.clear()
        result = await self.send("Page.navigate", url=url)
        if result.get("errorText"):
            raise CdpError(f"navigating to {url}: {result['errorText']}")
        await asyncio.wait_for(self._loaded.wait(), 15)

    async def js(self, expression: str) -> Any:
        """The value of a JavaScript expression (JSON-serialisable), awaited if it is a promise."""
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise CdpError(f"{expression!r}: {details.get('exception', {}).get('description') or details['text']}")
        return result["result"].get("value")

    async def wait_js(self, what: str, expression: str, timeout: float = 15.0) -> Any:
        """Poll `expression` until it is truthy; the failure names `what` and the last value."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            last = await self.js(expression)
            if last:
                return last
            await asyncio.sleep(0.1)
        raise AssertionError(f"timed out after {timeout}s waiting in the browser for {what} (last: {last!r}); "
                             f"page errors: {self.errors}")  # fmt: skip

    async def screenshot(self, path: Path) -> Path:
        """The whole page (beyond the viewport) as PNG."""
        metrics = await self.send("Page.getLayoutMetrics")
        size = metrics["cssContentSize"]
        data = await self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True,
                               clip={"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1})
        path.write_bytes(base64.b64decode(data["data"]))
        return path

    async def close(self) -> None:
        await self.ws.close()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader


class Chromium:
    """The browser process (its own session, a fresh profile) and its DevTools endpoint."""

    def __init__(self, proc: subprocess.Popen[bytes], port: int, session: aiohttp.ClientSession) -> None:
        self.proc = proc
        self.port = port
        self.session = session
        self.pages: list[Page] = []

    @classmethod
    async def start(cls, profile: Path, log: Path | None = None) -> Chromium:
        binary = chromium_binary()
        if binary is None:
            raise FileNotFoundError("chromium is not installed (apt-get install chromium)")
        profile.mkdir(parents=True, exist_ok=True)
        log_file = open(log or profile.parent / "chromium.log", "ab")  # noqa: SIM115 - handed to the child
        proc = subprocess.Popen([binary, *FLAGS, f"--user-data-dir={profile}", "--remote-debugging-port=0",
                                 "about:blank"], stdout=log_file, stderr=log_file, start_new_session=True)  # fmt: skip
        log_file.close()
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise CdpError(f"chromium exited with {proc.returncode} (log: {log_file.name})")
            with contextlib.suppress(FileNotFoundError, ValueError, IndexError):
                port = int(port_file.read_text().splitlines()[0])
                return cls(proc, port, aiohttp.ClientSession())
            await asyncio.sleep(0.05)
        cls._kill(proc)
        raise CdpError(f"chromium wrote no DevToolsActivePort within {START_TIMEOUT_S}s (log: {log_file.name})")

    async def new_page(self) -> Page:
        async with self.session.put(f"http://127.0.0.1:{self.port}/json/new?about:blank") as r:
            target = await r.json()
        ws = await self.session.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0)
        page = Page(ws)
        self.pages.append(page)
        return page

    @staticmethod
    def _kill(proc: subprocess.Popen[bytes]) -> None:
        """SIGKILL what is left of the browser's own session (renderers, zygote, crash handler)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)

    async def close(self) -> None:
        for page in self.pages:
            with contextlib.suppress(Exception):
                await page.close()
        await self.session.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(self.proc.wait, 5)
        self._kill(self.proc)
