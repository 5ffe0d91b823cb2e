"""A paced event-stream reader (``GET /api/v1/events?pace=S``, docs/wire-format.md): readings alone at
most every S seconds, anything that changes hands at once.  What lets a hundred ``notify --fleet``
wait on a host without costing its daemon a write each per sample."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from test_daemon import Stream
from test_trust import SECRET, secret_file

from daemon_helpers import (  # noqa: F401
    LOOPBACK,
    FakeBackend,
    fast_mdns,
    make_snapshot,
    running_daemon,
    unique_session,
)
from gpusd.daemon import events
from gpusd.daemon.events import SETTLE, EventHub
from gpusd.errors import ConfigError
from gpusd.model import READINGS, GpuInfo, LeaseInfo, ProcessInfo, shape_of
from gpusd.notify.watch import PACE, SHAPE_PACE, pace_for
from gpusd.wire.signing import FleetKey
from gpusd.wire.sse import format_event
from waiting import wait_until


# -- what is a reading -------------------------------------------------------------------------------
def test_every_reading_is_a_gpu_field() -> None:
    assert READINGS <= {f.name for f in fields(GpuInfo)}


def test_readings_alone_keep_the_shape_anything_that_changes_hands_does_not() -> None:
    def shape_after(change: Any) -> Any:
        snap = make_snapshot(2, util=50.0, used=2**30)
        snap.gpus[0].leases = [LeaseInfo(lease_id="l1", pid=10, expires=100.0)]
        snap.gpus[0].processes = [ProcessInfo(pid=10, used_memory=2**30)]
        change(snap)
        return shape_of(snap.to_dict())

    base = shape_after(lambda s: None)

    def readings(s: Any) -> None:
        s.timestamp += 5
        for g in s.gpus:
            g.utilization_gpu, g.memory_used, g.memory_free, g.temperature = 60.0, 3 * 2**30, 77 * 2**30, 71
            g.power_draw = 250.0
        s.gpus[0].processes[0].used_memory = 5 * 2**30
        s.gpus[0].leases[0].expires = 200.0  # renewed

    assert shape_after(readings) == base
    changes = {
        "lease ended": lambda s: setattr(s.gpus[0], "leases", []),
        "process started": lambda s: s.gpus[1].processes.append(ProcessInfo(pid=11)),
        "unhealthy": lambda s: setattr(s.gpus[1], "healthy", False),
        "gpu gone": lambda s: s.gpus.pop(),
        # the free rule's utilisation threshold crossed: a GPU became free
        "free": lambda s: setattr(s.gpus[1], "utilization_gpu", 1.0),
    }
    for what, change in changes.items():
        assert shape_after(change) != base, what


# -- the hub, on a clock of the test's ----------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(events, "time", SimpleNamespace(monotonic=c.monotonic, time=time.time))
    return c


def queued(sub: events.Subscription) -> list[bytes | None]:
    out = []
    while not sub.queue.empty():
        out.append(sub.queue.get_nowait())
    return out


def sample(n: int) -> bytes:
    return format_event("snapshot", {"n": n})


def test_a_paced_reader_gets_readings_at_its_pace_the_newest_one(clock: Clock) -> None:
    hub = EventHub()
    full, paced = hub.subscribe(), hub.subscribe(pace=5.0)
    for n in range(12):  # a sample a second whose readings changed
        clock.now += 1
        hub.publish_raw(sample(n), minor=True)
    assert len(queued(full)) == 12
    # at 5 s and at 10 s after it subscribed: the newest each time; the rest held or outdated
    assert queued(paced) == [sample(4), sample(9)]
    assert paced.held == sample(11)


def test_a_change_of_hands_goes_at_once_after_what_was_held_then_every_sample_for_a_while(clock: Clock) -> None:
    hub = EventHub()
    paced = hub.subscribe(pace=30.0)
    clock.now += 1
    hub.publish_raw(sample(1), minor=True)
    assert queued(paced) == []
    clock.now += 1
    hub.publish_raw(sample(2))  # a lease ended
    assert queued(paced) == [sample(1), sample(2)]
    # the readings that lag it come as they are sampled, for SETTLE seconds
    clock.now += SETTLE / 2
    hub.publish_raw(sample(3), minor=True)
    assert queued(paced) == [sample(3)]
    clock.now += SETTLE
    hub.publish_raw(sample(4), minor=True)
    assert queued(paced) == []
    hub.publish("threshold", {"state": "exceeded"})  # any event that is not a sample: at once
    assert [m.split(b"\n")[0] for m in queued(paced) if m] == [b"event: snapshot", b"event: threshold"]


def test_heartbeats_reach_a_paced_reader_at_its_pace_or_its_held_readings_instead(clock: Clock) -> None:
    hub = EventHub()
    paced = hub.subscribe(pace=5.0)
    beat = format_event("heartbeat", {})
    for _ in range(2):  # a quiet hub beats every 2 s
        clock.now += 2
        hub._heartbeat(beat)
    assert queued(paced) == []
    clock.now += 2
    hub._heartbeat(beat)
    assert queued(paced) == [beat]  # a sign of life, 6 s after the last
    clock.now += 1
    hub.publish_raw(sample(1), minor=True)
    for _ in range(3):
        clock.now += 2
        hub._heartbeat(beat)
    assert queued(paced) == [sample(1)]  # the held readings are the sign of life


def test_a_reader_that_falls_behind_is_dropped_paced_or_not(clock: Clock) -> None:
    hub = EventHub(maxsize=2)
    paced = hub.subscribe(pace=2.0)
    for n in range(3):
        clock.now += 1
        hub.publish_raw(sample(n))
    assert paced.dropped and len(hub) == 0


# -- a real daemon on 127.0.0.1 -----------------------------------------------------------------------
class Reader(Stream):
    """A stream that must not end while the test reads it."""

    async def next(self, timeout: float = 5.0) -> tuple[str, str]:
        got = await super().next(timeout)
        assert got is not None, "the stream ended"
        return got


async def test_a_daemon_paces_readings_but_not_a_process_that_starts(tmp_path: Path) -> None:
    backend = FakeBackend(make_snapshot(2, hostname="paced", util=50.0))
    async with running_daemon(tmp_path, unique_session(), "paced", backend=backend) as d:
        async with aiohttp.ClientSession() as session:
            full = Reader(await session.get(d.urls[0] + "/events"))
            paced = Reader(await session.get(d.urls[0] + "/events?pace=2"))
            slow = Reader(await session.get(d.urls[0] + "/events?pace=60"))
            for r in (full, paced, slow):
                assert (await r.next(10))[0] == "snapshot"
            started = time.monotonic()
            # readings change at every sample (0.1 s): the full reader hears each
            samples = 0
            for g in backend.snap.gpus:
                g.utilization_gpu = 51.0
            while samples < 40:
                name, _ = await full.next(10)
                if name == "snapshot":
                    samples += 1
                    for g in backend.snap.gpus:
                        g.utilization_gpu = 51.0 + samples
            elapsed = time.monotonic() - started
            got = 0
            while True:
                try:
                    name, _ = await paced.next(0.3)
                except asyncio.TimeoutError:
                    break
                got += name == "snapshot"
            # at most one a pace (2 s) of what 40 samples changed, and it heard from the host
            assert 1 <= got <= elapsed / 2 + 2 < samples
            # a process starts: even the reader of pace 60 s hears it, long before its pace is up
            backend.snap.gpus[1].processes = [ProcessInfo(pid=4242, used_memory=2**30)]
            while True:
                name, data = await slow.next(30)
                if name == "snapshot" and json.loads(data)["gpus"][1]["processes"]:
                    break
            # a pace out of bounds: one line, no stream
            for bad in ("1", "61", "nan", "inf", "soon", ""):
                async with session.get(d.urls[0] + f"/events?pace={bad}") as r:
                    assert r.status == 400
                    assert (await r.json())["error"] == "pace must be a number of seconds from 2 to 60"
            assert sorted(s.pace or 0 for s in d.events._subs) == [0, 2.0, 60.0]


async def test_a_paced_client_signs_its_pace_and_is_verified(tmp_path: Path, fast_mdns: Any) -> None:  # noqa: F811
    from gpusd.discovery.client import AsyncClient

    session = unique_session("pace")
    async with running_daemon(tmp_path, session, "paced-ours", token=SECRET) as d:
        client = AsyncClient(session=session, interfaces=LOOPBACK, key=FleetKey(SECRET), pace=5)
        try:
            await client.wait_settled(8)
            (host,) = client.hosts
            assert host.verified is True  # the signature covers the query: the daemon accepted it
            assert [s.pace for s in d.events._subs if s.signed] == [5.0]
            # its hosts may be quiet for the pace and three heartbeats before they count as lost
            assert client.silence_timeout == 11.0 and client.liveness_timeout >= 15.0
        finally:
            await client.stop_listening()
    with pytest.raises(ConfigError, match="pace must be"):
        AsyncClient(pace=1)


def test_a_notifier_asks_for_readings_only_where_its_constraints_read_them() -> None:
    from gpusd.alloc.select import Constraints

    assert pace_for(Constraints.build(count=2)) == SHAPE_PACE
    assert pace_for(Constraints.build(count=2, max_processes=0, include="0,1", topology="nvlink")) == SHAPE_PACE
    for reads in ({"max_util": 10.0}, {"min_free": "8GiB"}, {"memory": "8GiB"}, {"shared": True}, {"mig": True}):
        assert pace_for(Constraints.build(count=1, **reads)) == PACE, reads


@pytest.mark.parametrize(("flags", "pace"), [(["--max-util", "10"], PACE), ([], SHAPE_PACE)])
async def test_notify_fleet_asks_each_host_for_its_pace(tmp_path: Path, fast_mdns: Any, flags: list[str],  # noqa: F811
                                                        pace: float) -> None:
    """``gpusd notify --fleet`` (the command, not only the library) follows hosts at the notifier's pace."""
    key = secret_file(tmp_path / "fleet.key")
    session = unique_session("pace-cli")
    # busy GPUs, one process each: the notifier keeps waiting
    backend = FakeBackend(make_snapshot(2, hostname="paced-cli", util=90.0))
    for i, g in enumerate(backend.snap.gpus):
        g.processes = [ProcessInfo(pid=5000 + i, used_memory=2**30)]
    async with running_daemon(tmp_path, session, "paced-cli", backend=backend, token=SECRET) as d:
        env = dict(os.environ, GPUSD_INTERFACES="127.0.0.1")
        env.pop("GPUSD_TOKEN", None)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gpusd", "notify", "--fleet", "-n", "1", "--max-processes", "0", *flags,
            "--exec", "true", "--timeout", "60", "--token-file", str(key), "--session", session,
            "--interface", "127.0.0.1", env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        try:
            await wait_until(lambda: [s.pace for s in d.events._subs if s.signed] == [pace], timeout=60,
                             what="a signed paced reader")
            assert proc.returncode is None  # still waiting: it never qualified
        finally:
            proc.terminate()
            await proc.wait()
