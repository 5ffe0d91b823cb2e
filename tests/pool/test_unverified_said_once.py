"""A pool command beside hosts that do not prove they hold the fleet secret says so once, with a
count (issue 18, item 16); it printed a `skipping ... did not prove it holds the fleet secret` line
per address and attempt (5 for one stranger reached at three addresses).  The strangers are static
peers on 127.0.0.1 answering as tests/stranger.py does, without a proof."""

from __future__ import annotations

import asyncio
import os
import secrets
import threading
from pathlib import Path

from aiohttp import web

import stranger
from conftest import gpusd_cli
from tests_paths import SRC


def _serve(n: int, log: Path) -> tuple[list[int], asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    ports: list[int] = []
    ready = threading.Event()

    async def start() -> None:
        for _ in range(n):
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", stranger.recorder(str(log)))
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            ports.append(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
        ready.set()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.create_task(start())
        loop.run_forever()

    threading.Thread(target=run, daemon=True).start()
    assert ready.wait(10)
    return ports, loop


def test_hosts_that_prove_nothing_are_named_once(tmp_path: Path) -> None:
    key = tmp_path / "fleet.key"
    key.write_text(secrets.token_hex(32))
    key.chmod(0o600)
    ports, loop = _serve(3, tmp_path / "requests.log")
    try:
        env = dict(os.environ, PYTHONPATH=str(SRC), GPUSD_INTERFACES="127.0.0.1", GPUSD_STATE_DIR=str(tmp_path))
        env.pop("GPUSD_TOKEN", None)
        peers = [w for p in ports for w in ("--peer", f"127.0.0.1:{p}")]
        r = gpusd_cli(["reservations", "--token-file", str(key), "--interface", "127.0.0.1", *peers], env=env,
                      timeout=60)
    finally:
        loop.call_soon_threadsafe(loop.stop)
    assert r.returncode == 0, r.stderr
    assert "skipping" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "prove" in ln]
    # one line (a daemon of this machine in the default session, without this secret, is counted too)
    assert len(lines) == 1 and lines[0].startswith("gpusd: left out "), r.stderr
    assert "host(s) that did not prove they hold the fleet secret: " in lines[0] and "evil" in lines[0], r.stderr
