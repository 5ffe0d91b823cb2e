"""Headless Chromium for the dashboard tests, driven over the DevTools protocol on a pipe.

* No download: the system's ``chromium`` (``apt-get install chromium``); tests skip without it.
* No network: ``--remote-debugging-pipe`` (no DevTools port), and where we may create network
  namespaces (root + ``ip``), the browser runs in a private namespace that has only ``lo``; the page
  server's socket is opened inside that namespace (:func:`socket_in_netns`).  Elsewhere the browser
  runs with every non-loopback request sent to a dead proxy and every DNS name unresolvable.
"""

from __future__ import annotations

import asyncio
import base64
import ctypes
import itertools
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import uuid
from pathlib import Path
from typing import Any

CLONE_NEWNET = 0x40000000


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


def can_netns() -> bool:
    return os.geteuid() == 0 and shutil.which("ip") is not None and Path("/proc/self/ns/net").exists()


class Netns:
    """A network namespace with only ``lo`` (up), deleted on close."""

    def __init__(self) -> None:
        self.name = f"gpusd-mon-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        subprocess.run(["ip", "netns", "add", self.name], check=True)
        subprocess.run(["ip", "netns", "exec", self.name, "ip", "link", "set", "lo", "up"], check=True)

    def close(self) -> None:
        subprocess.run(["ip", "netns", "delete", self.name], check=False)

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]


def socket_in_netns(netns: str | None, host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening TCP socket bound inside network namespace ``netns`` (None: this one).  The network
    namespace is per thread on Linux: a helper thread enters it, opens the socket and ends."""
    if netns is None:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
        s.listen(128)
        s.setblocking(False)
        return s
    out: dict[str, Any] = {}

    def enter() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            with open(f"/var/run/netns/{netns}") as f:
                if libc.setns(f.fileno(), CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns failed")
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
            s.listen(128)
            s.setblocking(False)
            out["sock"] = s
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            out["error"] = exc

    t = threading.Thread(target=enter)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["sock"]


class BrowserError(RuntimeError):
    pass


class Browser:
    """A headless Chromium; ``await Browser.start()``, then :meth:`page`."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self.errors: list[str] = []  # JavaScript exceptions and console errors of all pages
        self.console: list[str] = []
        self._proc: asyncio.subprocess.Process | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._profile = tempfile.mkdtemp(prefix="gpusd-chromium-")
        self._cmd_w = -1

    @classmethod
    async def start(cls, netns: str | None = None, width: int = 1280, height: int = 800) -> Browser:
        exe = chromium_path()
        if exe is None:
            raise BrowserError("chromium not installed")
        self = cls()
        cmd_r, self._cmd_w = os.pipe()
        resp_r, resp_w = os.pipe()
        flags = [
            "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe",
            f"--user-data-dir={self._profile}", f"--window-size={width},{height}", "--hide-scrollbars",
            "--no-first-run", "--no-default-browser-check", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--disable-extensions", "--disable-default-apps",
            "--disable-domain-reliability", "--disable-client-side-phishing-detection", "--disable-breakpad",
            "--metrics-recording-only", "--mute-audio", "--password-store=basic", "--use-mock-keychain",
            ("--disable-features=MediaRouter,DialMediaRouteProvider,OptimizationHints,Translate,"
             "AutofillServerCommunication,CertificateTransparencyComponentUpdater"),
        ]
        if netns is None:
            # Host network namespace: anything not on loopback goes to a dead proxy; no DNS at all.
            flags += ["--proxy-server=http://127.0.0.1:9", "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1"]
        # fds 3 and 4 are the DevTools pipe; bash puts them in place, then becomes chromium.
        trampoline = ["bash", "-c", f'exec 3<&{cmd_r} 4>&{resp_w} {cmd_r}<&- {resp_w}>&-; exec "$@"', "chromium",
                      exe, *flags, "about:blank"]
        prefix = ["ip", "netns", "exec", netns] if netns else []
        self._proc = await asyncio.create_subprocess_exec(
            *prefix, *trampoline, pass_fds=(cmd_r, resp_w), stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        os.close(cmd_r)
        os.close(resp_w)
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=64 * 2**20)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(resp_r, "rb", 0))
        self._reader_task = asyncio.create_task(self._read(reader))
        await self.send("Target.getTargets", timeout=30)
        return self

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                raw = await reader.readuntil(b"\0")
                msg = json.loads(raw[:-1])
                if "id" in msg:
                    fut = self._pending.pop(msg["id"], None)
                    if fut is not None and not fut.done():
                        if "error" in msg:
                            fut.set_exception(BrowserError(f"{msg['error'].get('message')}"))
                        else:
                            fut.set_result(msg.get("result", {}))
                    continue
                method, params = msg.get("method"), msg.get("params", {})
                if method == "Runtime.exceptionThrown":
                    d = params.get("exceptionDetails", {})
                    self.errors.append(d.get("exception", {}).get("description") or d.get("text", "?"))
                elif method == "Runtime.consoleAPICalled":
                    text = " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
                    self.console.append(f"{params.get('type')}: {text}")
                    if params.get("type") == "error":
                        self.errors.append(text)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(BrowserError("chromium exited"))

    async def send(self, method: str, params: dict[str, Any] | None = None, session: str | None = None,
                   timeout: float = 20) -> Any:
        i = next(self._ids)
        msg: dict[str, Any] = {"id": i, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[i] = fut
        data = json.dumps(msg).encode() + b"\0"
        while data:
            n = os.write(self._cmd_w, data)
            data = data[n:]
        return await asyncio.wait_for(fut, timeout)

    async def page(self, url: str, width: int = 1280, height: int = 800) -> Page:
        target = await self.send("Target.createTarget", {"url": "about:blank"})
        attached = await self.send("Target.attachToTarget", {"targetId": target["targetId"], "flatten": True})
        page = Page(self, attached["sessionId"])
        await page.call("Runtime.enable")
        await page.call("Page.enable")
        await page.call("Emulation.setDeviceMetricsOverride",
                        {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})
        await page.call("Page.navigate", {"url": url})
        return page

    async def close(self) -> None:
        try:
            if self._proc is not None and self._proc.returncode is None:
                try:
                    await self.send("Browser.close", timeout=5)
                except (BrowserError, asyncio.TimeoutError):
                    pass
                try:
                    await asyncio.wait_for(self._proc.wait(), 10)
                except asyncio.TimeoutError:
                    os.killpg(self._proc.pid, 9)
                    await self._proc.wait()
        finally:
            if self._reader_task is not None:
                self._reader_task.cancel()
            try:
                os.close(self._cmd_w)
            except OSError:
                pass
            shutil.rmtree(self._profile, ignore_errors=True)


class Page:
    def __init__(self, browser: Browser, session: str) -> None:
        self.browser = browser
        self.session = session

    async def call(self, method: str, params: dict[str, Any] | None = None) -> Any:
        return await self.browser.send(method, params, session=self.session)

    async def evaluate(self, expression: str) -> Any:
        r = await self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                 "awaitPromise": True})
        if "exceptionDetails" in r:
            raise BrowserError(r["exceptionDetails"].get("exception", {}).get("description", "JS error"))
        return r.get("result", {}).get("value")

    async def wait_for(self, expression: str, timeout: float = 10.0, interval: float = 0.1) -> Any:
        """Evaluate until the value is truthy; returns it (AssertionError with the last value)."""
        from waiting import wait_until

        async def value() -> Any:
            try:
                return await self.evaluate(expression)
            except BrowserError:
                return None

        return await wait_until(value, timeout, interval, what=repr(expression))

    async def screenshot(self, path: str | Path) -> None:
        r = await self.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": False})
        Path(path).write_bytes(base64.b64decode(r["data"]))
