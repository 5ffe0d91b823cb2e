"""The daemon in-process on 127.0.0.1: HTTP API, event stream, TXT announcement and its rate limit,
resilience to NVML failures; and the ``gpusd start/stop/status`` process life cycle."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from daemon_helpers import (  # noqa: F401
    FakeBackend,
    answer_garbage_once,
    fast_mdns,
    make_snapshot,
    running_daemon,
    unique_session,
    wait_until,
)
from gpusd.daemon.events import EventHub
from gpusd.daemon.recent import RecentSamples
from gpusd.errors import BackendUnavailable
from gpusd.wire.sse import SSEParser
from gpusd.wire.txt import SERVICE_TYPE, decode_txt

pytestmark = pytest.mark.usefixtures("fast_mdns")


async def get_json(url: str) -> Any:
    async with aiohttp.ClientSession() as s, s.get(url, timeout=aiohttp.ClientTimeout(total=5)) as r:
        return r.status, await r.json()


class Stream:
    """An /api/v1/events reader for tests."""

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self.resp = resp
        self.parser = SSEParser()
        self.pending: list[tuple[str, str]] = []

    async def next(self, timeout: float = 5.0) -> tuple[str, str] | None:
        deadline = time.monotonic() + timeout
        while not self.pending:
            chunk = await asyncio.wait_for(self.resp.content.readany(), max(0.01, deadline - time.monotonic()))
            if not chunk:
                return None
            self.pending.extend(self.parser.feed(chunk))
        return self.pending.pop(0)


async def test_http_api(tmp_path: Path) -> None:
    async with running_daemon(tmp_path, unique_session(), "api-host", n=3) as d:
        base = d.urls[0]
        assert base.startswith("http://127.0.0.1:") and d.port > 0
        status, body = await get_json(base.replace("/api/v1", "/healthz"))
        assert status == 200 and body["ok"] is True
        status, host = await get_json(base + "/host")
        assert host["api"] == 1 and host["session"] == d.config.session and host["node_id"] == d.node_id
        assert len(host["snapshot"]["gpus"]) == 3 and host["snapshot"]["hostname"] == "api-host"
        status, gpus = await get_json(base + "/gpus")
        assert [g["index"] for g in gpus] == [0, 1, 2]
        await wait_until(lambda: len(d.recent.to_dict().get("GPU-api-host-0", {}).get("t", [])) >= 3)
        status, hist = await get_json(base + "/history?seconds=60")
        series = hist["gpus"]["GPU-api-host-0"]
        assert len(series["t"]) >= 3 and len(series["utilization_gpu"]) == len(series["t"])
        status, _ = await get_json(base + "/history?seconds=-1")
        assert status == 400


async def test_event_stream_snapshot_updates_heartbeat_bye(tmp_path: Path) -> None:
    backend = FakeBackend(make_snapshot(2, hostname="ev"))
    async with running_daemon(tmp_path, unique_session(), "ev", backend=backend) as d:
        session = aiohttp.ClientSession()
        try:
            resp = await session.get(d.urls[0] + "/events")
            assert resp.content_type == "text/event-stream"
            s = Stream(resp)
            name, data = await s.next()
            assert name == "snapshot" and json.loads(data)["node_id"] == d.node_id
            # nothing changes: heartbeats every ~0.3 s (the hub's: the first may come sooner), no snapshot
            name, data = await s.next()
            assert name == "heartbeat"
            t = time.monotonic()
            name, data = await s.next()
            assert name == "heartbeat" and 0.2 < time.monotonic() - t < 5.0  # cadence, not speed
            # a change: a snapshot within a sample or two
            backend.snap.gpus[1].memory_used = 7 * 2**30
            t = time.monotonic()
            while True:
                name, data = await s.next()
                if name == "snapshot":
                    break
            assert json.loads(data)["gpus"][1]["memory_used"] == 7 * 2**30
            assert time.monotonic() - t < 5.0  # a few samples, not a timeout
            d.publish("threshold", {"state": "exceeded", "gpu": 1})
            while (ev := await s.next())[0] == "heartbeat":
                pass
            assert ev[0] == "threshold"
            stop = asyncio.ensure_future(d.stop())
            rest = []
            while (ev := await s.next()) is not None:
                rest.append(ev[0])
            assert rest[-1] == "bye"
            await stop
        finally:
            await session.close()


async def test_heartbeats_encoded_once_for_all_readers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Twenty readers of a quiet daemon hear the same heartbeats, and each beat is encoded once, not
    once per reader: what a hundred waiting ``notify --fleet`` cost the daemon does not grow with them."""
    import gpusd.wire.sse as sse

    encoded = []
    real = sse.dumps

    def counting(data: Any, **kw: Any) -> str:
        if isinstance(data, dict) and list(data) == ["ts"]:
            encoded.append(data["ts"])
        return real(data, **kw)

    monkeypatch.setattr(sse, "dumps", counting)
    async with running_daemon(tmp_path, unique_session(), "beats") as d:
        session = aiohttp.ClientSession()
        try:
            streams = [Stream(await session.get(d.urls[0] + "/events")) for _ in range(20)]
            for s in streams:
                assert (await s.next())[0] == "snapshot"
            encoded.clear()
            heard: list[list[str]] = []
            for s in streams:  # three heartbeats each
                got = []
                while len(got) < 3:
                    name, data = await s.next()
                    assert name == "heartbeat"
                    got.append(json.loads(data)["ts"])
                heard.append(got)
            # every reader heard the same beats (at most one later than the first's): one encoding each
            assert all(h[:2] == heard[0][:2] or h[:2] == heard[0][1:] for h in heard)
            assert 1 <= len(encoded) <= 5 and len(d.events) == 20  # 60 if each reader encoded its own
        finally:
            await session.close()


async def test_announcement_txt_and_rate_limit(tmp_path: Path) -> None:
    from zeroconf.asyncio import AsyncServiceInfo

    backend = FakeBackend(make_snapshot(4, hostname="txt", util=0.0))
    async with running_daemon(tmp_path, unique_session(), "txt", backend=backend, txt_min_interval=1.0) as d:
        assert d.announcer is not None and d.announcer.info is not None
        name = d.announcer.info.name
        assert name.startswith("txt-") and name.endswith(SERVICE_TYPE)

        async def txt() -> Any:
            info = AsyncServiceInfo(SERVICE_TYPE, name)
            assert await info.async_request(d.zc.zeroconf, 3000)
            return decode_txt(info.text)

        rec = await txt()
        assert rec.count == 4 and rec.free == 4 and rec.session == d.config.session and rec.node_id == d.node_id
        assert rec.inventory == [("A100-SXM4-80GB", 81920)] * 4
        # load flapping every sample: at most one TXT update per txt_min_interval
        t0 = time.monotonic()
        for i in range(15):
            for g in backend.snap.gpus:
                g.utilization_gpu = 50.0 if i % 2 == 0 else 0.0
            await asyncio.sleep(0.1)
        backend.snap.gpus[0].utilization_gpu = 90.0  # settles at 3 free
        for g in backend.snap.gpus[1:]:
            g.utilization_gpu = 0.0
        await wait_until(lambda: d.announcer.txt.get("free") == "3", timeout=3)
        elapsed = time.monotonic() - t0
        assert d.announcer.updates <= int(elapsed / 1.0) + 1
        # live load does not travel over mDNS: memory changes leave the TXT record alone
        before = d.announcer.updates
        backend.snap.gpus[1].memory_used = 2**30
        await asyncio.sleep(1.3)
        assert d.announcer.updates == before
        assert (await txt()).free == 3


async def test_nvml_failure_and_lost_gpu_keep_the_daemon_serving(tmp_path: Path) -> None:
    backend = FakeBackend(make_snapshot(2, hostname="flaky"))
    async with running_daemon(tmp_path, unique_session(), "flaky", backend=backend) as d:
        # the daemon reopens a failing backend: here it gets the test's one back (not whatever NVML
        # an earlier test left loaded in this process)
        reopened: list[bool] = []
        d._open_backend = lambda: reopened.append(True) or backend  # type: ignore[method-assign]
        backend.fail = BackendUnavailable("NVML cannot count GPUs: GPU is lost")
        await wait_until(lambda: d.snapshot is not None and bool(d.snapshot.gpus) and not d.snapshot.gpus[0].healthy)
        status, host = await get_json(d.urls[0] + "/host")
        assert status == 200 and "GPU is lost" in host["snapshot"]["gpus"][0]["error"]
        backend.fail = None
        backend.snap.gpus.pop()  # one GPU is gone for good
        # a failing backend is reopened at most every REOPEN_AFTER (5 s) seconds: wait past that
        await wait_until(lambda: d.snapshot is not None and len(d.snapshot.gpus) == 1 and d.snapshot.gpus[0].healthy,
                         timeout=20)
        assert d.samples >= 2 and d.sample_errors == 0 and reopened  # it did try to reopen the backend


async def test_fleet_view(tmp_path: Path) -> None:
    session = unique_session("fleet")
    async with running_daemon(tmp_path, session, "f1") as d1, running_daemon(tmp_path, session, "f2", n=1):
        status, body = await get_json(d1.urls[0] + "/fleet")
        assert status == 200
        assert sorted(h["hostname"] for h in body["hosts"]) == ["f1", "f2"]
        assert all(h["alive"] and h["snapshot"] for h in body["hosts"])
        from gpusd.wire.fleet import FLEET_SCHEMA, FleetView

        view = FleetView.from_dict(body)  # the answer is the typed fleet view, every host valid
        assert body["schema"] == FLEET_SCHEMA and view.skipped == 0 and view.session == session
        assert all(h.last_seen is not None and abs(h.last_seen - time.time()) < 60 for h in view.hosts)
        assert all(h.verified is None for h in view.hosts)  # no fleet secret here: nothing to verify
        async with aiohttp.ClientSession() as s:
            resp = await s.get(d1.urls[0] + "/fleet/events")
            st = Stream(resp)
            names = [(await st.next())[0] for _ in range(5)]
            assert names.count("host_added") == 2 and names.count("device_added") == 3
            resp.close()


async def test_fleet_off(tmp_path: Path) -> None:
    async with running_daemon(tmp_path, unique_session(), "nofleet", fleet="off") as d:
        status, body = await get_json(d.urls[0] + "/fleet")
        assert status == 404


def test_history_and_hub_bounds() -> None:
    h = RecentSamples(seconds=1.0, interval=0.5)
    s = make_snapshot(1)
    for i in range(10):
        s.timestamp = float(i)
        h.add(s)
    d = h.to_dict()
    assert d["GPU-h-0"]["t"] == [7.0, 8.0, 9.0]
    assert h.to_dict(seconds=1)["GPU-h-0"]["t"] == [8.0, 9.0]

    async def hub() -> None:
        hub = EventHub(maxsize=2)
        sub = hub.subscribe()
        for i in range(5):  # a subscriber that does not read is cut off, not buffered forever
            hub.publish("x", i)
        assert len(hub) == 0 and await sub.get() is None

    asyncio.run(hub())


async def test_hub_heartbeat_is_one_message_for_all_and_stops_with_the_last_reader() -> None:
    hub = EventHub()
    subs = [hub.subscribe(signed=True) for _ in range(50)]
    hub.keep_alive(0.05)
    hub.keep_alive(0.05)  # a second stream's call: still one timer
    first = [await asyncio.wait_for(s.get(), 5) for s in subs]
    assert first[0] is not None and first[0].startswith(b"event: heartbeat\n")
    assert all(m is first[0] for m in first)  # the same bytes to every reader: encoded once
    for s in subs:
        hub.unsubscribe(s)
    beats = hub.beats
    await asyncio.sleep(0.3)  # long enough for several periods: none beat without a reader
    assert hub.beats == beats
    late = hub.subscribe()
    hub.keep_alive(0.05)  # the next reader starts it again
    assert (await asyncio.wait_for(late.get(), 5) or b"").startswith(b"event: heartbeat\n")
    hub.close()
    rest = []
    while (m := await asyncio.wait_for(late.get(), 5)) is not None:
        rest.append(m)
    assert all(m.startswith(b"event: heartbeat\n") for m in rest)
    assert hub.beats == beats + 1 + len(rest)  # each beat one message, however many readers


# -- the process life cycle (subprocesses, 127.0.0.1 only) ------------------------------------------
def gpusd(*args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpusd", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def proc_env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(GPUSD_STATE_DIR=str(tmp_path / "state"), GPUSD_INTERFACES="127.0.0.1", GPUSD_MDNS_FAST="1")
    return env


def test_start_status_stop(proc_env: dict[str, str], tmp_path: Path) -> None:
    session = unique_session("proc")
    t = time.monotonic()
    r = gpusd("start", "--simulate", "2xA100-80GB", "--interface", "127.0.0.1", "--port", "0",
              "--session", session, "--hostname", "proc-host", env=proc_env)
    assert r.returncode == 0, r.stderr
    assert "started" in r.stdout and "SIMULATED" in r.stdout
    assert time.monotonic() - t < 15
    state = tmp_path / "state"
    pid = int((state / "gpusd.pid").read_text())
    try:
        r = gpusd("status", env=proc_env)
        assert r.returncode == 0 and f"pid {pid}" in r.stdout and "GPUs      2" in r.stdout, r.stdout
        info = json.loads(gpusd("status", "--json", env=proc_env).stdout)
        assert info["running"] and info["session"] == session and info["host"]["snapshot"]["simulated"]
        r = gpusd("start", "--simulate", "2xA100-80GB", env=proc_env)
        assert r.returncode == 0 and "already running" in r.stdout
        # it is announced: a scan on 127.0.0.1 sees it
        r = gpusd("scan", "--session", session, "--browse", "1.5", "--json", env=proc_env)
        assert [h["hostname"] for h in json.loads(r.stdout)] == ["proc-host"], r.stderr
        r = gpusd("list", "--session", session, "--json", env=proc_env)
        devices = json.loads(r.stdout)
        assert len(devices) == 2 and devices[0]["simulated"] and devices[0]["gpu"]["utilization_gpu"] is not None
    finally:
        r = gpusd("stop", env=proc_env)
    assert r.returncode == 0 and f"pid {pid}" in r.stdout
    assert not (state / "gpusd.pid").exists() and not (state / "gpusd.json").exists()
    assert (state / "gpusd.log").read_text().count("stopped") >= 1
    assert gpusd("stop", env=proc_env).returncode == 6
    assert gpusd("status", env=proc_env).returncode == 6


def test_start_without_nvml_fails_with_hint(proc_env: dict[str, str]) -> None:
    env = dict(proc_env, GPUSD_NVML_LIBRARY="/nonexistent/libnvidia-ml.so.1")
    r = gpusd("start", "--port", "0", env=env)
    assert r.returncode == 3, (r.stdout, r.stderr)
    assert "--simulate" in r.stderr and "log:" in r.stderr


def test_one_daemon_per_state_dir_and_busy_port(proc_env: dict[str, str]) -> None:
    r = gpusd("start", "--simulate", "1xT4", "--port", "0", "--session", unique_session(), env=proc_env)
    assert r.returncode == 0, r.stderr
    try:
        r = gpusd("start", "--foreground", "--simulate", "1xT4", "--port", "0", env=proc_env, timeout=30)
        assert r.returncode == 0 and "already running" in r.stdout  # the same options: as a background start
        r = gpusd("start", "--foreground", "--simulate", "2xT4", "--port", "0", env=proc_env, timeout=30)
        assert r.returncode == 7 and "already running" in r.stderr and "--simulate 2xT4" in r.stderr
        port = json.loads(gpusd("status", "--json", env=proc_env).stdout)["port"]
        # another daemon of its own (state, lock directory, socket: one lease authority per lock directory)
        other = dict(proc_env, GPUSD_STATE_DIR=proc_env["GPUSD_STATE_DIR"] + "-2",
                     GPUSD_LOCK_DIR=proc_env["GPUSD_LOCK_DIR"] + "-2", GPUSD_LEASE_SOCKET="off")
        r = gpusd("start", "--simulate", "1xT4", "--port", str(port), env=other)
        assert r.returncode == 1 and f"port {port}" in r.stderr, r.stderr
    finally:
        gpusd("stop", env=proc_env)


def test_cli_help_stays_light() -> None:
    code = ("import sys; from gpusd.cli import build_parser; build_parser().format_help(); "
            "print(sorted(m for m in ('zeroconf', 'aiohttp', 'rich') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert r.stdout.strip() == "[]", r.stdout + r.stderr


def test_a_bad_sample_window_is_named_by_its_flag() -> None:
    """``start --sample-window nan`` names the flag the user wrote (``--history`` is its deprecated
    spelling, and "history" is the usage history database: docs/cli.md, "Vocabulary")."""
    from gpusd.daemon.config import DaemonConfig
    from gpusd.errors import ConfigError

    with pytest.raises(ConfigError, match="^--sample-window must be between"):
        DaemonConfig(history=float("nan")).validate()


def test_bad_flags(proc_env: dict[str, str]) -> None:
    r = gpusd("start", "--session", "bad name!", "--simulate", "1xT4", env=proc_env)
    assert r.returncode == 2 and "session" in r.stderr
    r = gpusd("start", "--interface", "nosuchif0", "--simulate", "1xT4", "--port", "0", env=proc_env)
    assert r.returncode == 2 and "nosuchif0" in r.stderr, r.stderr
    r = gpusd("start", "--foreground", "--history", "nan", "--simulate", "1xT4", "--port", "0", env=proc_env)
    assert r.returncode == 2 and "--history" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = gpusd("watch", "--liveness", "0", "--duration", "1", env=proc_env)
    assert r.returncode == 2 and "--liveness" in r.stderr, r.stderr


@pytest.mark.parametrize("field, value", [("history", float("nan")), ("history", float("inf")),
                                          ("txt_min_interval", -1.0), ("txt_min_interval", float("nan"))])
def test_config_refuses_values_that_would_crash_the_daemon(field: str, value: float) -> None:
    from gpusd.daemon.config import DaemonConfig
    from gpusd.errors import ConfigError

    with pytest.raises(ConfigError):
        DaemonConfig(**{field: value}).validate()


def test_status_survives_damaged_state_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A running daemon (its pid file locked) with a damaged gpusd.json, or a port answered by
    something that is not HTTP: gpusd status reports, never a traceback."""
    from gpusd.cli import main
    from gpusd.cli.daemon import _fetch_host
    from gpusd.daemon import process

    state = tmp_path / "st"
    pid = process.PidFile(state)
    pid.acquire()
    try:
        for text in ("[1, 2]", '{"port": 1, "addresses": 5}', '{"port": "x", "addresses": ["127.0.0.1"]}'):
            (state / process.INFO_FILE).write_text(text)
            assert main(["status", "--state-dir", str(state)]) == 0
            assert f"pid {os.getpid()}" in capsys.readouterr().out
            assert main(["status", "--json", "--state-dir", str(state)]) == 0
            assert json.loads(capsys.readouterr().out)["running"] is True
    finally:
        pid.release()
    srv, t = answer_garbage_once()
    try:
        port = srv.getsockname()[1]
        assert _fetch_host({"port": port, "addresses": ["127.0.0.1"], "interfaces": ["127.0.0.1"]}) is None
    finally:
        t.join(10)
        srv.close()


def test_pid_file_lock_won_on_a_released_file_is_taken_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The old daemon unlinks gpusd.pid and lets go of its lock between the new daemon's open() and
    flock(): the new daemon must end up holding the file that is there, not the unlinked one."""
    import fcntl

    from gpusd.daemon import process

    old = process.PidFile(tmp_path)
    old.acquire()
    real_flock = fcntl.flock
    raced: list[int] = []

    def flock(fd: int, op: int) -> None:
        if not raced:
            raced.append(fd)
            old.release()
        real_flock(fd, op)

    monkeypatch.setattr(process.fcntl, "flock", flock)
    new = process.PidFile(tmp_path)
    new.acquire()
    monkeypatch.undo()
    try:
        assert raced
        st = process.status(tmp_path)
        assert st.running and st.pid == os.getpid()
    finally:
        new.release()


def test_demo_stops_the_daemons_it_started_when_one_fails(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from gpusd.cli import main
    from gpusd.daemon import process

    started: list[Any] = []

    class FakeProc:  # no daemon is really started
        def __init__(self, argv: list[str], **kw: Any) -> None:
            self.signals: list[int] = []
            started.append(self)

        def poll(self) -> int | None:
            return 1 if self.signals else None

        def send_signal(self, sig: int) -> None:
            self.signals.append(sig)

        def wait(self, timeout: float | None = None) -> int:
            return 1

        def kill(self) -> None:
            self.signals.append(9)

    monkeypatch.setattr(subprocess, "Popen", FakeProc)
    ready = iter(['{"pid": 1}', ""])  # the first daemon comes up, the second does not
    monkeypatch.setattr(process, "_read_line", lambda fd, timeout, proc: next(ready))
    assert main(["demo", "--once", "--hosts", "3"]) == 1
    assert "failed to start" in capsys.readouterr().err
    assert len(started) == 3 and all(p.signals for p in started)  # none left running


async def test_nvml_failure_fires_the_lost_rule_and_empties_the_free_count(tmp_path: Path) -> None:
    backend = FakeBackend(make_snapshot(2, hostname="lostrule"))
    async with running_daemon(tmp_path, unique_session(), "lostrule", backend=backend, thresholds=["lost"]) as d:
        assert d.announcer is not None and d.announcer.txt["free"] == "2"
        status, body = await get_json(d.urls[0] + "/alerts")
        assert status == 200 and body["alerts"] == []

        def reopen() -> Any:  # NVML stays broken (no other backend this process may have loaded)
            raise BackendUnavailable("NVML is still gone")

        d._open_backend = reopen  # type: ignore[method-assign]
        backend.fail = BackendUnavailable("NVML cannot count GPUs: GPU is lost")
        deadline = time.monotonic() + 10
        while True:
            _, body = await get_json(d.urls[0] + "/alerts")
            if len(body["alerts"]) == 2:
                break
            assert time.monotonic() < deadline, body
            await asyncio.sleep(0.05)
        assert {a["rule"] for a in body["alerts"]} == {"lost"}
        await wait_until(lambda: d.announcer.txt["free"] == "0")


async def test_fleet_view_is_not_started_again_while_the_daemon_stops(tmp_path: Path) -> None:
    async with running_daemon(tmp_path, unique_session(), "late") as d:
        assert d.fleet is not None and d.fleet.client is None
        await d.fleet.stop()
        await d.fleet.ensure_started(settle=0)  # a /fleet request arriving during Daemon.stop()
        assert d.fleet.client is None


async def test_txt_rate_limit_counts_from_the_update_not_from_its_lock() -> None:
    """A sample arriving after the rate-limit timer fired, but before the update ran, schedules the
    next update a full interval later (not at once)."""

    from gpusd.daemon.announce import Announcer
    from gpusd.daemon.config import DaemonConfig

    class FakeZc:
        def __init__(self) -> None:
            self.updates = 0

        async def _done(self) -> Any:
            fut = asyncio.get_running_loop().create_future()
            fut.set_result(None)
            return fut

        async def async_update_service(self, info: Any) -> Any:
            self.updates += 1
            return await self._done()

        async def async_unregister_service(self, info: Any) -> Any:
            return await self._done()

    from gpusd.identity import HostIdentity

    zc = FakeZc()
    a = Announcer(DaemonConfig(session="rl", txt_min_interval=10.0), HostIdentity(hostname="rl", node_id="abcd1234"),
                  zc, ["127.0.0.1"], 4780, pinned=True)  # type: ignore[arg-type]
    idle = make_snapshot(2, hostname="rl")
    a.txt = a._txt_for(idle)
    a.info = a._info(SERVICE_TYPE, f"{a.instance}.{SERVICE_TYPE}", 4780, a.txt)
    a._last_update = time.monotonic() - 100  # long ago: the first change may go out at once
    loop = asyncio.get_running_loop()
    try:
        a.on_sample(make_snapshot(2, hostname="rl", util=90.0))  # 0 free
        assert a._timer is not None
        a._timer.cancel()
        a._fire()  # the timer fires; the update is queued, not yet run
        one_busy = make_snapshot(2, hostname="rl")
        one_busy.gpus[0].utilization_gpu = 90.0  # 1 free: differs from the TXT about to go out
        a.on_sample(one_busy)
        assert a._timer is not None and a._timer.when() - loop.time() > 5.0
        await wait_until(lambda: zc.updates == 1)
    finally:
        await a.stop()


def test_demo_once_cleans_up(proc_env: dict[str, str]) -> None:
    import psutil

    p = subprocess.Popen([sys.executable, "-m", "gpusd", "demo", "--once"], env=proc_env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert "3 host(s), 10 GPU(s)" in out and "demo-1" in out and "demo-3" in out and "[sim]" in out
    session = f"demo-{p.pid}"
    left = [q.pid for q in psutil.process_iter(["cmdline"]) if session in " ".join(q.info["cmdline"] or [])]
    assert left == []


async def test_address_change_is_reannounced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With all interfaces in use, a changed address (DHCP, a new NIC) is announced again.  Here
    the daemon stays pinned to 127.0.0.1 and the address list it sees is faked."""
    from zeroconf.asyncio import AsyncServiceInfo

    from gpusd.daemon import announce

    async with running_daemon(tmp_path, unique_session(), "roam") as d:
        assert d.announcer is not None
        calls = []

        async def update_interfaces(*a: object, **kw: object) -> None:
            calls.append(a)

        monkeypatch.setattr(d.zc.zeroconf, "async_update_interfaces", update_interfaces)
        monkeypatch.setattr(announce, "local_ipv4_addresses", lambda: ["127.0.0.1", "127.0.0.77"])
        d.announcer.pinned = False
        task = asyncio.ensure_future(d.announcer.watch_network(0.05))
        try:
            await wait_until(lambda: "127.0.0.77" in d.announcer.addresses)
            assert calls
            info = AsyncServiceInfo(SERVICE_TYPE, d.announcer.info.name)
            await wait_until(lambda: info.load_from_cache(d.zc.zeroconf) and "127.0.0.77" in info.parsed_addresses())
        finally:
            task.cancel()


async def test_non_finite_readings_are_served_as_null(tmp_path: Path) -> None:
    """A backend reading NaN or Infinity (a broken sensor, a hostile scenario) never puts them in
    the JSON the daemon serves: strict JSON parsers (the dashboard's) would refuse the whole answer."""
    import json as _json

    snap = make_snapshot(2, hostname="nan-host")
    snap.gpus[0].utilization_gpu = float("nan")
    snap.gpus[1].power_draw = float("inf")
    async with running_daemon(tmp_path, unique_session(), "nan-host", backend=FakeBackend(snap)) as d:
        base = d.urls[0]
        await wait_until(lambda: len(d.recent.to_dict().get("GPU-nan-host-0", {}).get("t", [])) >= 2)
        async with aiohttp.ClientSession() as s:
            for path in ("/gpus", "/host", "/history"):
                async with s.get(base + path, timeout=aiohttp.ClientTimeout(total=5)) as r:
                    assert r.status == 200
                    text = await r.text()

                def refuse(c: str, path: str = path) -> None:
                    raise AssertionError(f"{path} carries {c}")

                _json.loads(text, parse_constant=refuse)
        status, gpus = await get_json(base + "/gpus")
        assert gpus[0]["utilization_gpu"] is None and gpus[1]["power_draw"] is None
