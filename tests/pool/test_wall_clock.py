"""A remote lease lives on the monotonic clock (docs/pool.md, "Failure cases"): a step of the wall
clock (NTP, a VM resume) in either direction expires nothing early and extends nothing.  The daemon
runs in this process, so stepping ``time.time`` steps its wall clock (and the client's, alike)."""

from __future__ import annotations

import asyncio
import secrets
import time
from pathlib import Path
from typing import Any

import pytest

from daemon_helpers import running_daemon, unique_session
from waiting import wait_until

TOKEN = secrets.token_hex(32)


def call(d: Any, method: str, path: str, body: Any = None) -> Any:
    from gpusd.wire.http import request_json
    from gpusd.wire.signing import FleetKey

    return request_json(method, f"http://127.0.0.1:{d.port}/api/v1{path}", body, key=FleetKey(TOKEN),
                        node_id=d.node_id)


def step(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + seconds)


async def checks_pass(d: Any, n: int) -> None:
    """Wait until the pool's expiry check has run ``n`` more times (counted, not timed)."""
    start = d.pool.checks
    await wait_until(lambda: d.pool.checks >= start + n, 30, what=f"{n} expiry checks")


async def test_a_wall_clock_step_forward_expires_no_remote_lease(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    async with running_daemon(tmp_path, unique_session(), token=TOKEN, simulate="2xA100-80GB", tls=False,
                              leases=True) as d:
        r = await asyncio.to_thread(call, d, "POST", "/leases", {"count": 1, "holder": "x", "ttl": 30})
        assert r.status == 201, r.data
        step(monkeypatch, 3600)  # an hour forward: far past the TTL on the wall clock
        await checks_pass(d, 4)
        assert r.data["lease_id"] in d.pool.held
        r2 = await asyncio.to_thread(call, d, "POST", f"/leases/{r.data['lease_id']}/renew", {})
        assert r2.status == 200, r2.data
        # what is shown stays a wall time: the (stepped) clock plus what remains
        assert 0 < r2.data["expires"] - time.time() <= 30


async def test_a_wall_clock_step_back_extends_no_remote_lease(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    async with running_daemon(tmp_path, unique_session(), token=TOKEN, simulate="2xA100-80GB", tls=False,
                              leases=True) as d:
        r = await asyncio.to_thread(call, d, "POST", "/leases", {"count": 1, "holder": "x", "ttl": 2})
        assert r.status == 201, r.data
        step(monkeypatch, -3600)  # an hour back: the lease must still end 2 s after its grant
        await wait_until(lambda: r.data["lease_id"] not in d.pool.held, 30, what="the lease expired")
        r2 = await asyncio.to_thread(call, d, "POST", f"/leases/{r.data['lease_id']}/renew", {})
        assert r2.status == 404, r2.data


def test_a_wall_clock_step_forward_does_not_end_a_reservation_early(monkeypatch: pytest.MonkeyPatch) -> None:
    """The holder's side: ``--for`` (``until``) is kept on the monotonic clock by the renewing thread."""
    from types import SimpleNamespace

    from gpusd.pool.client import Reservation
    from gpusd.wire.signing import FleetKey
    from waiting import wait_until_sync

    res = Reservation([SimpleNamespace(ttl=1.5)], FleetKey(TOKEN))  # type: ignore[list-item]
    renewals: list[float] = []
    released: list[bool] = []
    monkeypatch.setattr(res, "renew", lambda ttl=None: renewals.append(1))
    monkeypatch.setattr(res, "release", lambda: released.append(True))
    try:
        res.start_renewing(until=time.time() + 600)
        step(monkeypatch, 3600)  # past `until` on the wall clock
        wait_until_sync(lambda: len(renewals) >= 2 or released, 30, what="two heartbeats")
        assert not released and len(renewals) >= 2
        left = res.left()
        assert left is not None and 0 < left <= 600
    finally:
        res._stop.set()
