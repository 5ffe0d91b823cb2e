"""The fair-use policy file on a daemon (issue 20, docs/allocation.md "The policy file"): idle
reservations warned and released on the policy's terms, and the fair-share order of waiters from the
usage history (the daemon's summary in its own state directory, read by every waiter)."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from pathlib import Path
from typing import Any

import pytest

from daemon_helpers import FakeBackend, running_daemon, unique_session

TOKEN = secrets.token_hex(32)


def policy(d: Path, body: dict[str, Any]) -> Path:
    p = d / "policy.json"
    p.write_text(json.dumps(body))
    p.chmod(0o644)
    return p


def simulated_idle() -> FakeBackend:
    """The simulated GPUs the daemon's pool leases from (the same UUIDs), all at 0 % utilisation."""
    from gpusd.inventory import open_backend

    with open_backend("2xA100-80GB") as b:
        snap = b.snapshot()
    for g in snap.gpus:
        g.utilization_gpu, g.processes = 0.0, []
    return FakeBackend(snap)


def call(method: str, url: str, body: Any = None) -> Any:
    from urllib.parse import urlsplit

    from gpusd.wire.http import fetch_json, request_json
    from gpusd.wire.signing import FleetKey

    parts = urlsplit(url)
    node = str(fetch_json(f"{parts.scheme}://{parts.netloc}/api/v1/host").data["node_id"])
    return request_json(method, url, body, key=FleetKey(TOKEN), node_id=node)


async def test_the_policy_file_warns_of_an_idle_reservation_and_releases_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpusd.daemon import recording

    monkeypatch.setattr(recording, "POLICY_EVERY", 0.1)
    monkeypatch.setenv("GPUSD_POLICY", str(policy(tmp_path, {"idle_warn_minutes": 0.02,
                                                             "idle_release_minutes": 0.02})))
    async with running_daemon(tmp_path, unique_session(), token=TOKEN, simulate="2xA100-80GB", tls=False,
                              leases=True, backend=simulated_idle()) as d:
        sub = d.events.subscribe()
        r = await asyncio.to_thread(call, "POST", f"http://127.0.0.1:{d.port}/api/v1/leases",
                                    {"count": 1, "holder": "x", "ttl": 600})
        assert r.status == 201, r.data
        lease_id = r.data["lease_id"]
        seen: list[str] = []
        deadline = time.monotonic() + 20
        while "lease_released" not in seen and time.monotonic() < deadline:
            try:
                msg = await asyncio.wait_for(sub.get(), 1)
            except asyncio.TimeoutError:
                continue
            if msg is not None and msg.startswith(b"event: lease_"):
                name = msg.decode().split("\n", 1)[0][7:]
                if lease_id.encode() in msg:
                    seen.append(name)
        d.events.unsubscribe(sub)
        assert [e for e in seen if e in ("lease_idle", "lease_release_notice", "lease_released")] == [
            "lease_idle", "lease_release_notice", "lease_released"], seen
        assert lease_id not in d.pool.held


async def test_the_daemon_writes_the_fair_share_summary_from_the_history(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpusd.alloc.leases import LeaseStore
    from gpusd.alloc.policy import read_shares
    from gpusd.daemon import recording

    monkeypatch.setattr(recording, "POLICY_EVERY", 0.1)
    monkeypatch.setattr(recording, "SHARES_EVERY", 0.3)
    monkeypatch.setenv("GPUSD_POLICY", str(policy(tmp_path, {"fair_share_days": 7})))
    async with running_daemon(tmp_path, unique_session(), token=TOKEN, simulate="2xA100-80GB", tls=False,
                              leases=True, record=True, backend=simulated_idle()) as d:
        r = await asyncio.to_thread(call, "POST", f"http://127.0.0.1:{d.port}/api/v1/leases",
                                    {"count": 2, "holder": "x", "ttl": 600})
        assert r.status == 201, r.data
        deadline = time.monotonic() + 20
        shares = None
        while time.monotonic() < deadline:
            shares = read_shares(d.state_dir)
            if shares and shares.get("fleet@127.0.0.1", 0) > 0:
                break
            await asyncio.sleep(0.2)
        assert shares and shares["fleet@127.0.0.1"] > 0, shares
        # only in the daemon's own state directory: nothing of the daemon's in the shared lock directory
        assert not (LeaseStore().dir / "fair-share.json").exists()


async def test_a_name_squatted_in_the_lock_directory_does_not_turn_fair_share_off(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A directory named fair-share.json in the world-writable lock directory (anyone can make one)
    once made every write of the summary fail: fair share fell back silently to first come, first
    served.  The summary lives in the daemon's state directory, which no one else can write."""
    from gpusd.alloc.leases import LeaseStore
    from gpusd.alloc.policy import read_shares
    from gpusd.daemon import recording

    monkeypatch.setattr(recording, "POLICY_EVERY", 0.1)
    monkeypatch.setattr(recording, "SHARES_EVERY", 0.3)
    monkeypatch.setenv("GPUSD_POLICY", str(policy(tmp_path, {"fair_share_days": 7})))
    store = LeaseStore()
    store.dir.mkdir(parents=True, exist_ok=True)
    (store.dir / "fair-share.json").mkdir()
    async with running_daemon(tmp_path, unique_session(), token=TOKEN, simulate="2xA100-80GB", tls=False,
                              leases=True, record=True, backend=simulated_idle()) as d:
        monkeypatch.setenv("GPUSD_STATE_DIR", str(d.state_dir))  # where waiters look (root's default elsewhere)
        r = await asyncio.to_thread(call, "POST", f"http://127.0.0.1:{d.port}/api/v1/leases",
                                    {"count": 1, "holder": "x", "ttl": 600})
        assert r.status == 201, r.data
        deadline = time.monotonic() + 20
        shares = None
        while time.monotonic() < deadline:
            shares = read_shares()
            if shares and shares.get("fleet@127.0.0.1", 0) > 0:
                break
            await asyncio.sleep(0.2)
        assert shares and shares["fleet@127.0.0.1"] > 0, shares


def test_fair_share_puts_the_user_with_fewer_gpu_hours_first_within_a_class(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpusd.alloc import queue
    from gpusd.alloc.leases import LeaseStore
    from gpusd.alloc.policy import write_shares

    store = LeaseStore()
    store.dir.mkdir(parents=True, exist_ok=True)
    store.dir.chmod(0o1777)
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    monkeypatch.setenv("GPUSD_STATE_DIR", str(state))
    tickets = [queue.enqueue(store, 1, "train", None, "alice"), queue.enqueue(store, 1, "train", None, "bob"),
               queue.enqueue(store, 1, "urgent", None, "carol", priority=2)]
    try:
        write_shares(state, {"alice": 40.0, "bob": 2.5, "carol": 100.0}, 7)
        # first come, first served without the policy (the shares file alone changes nothing)
        assert [w.user for w in queue.waiters(store)] == ["carol", "alice", "bob"]
        monkeypatch.setenv("GPUSD_POLICY", str(policy(tmp_path, {"fair_share_days": 7})))
        # with it: bob (2.5 GPU-hours) before alice (40); carol's higher class still first
        assert [w.user for w in queue.waiters(store)] == ["carol", "bob", "alice"]
        # a summary that is not root's is nobody's
        (state / "fair-share.json").chmod(0o666)
        assert [w.user for w in queue.waiters(store)] == ["carol", "alice", "bob"]
        # ... and so is one in a directory others can write (the shared lock directory, say)
        (state / "fair-share.json").chmod(0o644)
        assert [w.user for w in queue.waiters(store)] == ["carol", "bob", "alice"]
        state.chmod(0o1777)
        assert [w.user for w in queue.waiters(store)] == ["carol", "alice", "bob"]
    finally:
        for t in tickets:
            t.close()
