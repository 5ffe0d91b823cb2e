"""The daemon's history endpoints, who sees what, the idle watch, and `gpusd report` over HTTP."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from daemon_helpers import fast_mdns  # noqa: F401  (a fixture)
from fake_signing import proof_headers
from gpusd.cli import main
from gpusd.daemon import access
from gpusd.daemon.config import DaemonConfig
from gpusd.daemon.service import Daemon
from gpusd.inventory.simulated import SimulatedBackend
from gpusd.model import GpuInfo, HostSnapshot, LeaseInfo, ProcessInfo
from gpusd.usage.idle import IdlePolicy, IdleWatch
from gpusd.wire.signing import FleetKey
from history_helpers import HOUR, SCENARIO, T0, Clock

TOKEN = "history-fleet-secret-0123"  # the fleet secret (at least 16 bytes)
INTERVAL = 10.0


def make_daemon(tmp: Path, hostname: str = "lab-node-1", **kw: Any) -> tuple[Daemon, SimulatedBackend, Clock]:
    cfg = DaemonConfig(interfaces=["127.0.0.1"], port=0, interval=INTERVAL, state_dir=tmp / hostname,
                       hostname=hostname, leases=False, token=TOKEN, **kw)
    clock = Clock()
    backend = SimulatedBackend(str(SCENARIO), host=hostname, node=hostname, clock=clock)
    return Daemon(cfg, backend), backend, clock


async def feed(d: Daemon, backend: SimulatedBackend, clock: Clock, hours: float, t0: float = T0) -> None:
    """The daemon's sampling path (``_accept``: history, events, on_sample callbacks) on simulated time."""
    for i in range(int(hours * HOUR / INTERVAL) + 1):
        clock.t = t0 + i * INTERVAL
        d._accept(backend.snapshot())
        if i % 400 == 0:
            await asyncio.sleep(0)
            assert d.recording.recorder is not None
            await asyncio.to_thread(d.recording.recorder.flush)
    assert d.recording.recorder is not None
    await asyncio.to_thread(d.recording.recorder.flush)


@pytest.fixture
async def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[Daemon, TestClient]]:
    """A daemon fed 6 simulated hours, read as a remote reader would (loopback not trusted)."""
    # not a local reader (a request signed for 127.0.0.1 still names the daemon: it comes from loopback)
    monkeypatch.setattr(access.Access, "local_reader", lambda self, remote: False)
    d, backend, clock = make_daemon(tmp_path)
    client = TestClient(TestServer(d.app, host="127.0.0.1"))
    await client.start_server()
    await feed(d, backend, clock, 6.0)
    yield d, client
    await client.close()


def q(**kw: Any) -> str:
    return "&".join(f"{k}={v}" for k, v in kw.items())


def signed(c: TestClient, path: str, secret: str = TOKEN) -> dict[str, str]:
    """The headers of a GET of ``path`` on the test server, signed with ``secret`` (RFC 9421)."""
    headers, _ = FleetKey(secret).sign_request("GET", str(c.make_url(path)))
    return headers


@pytest.fixture(autouse=True)
def _no_secret_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI reads the fleet secret from $GPUSD_TOKEN(_FILE) too: the tests say when there is one."""
    monkeypatch.delenv("GPUSD_TOKEN", raising=False)
    monkeypatch.delenv("GPUSD_TOKEN_FILE", raising=False)


PERIOD = {"from": T0, "to": T0 + 6 * HOUR + INTERVAL, "now": T0 + 6 * HOUR + INTERVAL}


async def test_usage_per_user_only_for_signed_readers(served):
    """Per-user figures go to readers whose request is signed with the fleet secret; everyone else
    (here a remote reader) gets the aggregates."""
    d, client = served
    r = await client.get("/api/v1/history/usage?" + q(**PERIOD))
    assert r.status == 200
    anon = await r.json()
    assert anon["private"] is False
    text = json.dumps(anon)
    for name in ("alice", "bob", "carol", "train.py"):
        assert name not in text  # no owner, no command anywhere
    assert {u["user"] for u in anon["users"]} == {None}
    # the aggregates are there for everyone
    used = sum(u["seconds"] for u in anon["users"] if u["kind"] == "use") / HOUR
    assert used == pytest.approx(5.0, abs=2 * INTERVAL / HOUR)
    assert len(anon["gpus"]) == 4 and anon["idle_reservations"][0]["user"] is None

    path = "/api/v1/history/usage?" + q(**PERIOD)
    r = await client.get(path, headers=signed(client, path))
    assert r.status == 200 and "Signature" in r.headers  # the daemon's proof comes back
    mine = await r.json()
    assert mine["private"] is True
    assert {u["user"] for u in mine["users"]} == {"alice", "bob", "carol"}
    assert mine["idle_reservations"][0]["user"] == "carol"

    # a signature made with another secret, or the secret itself as a bearer token: refused
    r = await client.get(path, headers=signed(client, path, secret="not-the-fleet-secret-4567"))
    assert r.status == 401 and "alice" not in await r.text()
    r = await client.get(path, headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status == 401 and "alice" not in await r.text()


async def test_series_endpoint_and_bad_queries(served):
    d, client = served
    r = await client.get("/api/v1/history/series?" + q(gpu=0, range="6h", now=T0 + 6 * HOUR))
    assert r.status == 200
    s = await r.json()
    assert s["index"] == 0 and len(s["t"]) > 100 and max(u for u in s["util"] if u is not None) == 80
    uuid = s["gpu"]
    r = await client.get("/api/v1/history/series?" + q(gpu=uuid, range="1h", now=T0 + HOUR))
    assert (await r.json())["gpu"] == uuid
    for bad in (q(gpu=0, range="forever"), q(gpu=0, range="9999d"), q(gpu="GPU-nope", range="1h"),
                q(gpu=0, range="1h", now="nan")):
        r = await client.get("/api/v1/history/series?" + bad)
        assert r.status in (400, 404), bad
        assert "error" in await r.json()
    r = await client.get("/api/v1/history/usage?" + q(**{"from": 10, "to": 5}))
    assert r.status == 400


async def test_report_over_http_one_host_and_the_fleet(tmp_path, served, capsys):
    """`gpusd report --url` asks one daemon; `--fleet` every daemon the fleet lists."""
    d1, c1 = served
    d2, b2, clock2 = make_daemon(tmp_path, "lab-node-2")
    c2 = TestClient(TestServer(d2.app, host="127.0.0.1"))
    await c2.start_server()
    await feed(d2, b2, clock2, 6.0)
    u1, u2 = (str(c.make_url("/")).rstrip("/") for c in (c1, c2))

    stranger_asked: list[str] = []

    async def stranger(request: web.Request) -> web.Response:
        stranger_asked.append(request.path)
        return web.json_response({"rows": [{"user": "mallory"}]})

    sapp = web.Application()
    sapp.router.add_get("/api/v1/history/usage", stranger)
    evil = TestClient(TestServer(sapp, host="127.0.0.1"))
    await evil.start_server()
    u3 = str(evil.make_url("/")).rstrip("/")

    async def fleet(request: web.Request) -> web.Response:
        # the entry daemon holds the secret, proves it, and says which hosts proved it to it
        body = json.dumps({"hosts": [
            {"hostname": h, "node_id": h, "url": u + "/api/v1", "alive": True, "verified": v} for h, u, v in
            (("lab-node-1", u1, True), ("lab-node-2", u2, True), ("evil", u3, False))]}).encode()
        return web.Response(body=body, content_type="application/json",
                            headers=proof_headers(request, TOKEN, body, "entry"))

    app = web.Application()
    app.router.add_get("/api/v1/fleet", fleet)
    entry = TestClient(TestServer(app, host="127.0.0.1"))
    await entry.start_server()
    period = ["--from", str(PERIOD["from"]), "--to", str(PERIOD["to"])]
    try:
        code = await asyncio.to_thread(main, ["report", "--url", u1, *period, "--by", "user"])
        out, err = capsys.readouterr()
        assert code == 1 and "private" in err and "--token-file" in err  # no secret, no per-user figures
        code = await asyncio.to_thread(main, ["report", "--url", u1, *period, "--by", "host", "--format", "json"])
        r = json.loads(capsys.readouterr()[0])
        assert code == 0 and r["rows"][0]["host"] == "lab-node-1" and r["top_jobs"][0]["user"] is None
        key_file = tmp_path / "fleet.key"
        key_file.touch(mode=0o600)
        key_file.write_text(TOKEN + "\n")
        code = await asyncio.to_thread(main, ["report", "--fleet", "--url", str(entry.make_url("/")), *period,
                                              "--token-file", str(key_file), "--format", "json"])
        out, err = capsys.readouterr()
        r = json.loads(out)
        assert code == 0 and r["hosts"] == ["lab-node-1", "lab-node-2"]
        assert stranger_asked == [] and "evil" in err and "unverified" in err  # never asked, named
        assert "mallory" not in out
        rows = {row["user"]: row for row in r["rows"]}
        assert rows["alice"]["gpu_hours_used"] == pytest.approx(4.0, abs=2 * INTERVAL / HOUR)
        assert rows["carol"]["idle_held_hours"] == pytest.approx(6.0, abs=2 * INTERVAL / HOUR)
        assert len(r["idle_reservations"]) == 2
        # an entry daemon that cannot prove it holds the secret: none of the hosts it lists is trusted
        other = tmp_path / "other.key"
        other.touch(mode=0o600)
        other.write_text("another-fleet-secret-0123456789\n")
        code = await asyncio.to_thread(main, ["report", "--fleet", "--url", str(entry.make_url("/")), *period,
                                              "--token-file", str(other), "--format", "json"])
        out, err = capsys.readouterr()
        assert code != 0 and stranger_asked == [] and "unverified" in err
    finally:
        await entry.close()
        await c2.close()
        await evil.close()


async def test_the_idle_reservation_raises_an_event_and_a_mark(served):
    d, client = served
    events = [(e, data) for e, data in _published(d) if e.startswith("lease_")]
    assert ("lease_idle", "carolres") in [(e, data["lease_id"]) for e, data in events]
    assert all(data["lease_id"] != "bobjob" for e, data in events if e == "lease_idle")
    # carol's reservation ended at hour 3: the mark went with it
    assert ("lease_active", "carolres") in [(e, data["lease_id"]) for e, data in events]
    r = await client.get("/api/v1/history/idle")
    assert (await r.json())["idle"] == []
    # and the history flags the lease as held idle (the report lists it whatever --idle-after says)
    from gpusd.usage.db import connect

    conn = connect(d.recording.path, readonly=True)
    flagged = dict(conn.execute("SELECT user, idle_flagged FROM jobs WHERE kind='lease'").fetchall())
    conn.close()
    assert flagged["carol"] is not None and flagged["bob"] is None


async def test_idle_answers_to_another_origin_are_public_only(tmp_path):
    """A web page of another origin, opened by someone on the daemon's own machine (a trusted
    loopback reader), must not read lease owners through CORS."""
    d, backend, clock = make_daemon(tmp_path)
    client = TestClient(TestServer(d.app, host="127.0.0.1"))
    await client.start_server()
    try:
        snap = backend.snapshot()
        snap.gpus[2].leases = [LeaseInfo(lease_id="r1", pid=9, user="carol", device=snap.gpus[2].uuid)]
        snap.gpus[2].utilization_gpu = 0.0
        d.recording.watch.update(snap)
        snap.timestamp += 2000
        d.recording.watch.update(snap)
        own = await (await client.get("/api/v1/history/idle")).json()
        assert own["idle"][0]["leases"][0]["user"] == "carol"  # loopback: this machine's reader
        r = await client.get("/api/v1/history/idle", headers={"Origin": "http://evil.example"})
        assert r.headers.get("Access-Control-Allow-Origin") == "*"
        other = await r.json()
        assert other["idle"][0]["gpus"] == own["idle"][0]["gpus"] and other["idle"][0]["leases"][0]["user"] is None
    finally:
        await client.close()


def _published(d: Daemon) -> list[tuple[str, dict[str, Any]]]:
    return getattr(d, "_test_events", [])


@pytest.fixture(autouse=True)
def _capture_events(monkeypatch: pytest.MonkeyPatch) -> None:
    orig = Daemon.publish

    def publish(self: Daemon, event: str, data: Any) -> None:
        self.__dict__.setdefault("_test_events", []).append((event, data))
        orig(self, event, data)

    monkeypatch.setattr(Daemon, "publish", publish)


async def test_idle_event_data_is_redacted_on_the_event_stream():
    """The lease's owner travels under "leases": the stream filter nulls it for readers without the fleet secret."""
    msgs: list[tuple[str, dict[str, Any]]] = []
    w = IdleWatch(IdlePolicy(idle_after=60), lambda e, data: msgs.append((e, data)))
    w.update(_snap(0, util=0.0, lease="alice"))
    w.update(_snap(61, util=0.0, lease="alice"))
    (event, data), = msgs
    from gpusd.wire.sse import format_event

    red = access.redact_event(format_event(event, data))
    assert b"alice" not in red and b"lease_idle" in red


# -- the idle watch and the release policy ----------------------------------------------------------


def _snap(t: float, util: float | None, lease: str | None = "carol", proc: bool = False) -> HostSnapshot:
    g = GpuInfo(index=0, uuid="GPU-0", utilization_gpu=util)
    if lease:
        g.leases = [LeaseInfo(lease_id="L1", pid=7, user=lease, device="GPU-0")]
    if proc:
        g.processes = [ProcessInfo(pid=7, user=lease)]
    return HostSnapshot(hostname="h", node_id="n", timestamp=T0 + t, gpus=[g])


class FakeReleaser:
    def __init__(self, ok: bool = True) -> None:
        self.ok = ok
        self.released: list[str] = []

    def release(self, lease: LeaseInfo, reason: str) -> bool:
        self.released.append(lease.lease_id)
        return self.ok


def drive(w: IdleWatch, until: float, step: float = 10, **kw: Any) -> None:
    t = 0.0
    while t <= until:
        w.update(_snap(t, **kw))
        t += step


def test_idle_policy_releases_an_idle_reservation_after_notice_and_grace():
    msgs: list[tuple[str, dict[str, Any]]] = []
    rel = FakeReleaser()
    w = IdleWatch(IdlePolicy(idle_after=900, release=True, grace=600), lambda e, d: msgs.append((e, d)), rel)
    drive(w, 890, util=1.0)
    assert msgs == [] and rel.released == []
    drive(w, 900, util=1.0)  # crosses idle_after
    names = [e for e, _ in msgs]
    assert names == ["lease_idle", "lease_release_notice"]
    notice = msgs[1][1]
    assert notice["release_at"] == pytest.approx(T0 + 900 + 600)
    drive(w, 1490, util=1.0)
    assert rel.released == []  # still in its grace period
    drive(w, 1500, util=1.0)
    assert rel.released == ["L1"] and msgs[-1][0] == "lease_released"


def test_idle_policy_never_releases_a_running_jobs_lease_and_is_opt_in():
    rel = FakeReleaser()
    msgs: list[str] = []
    w = IdleWatch(IdlePolicy(idle_after=60, release=True, grace=0), lambda e, d: msgs.append(e), rel)
    drive(w, 3600, util=0.0, proc=True)  # a job waiting on its data loader: idle GPU, but a process runs
    assert msgs == ["lease_idle"] and rel.released == []
    w2 = IdleWatch(IdlePolicy(idle_after=60, release=False), lambda e, d: msgs.append(e), rel)
    drive(w2, 3600, util=0.0)  # the policy is off: a mark, no release
    assert rel.released == []


def test_busy_again_clears_the_mark_and_restarts_the_clock():
    msgs: list[str] = []
    w = IdleWatch(IdlePolicy(idle_after=60, release=True, grace=100), lambda e, d: msgs.append(e), FakeReleaser())
    for t in range(0, 80, 10):
        w.update(_snap(t, util=0.0))
    w.update(_snap(80, util=50.0))
    assert msgs == ["lease_idle", "lease_release_notice", "lease_active"] and w.idle() == []
    for t in range(90, 140, 10):
        w.update(_snap(t, util=0.0))
    assert msgs[-1] == "lease_active"  # idle again only after another idle_after


def test_without_a_releaser_the_notice_says_so():
    msgs: list[tuple[str, dict[str, Any]]] = []
    w = IdleWatch(IdlePolicy(idle_after=60, release=True, grace=60), lambda e, d: msgs.append((e, d)))
    drive(w, 200, util=0.0)
    assert msgs[-1][0] == "lease_release_skipped" and "no releaser" in msgs[-1][1]["reason"]


async def test_a_daemon_without_history_says_so(tmp_path):
    d, _, _ = make_daemon(tmp_path, record=False)
    client = TestClient(TestServer(d.app, host="127.0.0.1"))
    await client.start_server()
    try:
        r = await client.get("/api/v1/history/usage")
        assert r.status == 404 and "no history" in (await r.json())["error"]
    finally:
        await client.close()


async def test_an_unwritable_database_leaves_the_daemon_sampling(tmp_path):
    (tmp_path / "lab-node-1").mkdir()
    (tmp_path / "lab-node-1" / "history.sqlite").write_bytes(b"this is not a database" * 100)
    d, backend, clock = make_daemon(tmp_path)
    client = TestClient(TestServer(d.app, host="127.0.0.1"))
    await client.start_server()
    try:
        d._accept(backend.snapshot())  # sampling goes on
        assert d.samples == 1 and d.recording.recorder is None
        r = await client.get("/api/v1/history/usage")
        assert r.status == 503 and "cannot be read" in (await r.json())["error"]
    finally:
        await client.close()


async def test_top_once_shows_each_gpus_last_hour_from_the_daemons_history(tmp_path, capsys):
    """`gpusd top` draws a sparkline per GPU from the daemon's history: sixteen slices of the last
    hour, all filled although top itself took one sample."""
    import time

    from gpusd.views.spark import BLOCKS

    d, backend, clock = make_daemon(tmp_path)
    client = TestClient(TestServer(d.app, host="127.0.0.1"))
    await client.start_server()
    now = time.time() // 10 * 10
    await feed(d, backend, clock, 1.0, t0=now - HOUR)
    url = str(client.make_url("/")).rstrip("/")
    assert d.snapshot is not None
    snap = d.snapshot.to_dict()

    async def fleet(request: web.Request) -> web.Response:
        return web.json_response({"hosts": [{"hostname": "lab-node-1", "node_id": "lab-node-1", "alive": True,
                                             "url": url + "/api/v1", "snapshot": snap}]})

    app = web.Application()
    app.router.add_get("/api/v1/fleet", fleet)
    entry = TestClient(TestServer(app, host="127.0.0.1"))
    await entry.start_server()
    try:
        code = await asyncio.to_thread(main, ["top", "--once", "--url", str(entry.make_url("/")), "--width", "200"])
        out = capsys.readouterr()[0]
        code6 = await asyncio.to_thread(main, ["top", "--once", "--url", str(entry.make_url("/")), "--width", "200",
                                               "--history", "6h"])
        out6 = capsys.readouterr()[0]
        def run_bad() -> int:  # a wrong --history is a usage error, raised by the parser (SystemExit)
            try:
                return main(["top", "--once", "--url", str(entry.make_url("/")), "--history", "1y"])
            except SystemExit as exc:
                return int(exc.code or 0)

        bad = await asyncio.to_thread(run_bad)
        err = capsys.readouterr()[1]
    finally:
        await entry.close()
        await client.close()
    assert code == 0 and "UTIL 1h" in out and "MEM 1h" in out
    assert code6 == 0 and "UTIL 6h" in out6 and "MEM 6h" in out6
    assert bad == 2 and "--history" in err
    sparks = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.split("  ") if c.strip()]
        found = [c for c in cells if len(c) == 16 and set(c) <= set(BLOCKS)]
        if found and line.strip()[:1].isdigit():
            sparks[int(line.split()[0])] = found[0]
            assert len(found) == 2  # utilisation and memory
    assert sparks[2] == sparks[3] == "▁" * 16  # carol's idle reservation and the GPU nobody used


async def test_a_running_daemon_records_its_samples_and_ends_its_jobs_on_stop(tmp_path, fast_mdns):
    """The whole path in a started daemon (sampling loop, on_sample, writer thread, HTTP), on 127.0.0.1."""
    from daemon_helpers import FakeBackend, make_snapshot, running_daemon, unique_session, wait_until
    from gpusd.usage.db import connect

    snap = make_snapshot(2, hostname="rec-host", util=50.0)
    snap.gpus[0].processes = [ProcessInfo(pid=7, user="alice", command="train")]
    async with running_daemon(tmp_path, unique_session(), "rec-host", backend=FakeBackend(snap)) as d:
        db = d.recording.path
        assert db == d.state_dir / "history.sqlite"

        def recorded() -> float:
            conn = connect(db, readonly=True)
            try:
                return conn.execute("SELECT coalesce(sum(seconds), 0) FROM series WHERE tier=0").fetchone()[0]
            finally:
                conn.close()

        await wait_until(lambda: recorded() >= 1.0, timeout=20)  # 0.1 s samples: ten of them
        r = await asyncio.to_thread(main, ["report", "--db", str(db), "--since", "1h", "--format", "json"])
        assert r == 0
    conn = connect(db, readonly=True)
    jobs = conn.execute("SELECT user, ended FROM jobs").fetchall()
    conn.close()
    assert jobs and all(ended is not None for _, ended in jobs) and jobs[0][0] == "alice"


def test_top_asks_no_history_of_a_host_that_did_not_prove_itself():
    """With the fleet secret, `gpusd top` fetches sparkline history only from hosts that proved they
    hold it (or, without a secret, from any host): a stranger announcing itself gets no request from
    top, and its sparklines show what top itself saw."""
    from gpusd.views.spark import Sparks
    from gpusd.views.top import HostView

    asked: list[tuple[str, Any]] = []

    def get_json(url: str, key: Any, timeout: float) -> dict[str, Any]:
        asked.append((url, key))
        return {"t": [], "step": 10}

    def view(name: str, verified: bool | None) -> HostView:
        snap = HostSnapshot(hostname=name, node_id=name, timestamp=T0,
                            gpus=[GpuInfo(index=0, uuid=f"GPU-{name}", utilization_gpu=90.0)])
        return HostView(name, name, snap, url=f"http://{name}:4780/api/v1", verified=verified)

    key = FleetKey(TOKEN)
    sparks = Sparks(key=key, get_json=get_json)
    try:
        views = sparks.update([view("node-1", True), view("evil", False)], now=T0 + 1, wait=10.0)
    finally:
        sparks.close()
    assert [u.split("/api/")[0] for u, _ in asked] == ["http://node-1:4780"] and asked[0][1] is key
    assert views[1].spark["GPU-evil"].strip() == "█"  # top's own sample of the stranger

    asked.clear()
    plain = Sparks(get_json=get_json)  # no secret: nothing is verified, every host is asked
    try:
        plain.update([view("node-1", None), view("node-2", None)], now=T0 + 1, wait=10.0)
    finally:
        plain.close()
    assert sorted(u.split("/api/")[0] for u, _ in asked) == ["http://node-1:4780", "http://node-2:4780"]
