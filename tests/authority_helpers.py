"""The daemon's lease authority in the test process (tests/alloc/test_lease_authority.py, tests/jobs/)."""

from __future__ import annotations

import asyncio
import threading


class ServerThread:
    """A LeaseServer on its own event loop in a thread of this process (the daemon's part)."""

    def __init__(self, simulate: str | None = None) -> None:
        from gpusd.alloc.authority import socket_path
        from gpusd.daemon.leasesock import LeaseServer

        self.loop = asyncio.new_event_loop()
        self.server = LeaseServer(socket_path(), simulate)  # simulate: a daemon serving simulated GPUs
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(30)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
