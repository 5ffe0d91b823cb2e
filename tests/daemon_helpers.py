"""Helpers for in-process daemon and discovery tests on 127.0.0.1 (no namespaces needed).

Every daemon and client here is bound to 127.0.0.1 only, and every test uses its own session, so
tests never see each other's hosts (nor anyone else's on this machine)."""

from __future__ import annotations

import copy
import os
import secrets
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

import pytest

from gpusd.model import GpuInfo, HostSnapshot

GiB = 2**30
LOOPBACK = ["127.0.0.1"]


def unique_session(tag: str = "t") -> str:
    return f"{tag}-{os.getpid()}-{secrets.token_hex(3)}"


def make_snapshot(n: int = 2, hostname: str = "h", node_id: str = "0", name: str = "NVIDIA A100-SXM4-80GB",
                  util: float = 0.0, used: int = 0) -> HostSnapshot:
    gpus = [GpuInfo(index=i, uuid=f"GPU-{hostname}-{i}", name=name, memory_total=80 * GiB, memory_used=used,
                    memory_free=80 * GiB - used, utilization_gpu=util, temperature=40, healthy=True)
            for i in range(n)]
    return HostSnapshot(hostname=hostname, node_id=node_id, timestamp=time.time(), gpus=gpus, backend="fake")


class FakeBackend:
    """A backend the test controls: edit ``snap`` (or set ``fail``) and the next sample shows it."""

    backend = "fake"

    def __init__(self, snap: HostSnapshot) -> None:
        self.snap = snap
        self.hostname = snap.hostname
        self.node_id = snap.node_id
        self.fail: BaseException | None = None
        self.closed = False

    def snapshot(self, util_since: Any = None, detail: bool = True) -> HostSnapshot:
        if self.fail is not None:
            raise self.fail
        s = copy.deepcopy(self.snap)
        s.timestamp = time.time()
        return s

    def close(self) -> None:
        self.closed = True

    def __enter__(self) -> "FakeBackend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def frozen(simulate: str) -> FakeBackend:
    """The simulated GPUs of ``simulate`` (the UUIDs ``allocate(simulate=...)`` sees), read once: the
    daemon's one backend serves them to its API, its pool and its lease socket alike, and a snapshot
    that does not change publishes no event."""
    from gpusd.inventory import open_backend

    with open_backend(simulate) as b:
        return FakeBackend(b.snapshot())


@pytest.fixture
def fast_mdns(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Shrink python-zeroconf's probe/announce intervals for this test (restored afterwards)."""
    from zeroconf import _core

    for name in ("_CHECK_TIME", "_REGISTER_TIME", "_UNREGISTER_TIME", "_PROBE_RANDOM_DELAY_INTERVAL"):
        monkeypatch.setattr(_core, name, getattr(_core, name))
    monkeypatch.setenv("GPUSD_MDNS_FAST", "1")
    monkeypatch.setenv("GPUSD_INTERFACES", "127.0.0.1")
    return _core


def daemon_config(tmp: Path, session: str, hostname: str, **kw: Any) -> Any:
    from gpusd.daemon.config import DaemonConfig

    args: dict[str, Any] = dict(interfaces=list(LOOPBACK), port=0, session=session, interval=0.1, heartbeat=0.3,
                                state_dir=tmp / f"state-{hostname}", hostname=hostname, txt_min_interval=0.5,
                                netwatch=0, leases=False)
    args.update(kw)
    return DaemonConfig(**args)


@asynccontextmanager
async def running_daemon(tmp: Path, session: str, hostname: str = "h1", n: int = 2,
                         backend: FakeBackend | None = None, **kw: Any) -> AsyncIterator[Any]:
    from gpusd.daemon.service import Daemon

    cfg = daemon_config(tmp, session, hostname, **kw)
    d = Daemon(cfg)
    if backend is None and cfg.simulate is not None:  # the simulated GPUs its pool and lease socket lease
        backend = frozen(cfg.simulate)
    d.backend = backend or FakeBackend(make_snapshot(n, hostname=hostname, node_id=d.node_id))
    await d.start()
    try:
        yield d
    finally:
        await d.stop()


from waiting import wait_until as wait_until  # noqa: E402  (the suite's one wait helper, re-exported)


def answer_garbage_once() -> tuple[Any, Any]:
    """A TCP server on 127.0.0.1 that answers one request with something that is not HTTP."""
    import socket
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    srv.settimeout(10)

    def answer() -> None:
        try:
            c, _ = srv.accept()
        except OSError:
            return
        with c:
            c.recv(4096)
            c.sendall(b"garbage\r\n\r\n")

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    return srv, t


def private_values(payload: Any) -> list[Any]:
    """Every user/command value inside processes and leases."""
    out: list[Any] = []
    if isinstance(payload, dict):
        for k, v in payload.items():
            if k in ("processes", "leases") and isinstance(v, list):
                out += [e.get(f) for e in v for f in ("user", "command")]
            else:
                out += private_values(v)
    elif isinstance(payload, list):
        for v in payload:
            out += private_values(v)
    return out
