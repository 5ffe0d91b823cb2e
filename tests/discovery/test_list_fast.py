"""``gpusd list`` without a fixed browse: the local daemon's fleet view, the one-shot browse and its
fallbacks; late hosts still reach a watching client.  Mechanism checks on 127.0.0.1 (speed is in
bench/bench_discovery.py)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from test_discovery import Recorder, announce, good_txt, http_peer, snapshot_json, sse

from commandpaths import LIST
from daemon_helpers import (  # noqa: F401
    fast_mdns,
    make_snapshot,
    running_daemon,
    unique_session,
    wait_until,
)
from fake_signing import proof_headers
from gpusd.daemon.process import PidFile, write_info
from gpusd.discovery import fleetsource, fleetview, oneshot
from gpusd.discovery.client import AsyncClient
from gpusd.discovery.types import Filters
from gpusd.model import ProcessInfo
from gpusd.wire.sse import format_event

pytestmark = pytest.mark.usefixtures("fast_mdns")

OWN_NODE = "0123456789abcdef"


# -- a fake local daemon: a locked pid file, gpusd.json, and GET /api/v1/fleet ------------------------
def fleet_host(node: str, host: str, session: str, n: int = 1, owner: str | None = None) -> dict[str, Any]:
    snap = make_snapshot(n, hostname=host, node_id=node)
    if owner:
        snap.gpus[0].processes = [ProcessInfo(pid=4242, used_memory=2**30, user=owner, command="python train.py")]
    return {"node_id": node, "hostname": host, "session": session, "source": "gpusd",
            "url": "http://198.18.0.9:4780/api/v1", "alive": True, "snapshot": snap.to_dict()}


@asynccontextmanager
async def local_daemon(state: Path, session: str, hosts: list[dict[str, Any]], delay: float = 0.0,
                       seen: list[Any] | None = None, secret: str | None = None) -> AsyncIterator[int]:
    """``secret``: the daemon holds this fleet secret and proves it to signed readers, as a real one does."""
    body = json.dumps({"session": session, "hosts": hosts}).encode()  # built once, as a daemon's answer is

    async def fleet(request: web.Request) -> web.Response:
        if seen is not None:
            seen.append(dict(request.headers))
        await asyncio.sleep(delay)
        headers = {"Content-Type": "application/json"}
        if secret is not None:
            headers.update(proof_headers(request, secret, body, OWN_NODE))
        return web.Response(body=body, headers=headers)

    app = web.Application()
    app.router.add_get("/api/v1/fleet", fleet)
    runner = web.AppRunner(app, shutdown_timeout=0.2)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    state.mkdir(parents=True, exist_ok=True)
    pid = PidFile(state)
    pid.acquire()
    write_info(state, {"pid": os.getpid(), "port": port, "addresses": ["127.0.0.1"], "interfaces": ["127.0.0.1"],
                       "session": session, "node_id": OWN_NODE})
    try:
        yield port
    finally:
        pid.release()
        await runner.cleanup()


async def gpusd_list(state: Path, *args: str, **env: str) -> list[dict[str, Any]]:
    full = dict(os.environ, GPUSD_STATE_DIR=str(state), GPUSD_INTERFACES="127.0.0.1", GPUSD_MDNS_FAST="1", **env)
    full.pop("GPUSD_TOKEN", None)
    full.update(env)
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gpusd", "list", "--json", *args, env=full,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    devices: list[dict[str, Any]] = json.loads(out)
    assert proc.returncode == (0 if devices else 6), err.decode()  # 6: nothing found
    return devices


async def test_list_answers_from_the_local_daemons_fleet_view(tmp_path: Path) -> None:
    session = unique_session()
    state = tmp_path / "state"
    # "far" is announced nowhere: only the fleet view knows it
    hosts = [fleet_host(OWN_NODE, "here", session, 2), fleet_host("fedcba9876543210", "far", session, 1)]
    async with local_daemon(state, session, hosts):
        devices = await gpusd_list(state, "--session", session)
        assert sorted((d["hostname"], d["gpu"]["index"]) for d in devices) == [("far", 0), ("here", 0), ("here", 1)]
        # the usual filters apply to it
        assert {d["hostname"] for d in await gpusd_list(state, "--session", session, "--host", "fa*")} == {"far"}
        # another session: not the fleet view's (nothing announces that one: nothing listed)
        assert await gpusd_list(state, "--session", unique_session("other")) == []


async def test_list_shows_other_hosts_owners_only_to_token_holders(tmp_path: Path) -> None:
    session = unique_session()
    state = tmp_path / "state"
    hosts = [fleet_host(OWN_NODE, "here", session, owner="alice"),
             fleet_host("fedcba9876543210", "far", session, owner="bob")]
    seen: list[Any] = []
    secret = "a-fleet-secret-of-32-characters!"
    async with local_daemon(state, session, hosts, seen=seen, secret=secret):
        def owners(devices: list[dict[str, Any]]) -> dict[str, Any]:
            return {d["hostname"]: [(p["user"], p["command"]) for p in d["gpu"]["processes"]]
                    for d in devices if d["gpu"]["index"] == 0}

        # no token: this host's own owners (a reader here sees them anyway), not the other host's
        assert owners(await gpusd_list(state, "--session", session)) == {
            "here": [("alice", "python train.py")], "far": [(None, None)]}
        # the fleet secret: the request is signed, the daemon proves it holds the secret too
        assert owners(await gpusd_list(state, "--session", session, GPUSD_TOKEN=secret)) == {
            "here": [("alice", "python train.py")], "far": [("bob", "python train.py")]}
        # a daemon that does not hold the reader's secret answers without a proof: nothing of its view is
        # believed (neither owners nor which hosts are verified): the client browses, and nothing
        # announces these hosts (issue 18, item 6: tests/discovery/test_list_options_hold.py)
        assert owners(await gpusd_list(state, "--session", session, GPUSD_TOKEN="another-fleet-secret-0123")) == {}
    assert len(seen) == 3 and not any("Authorization" in h for h in seen)  # no secret sent to the daemon
    assert "Signature" not in seen[0] and "Signature" in seen[1]
    assert not any(secret in str(h) for h in seen)


async def test_list_takes_a_slow_fleet_answer_within_the_bound(tmp_path: Path) -> None:
    """The fleet view answers after the quick wait (a fleet view that is just starting): the browse
    starts meanwhile, and the fleet view's answer, there first, is taken (the browse needs its
    imports and the one-shot settle period, ``oneshot.SPREAD``, on top of the quick wait)."""
    session = unique_session()
    state = tmp_path / "state"
    delay = fleetview.QUICK + 0.02
    async with local_daemon(state, session, [fleet_host(OWN_NODE, "here", session)], delay=delay):
        devices = await gpusd_list(state, "--session", session)
    assert [d["hostname"] for d in devices] == ["here"]


async def test_list_reads_a_fleet_view_larger_than_other_answers(tmp_path: Path) -> None:
    """A fleet of hundreds of 8-GPU hosts makes a fleet view larger than the 4 MiB other answers are
    bound to (5-10 kB a host): the list still takes it from the local daemon (issue 24, 1,000 hosts)."""
    session = unique_session()
    state = tmp_path / "state"
    hosts = [fleet_host(OWN_NODE, "here", session)] + [fleet_host(f"ffff{i:04d}", f"far-{i:03d}", session, n=8)
                                                       for i in range(900)]
    assert len(json.dumps(hosts)) > 4 * 2**20
    async with local_daemon(state, session, hosts):
        devices = await gpusd_list(state, "--session", session)
    assert len({d["hostname"] for d in devices}) == 901 and len(devices) == 1 + 900 * 8


async def test_list_takes_the_fleet_view_that_comes_after_the_browse(tmp_path: Path) -> None:
    """The browse settles first (a host answers at once) while the daemon's fleet view is still on its
    way (a large fleet takes it about a second): the fleet view, the whole fleet, is what is listed."""
    session = unique_session()
    state = tmp_path / "state"

    async def events(request: web.Request) -> web.StreamResponse:
        return await sse(request, format_event("snapshot", snapshot_json("bbbb0001", "browsed")), hold=10)

    fleet = [fleet_host(OWN_NODE, "here", session), fleet_host("cccc0001", "far", session)]
    async with local_daemon(state, session, fleet, delay=1.5), \
            http_peer(events) as port, announce("browsed-bbbb0001", good_txt("bbbb0001", "browsed", session), port):
        devices = await gpusd_list(state, "--session", session)
    assert sorted(d["hostname"] for d in devices) == ["far", "here"]


async def test_list_browses_when_the_local_daemon_hangs(tmp_path: Path) -> None:
    session = unique_session()
    state = tmp_path / "state"

    async def events(request: web.Request) -> web.StreamResponse:
        return await sse(request, format_event("snapshot", snapshot_json("bbbb0001", "browsed")), hold=10)

    async with local_daemon(state, session, [fleet_host(OWN_NODE, "here", session)], delay=30), \
            http_peer(events) as port, announce("browsed-bbbb0001", good_txt("bbbb0001", "browsed", session), port):
        devices = await gpusd_list(state, "--session", session)
    assert [d["hostname"] for d in devices] == ["browsed"]


def test_a_stale_or_foreign_state_is_not_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = tmp_path / "state"
    state.mkdir()
    monkeypatch.setenv("GPUSD_STATE_DIR", str(state))
    info = {"pid": 1, "port": 4780, "addresses": ["127.0.0.1"], "interfaces": [], "session": "s1", "node_id": OWN_NODE}
    write_info(state, info)
    assert fleetsource.local_daemon_urls("s1") is None  # gpusd.json left behind, no daemon holds the pid file
    pid = PidFile(state)
    pid.acquire()
    try:
        write_info(state, info)
        assert fleetsource.local_daemon_urls("s1") == (["http://127.0.0.1:4780/api/v1"], OWN_NODE)
        assert fleetsource.local_daemon_urls("s2") is None  # another session's daemon
        write_info(state, dict(info, port="4780; rm -rf /", addresses=["not-an-address"]))
        assert fleetsource.local_daemon_urls("s1") is None
        write_info(state, dict(info, interfaces=["198.18.0.7"], addresses=["198.18.0.7", "evil host"]))
        assert fleetsource.local_daemon_urls("s1") == (["http://198.18.0.7:4780/api/v1"], OWN_NODE)
    finally:
        pid.release()


def test_unusable_fleet_answers_mean_browsing() -> None:
    f = Filters(session="s")

    def body(*hosts: dict[str, Any]) -> Any:
        return json.loads(json.dumps({"session": "s", "hosts": list(hosts)}))

    good = fleet_host(OWN_NODE, "here", "s")
    assert fleetview.parse_fleet(body(good), f, OWN_NODE, False) is not None
    assert fleetview.parse_fleet("<html>", f, OWN_NODE, False) is None
    assert fleetview.parse_fleet([[[]]], f, OWN_NODE, False) is None
    assert fleetview.parse_fleet(body(), f, OWN_NODE, False) is None  # not even itself: still starting
    assert fleetview.parse_fleet(body(good, dict(good, source="hwsd", snapshot=None)), f, OWN_NODE, False) is None
    assert fleetview.parse_fleet(body(dict(good, hostname="evil\x1b[2Jhost")), f, OWN_NODE, False) is None
    assert fleetview.parse_fleet(body(dict(good, snapshot={"gpus": "many"})), f, OWN_NODE, False) is None


# -- the one-shot browse (in-process) ---------------------------------------------------------------
def maker(session: str, made: list[AsyncClient] | None = None) -> Callable[..., AsyncClient]:
    def make(**kw: Any) -> AsyncClient:
        c = AsyncClient(session=session, interfaces=["127.0.0.1"], **kw)
        if made is not None:
            made.append(c)
        return c
    return make


async def test_one_shot_browse_lists_every_host_of_the_session(tmp_path: Path) -> None:
    session = unique_session()
    made: list[AsyncClient] = []
    async with running_daemon(tmp_path, session, "n1", n=2), running_daemon(tmp_path, session, "n2", n=1), \
            running_daemon(tmp_path, unique_session("other"), "n3", n=1):
        devices, hosts, _ = await oneshot.browse_settled(maker(session, made), ["127.0.0.1"], 5.0)
    assert sorted(h.hostname for h in hosts) == ["n1", "n2"]
    assert sorted((d.hostname, d.index) for d in devices) == [("n1", 0), ("n1", 1), ("n2", 0)]
    assert len(made) == 1 and made[0].answered  # the one-shot query was answered: no multicast browse


async def test_one_shot_browses_back_to_back_are_all_answered(tmp_path: Path) -> None:
    """Responders drop a query identical to one they got less than a second before, unless it asks
    for unicast answers (QU): one-shot queries do, so a list right after another is still answered."""
    session = unique_session()
    async with running_daemon(tmp_path, session, "n1", n=1), \
            AsyncClient(session=session, interfaces=["127.0.0.1"]):  # another client browsing meanwhile
        for _ in range(3):
            made: list[AsyncClient] = []
            _, hosts, _ = await oneshot.browse_settled(maker(session, made), ["127.0.0.1"], 5.0)
            assert [h.hostname for h in hosts] == ["n1"]
            assert len(made) == 1 and made[0].answered  # answered at once, no multicast browse needed


async def test_one_shot_browse_waits_for_a_host_slow_to_answer(tmp_path: Path) -> None:
    """A host found at once whose event stream sends its snapshot only after the answers have
    settled is still listed (within the timeout), if it answers within ``GIVE_UP`` of being found."""
    session = unique_session()

    async def slow(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(max(oneshot.QUIET + oneshot.SPREAD + 0.05, oneshot.GIVE_UP * 0.6))
        return await sse(request, format_event("snapshot", snapshot_json("bbbb0001", "slow")), hold=10)

    async with http_peer(slow) as port, announce("slow-bbbb0001", good_txt("bbbb0001", "slow", session), port), \
            running_daemon(tmp_path, session, "quick", n=1):
        devices, hosts, _ = await oneshot.browse_settled(maker(session), ["127.0.0.1"], 5.0)
    assert sorted(h.hostname for h in hosts) == ["quick", "slow"] and len(devices) == 2


async def test_no_answer_to_the_one_shot_query_means_a_multicast_browse(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """As behind a firewall that drops unicast replies to an ephemeral port: the one-shot client hears
    nothing, and a multicast browse (port 5353) follows."""
    real = oneshot.open_oneshot_zeroconf

    async def unheard(interfaces: list[str] | None) -> Any:
        zc = await real(interfaces)
        zc.zeroconf.async_send = lambda *a, **kw: None  # its queries never get an answer
        return zc

    monkeypatch.setattr(oneshot, "open_oneshot_zeroconf", unheard)
    made = await _list_one_host(tmp_path)
    assert len(made) == 2 and not made[0].answered and made[1].answered


async def _list_one_host(tmp_path: Path) -> list[AsyncClient]:
    """A one-shot list of a session with one daemon (n1, one GPU), which it lists; the clients it made."""
    session = unique_session()
    made: list[AsyncClient] = []
    async with running_daemon(tmp_path, session, "n1", n=1):
        devices, hosts, _ = await oneshot.browse_settled(maker(session, made), ["127.0.0.1"], 5.0)
    assert [h.hostname for h in hosts] == ["n1"] and len(devices) == 1
    return made


async def test_a_host_that_comes_late_still_reaches_a_watching_client(tmp_path: Path) -> None:
    """``gpusd watch`` keeps browsing: a host that answers (or starts) after discovery settled is
    reported all the same."""
    session = unique_session()
    client = AsyncClient(session=session, interfaces=["127.0.0.1"])
    rec = Recorder(client)
    async with running_daemon(tmp_path, session, "early", n=1):
        await client.start_listening()
        try:
            await client.wait_settled(5)
            assert [h.hostname for h in client.hosts] == ["early"]
            async with running_daemon(tmp_path, session, "late", n=1):
                await rec.wait("host_added", "late", timeout=10)
                await wait_until(lambda: len(client.list_devices()) == 2, 5)
        finally:
            await client.stop_listening()


async def test_a_service_back_right_after_its_goodbye_is_followed_only_later(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stopping responder may still multicast a queued answer after its goodbye (and the stopping
    daemon still accept a connection): a service announced again right after its goodbye is followed
    only after ``REAPPEAR_HOLD``, so a stale answer adds no ghost host; a restarted one is seen."""
    from gpusd.discovery import mdns as client_mod

    session = unique_session()
    calls = 0

    async def events(request: web.Request) -> web.StreamResponse:
        nonlocal calls
        calls += 1
        return await sse(request, format_event("snapshot", snapshot_json("cccc0001", "bouncy")), hold=10)

    txt = good_txt("cccc0001", "bouncy", session)
    async with http_peer(events) as port:
        async with AsyncClient(session=session, interfaces=["127.0.0.1"]) as client:
            rec = Recorder(client)
            monkeypatch.setattr(client_mod, "REAPPEAR_HOLD", 60.0)
            async with announce("bouncy-cccc0001", txt, port):
                await rec.wait("host_added")
            await rec.wait("host_removed")  # its goodbye
            async with announce("bouncy-cccc0001", txt, port):  # back at once
                await wait_until(lambda: "bouncy-cccc0001._gpusd._tcp.local." in client._peers, 5)
                await asyncio.sleep(0.5)
                assert calls == 1 and len(rec.of("host_added")) == 1  # not followed (yet)
        async with AsyncClient(session=session, interfaces=["127.0.0.1"]) as client:
            rec = Recorder(client)
            monkeypatch.setattr(client_mod, "REAPPEAR_HOLD", 0.5)
            async with announce("bouncy-cccc0001", txt, port):
                await rec.wait("host_added")
            await rec.wait("host_removed")
            async with announce("bouncy-cccc0001", txt, port):  # a restart: seen after the hold
                await rec.wait("host_added", n=2, timeout=10)


def test_the_one_shot_query_is_sent_through_zeroconfs_public_api() -> None:
    """RFC 6762 §5.1: a one-shot query goes out at once (no private zeroconf module patched): one PTR
    question per browsed type, asking for unicast answers (QU)."""
    import inspect

    from gpusd.wire.txt import HWSD_TYPE, SERVICE_TYPE

    sent: list[Any] = []

    class Zc:
        def async_send(self, out: Any) -> None:
            sent.append(out)

    oneshot.ask_now(Zc(), [SERVICE_TYPE, HWSD_TYPE])
    [out] = sent
    assert [(q.name, q.type, q.unicast) for q in out.questions] == [(SERVICE_TYPE, 12, True), (HWSD_TYPE, 12, True)]
    assert "from zeroconf._" not in inspect.getsource(oneshot)  # no private module of python-zeroconf


async def test_a_tar_pit_is_given_up_on_and_the_real_hosts_are_listed(tmp_path: Path) -> None:
    """A service that accepts the connection and never answers (a tar pit) does not hold the one-shot
    list until its timeout: GIVE_UP s after it was found (and with no host answering meanwhile) it is
    given up on and the browse counts as settled (True, not the timeout's False) with the hosts that
    answered; the pit is not listed.  (Without the give-up
    the pit settles only when its connection attempt is abandoned, after RESOLVE_TIMEOUT + 2 = 5 s: past
    this browse's timeout of 4 s.)"""
    session = unique_session()
    held: list[asyncio.StreamWriter] = []

    async def pit(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # accept, never answer

    server = await asyncio.start_server(pit, "127.0.0.1", 0)
    pit_port = server.sockets[0].getsockname()[1]
    try:
        async with announce("pit-cccc0001", good_txt("cccc0001", "pit", session), pit_port), \
                running_daemon(tmp_path, session, "real", n=1):
            from gpusd.wire.mdns import resolve_interfaces

            zc = await oneshot.open_oneshot_zeroconf(resolve_interfaces(["127.0.0.1"]))
            client = maker(session)(zeroconf=zc)
            try:
                await client.start_listening()
                settled = await client.wait_settled(4.0, minimum=oneshot.NO_ANSWER,
                                                    early=(oneshot.QUIET, oneshot.SPREAD), give_up=oneshot.GIVE_UP)
                hosts = [h.hostname for h in client.hosts]
                announced = sorted(h.hostname for h in client.announced())
            finally:
                await client.stop_listening()
                await zc.async_close()
    finally:
        server.close()
        for w in held:
            w.transport.abort()
    assert announced == ["pit", "real"]  # both were found, and the pit was asked
    assert settled is True and hosts == ["real"]


def _udp_drops(inode: int) -> int | None:
    """The kernel's count of datagrams dropped on the UDP socket ``inode`` (its receive buffer full)."""
    for line in Path("/proc/self/net/udp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[9]) == inode:
            return int(fields[12])
    return None


async def test_a_burst_of_answers_is_not_dropped_while_the_list_is_starting() -> None:
    """A one-shot query is answered by every responder at once, and a responder with hundreds of
    services (a flood of fake ones) answers in hundreds of datagrams, while a cold ``gpusd list`` is
    still importing: with the default receive buffer (208 KiB) the burst overflowed the one-shot socket
    and real hosts' answers were dropped with the flood's (bench_oneshot_flood: now and then a list
    missing some or all real hosts).  Here 600 answers of 1,200 bytes arrive while the loop cannot read
    them: none is dropped."""
    import socket

    rmem_max = Path("/proc/sys/net/core/rmem_max")
    if not Path("/proc/self/net/udp").exists() or not rmem_max.exists():
        pytest.skip("needs Linux's /proc/net/udp (per-socket drop counts)")
    if int(rmem_max.read_text()) < oneshot.RECEIVE_BUFFER:
        pytest.skip(f"net.core.rmem_max is {int(rmem_max.read_text())} bytes: the kernel grants no larger buffer")
    zc = await oneshot.open_oneshot_zeroconf(["127.0.0.1"])
    try:
        [sock] = {w.sock for w in zc.zeroconf.engine.readers}
        port, inode = sock.getsockname()[1], os.fstat(sock.fileno()).st_ino
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as out:
            for i in range(600):  # no await: this loop, which reads the socket, is busy meanwhile
                out.sendto(i.to_bytes(2, "big") + bytes(1198), ("127.0.0.1", port))
        assert _udp_drops(inode) == 0
    finally:
        await zc.async_close()


async def test_answers_dropped_by_the_one_shot_socket_mean_a_multicast_browse(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernel grants a smaller buffer than asked (net.core.rmem_max) and a burst overflowed it
    anyway, the dropped answers may have been real hosts': the list browses by multicast as well, as it does
    when nothing answered, rather than list what happened to fit."""
    from gpusd.wire import mdns

    real = mdns.dropped
    counts: list[int] = []

    def lossy(aiozc: Any) -> int:
        counts.append(real(aiozc))
        return counts[-1] + 3  # as if three answers had not fitted

    monkeypatch.setattr(mdns, "dropped", lossy)
    made = await _list_one_host(tmp_path)
    assert counts == [0]  # the real count, read once: nothing dropped here
    assert len(made) == 2 and made[0].answered and made[1].answered  # answered, and browsed by multicast too


@pytest.mark.parametrize("delay", [0.0, 0.5])
async def test_a_list_the_local_daemon_answers_imports_no_browser(tmp_path: Path, delay: float) -> None:
    """Where the local daemon answers at once, ``gpusd list`` reads its fleet view and exits: neither
    asyncio nor the browser (zeroconf, aiohttp, the one-shot module) is imported, nor the signing
    module without a fleet secret -- their imports cost more than the answer.  Also where it
    took the request and answers after the quick wait (a fleet of 1,000 hosts: 0.1-0.5 s to build): a
    browse meanwhile would only compete with it.  The JSON is one device a line (the C encoder's), and
    still one valid array."""
    session = unique_session()
    state = tmp_path / "state"
    code = ("import json, sys\nfrom gpusd.cli import main\nrc = main(sys.argv[1:])\n"
            "print(json.dumps(sorted(sys.modules)), file=sys.stderr)\nsys.exit(rc)\n")
    hosts = [fleet_host(OWN_NODE, "here", session, 2), fleet_host("fedcba9876543210", "far", session, 1)]
    assert fleetview.QUICK < delay + 0.1 < fleetview.FLEET_TIMEOUT or delay == 0
    async with local_daemon(state, session, hosts, delay=delay):
        env = dict(os.environ, GPUSD_STATE_DIR=str(state), GPUSD_INTERFACES="127.0.0.1", GPUSD_MDNS_FAST="1")
        for var in ("GPUSD_TOKEN", "GPUSD_TOKEN_FILE", "GPUSD_PEERS", "GPUSD_PEERS_FILE", "GPUSD_DNS_SD_DOMAIN"):
            env.pop(var, None)
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code, "list", "--json", "--session", session,
                                                    env=env, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    modules = set(json.loads(err.decode().strip().splitlines()[-1]))
    assert not modules & {"asyncio", "zeroconf", "aiohttp", "gpusd.discovery.oneshot", "gpusd.discovery.client",
                          "gpusd.wire.signing", "concurrent.futures"}
    assert sorted(m for m in modules if m.split(".")[0] == "gpusd" and m not in LIST) == []  # tests/commandpaths.py
    lines = out.decode().splitlines()
    assert lines[0] == "[" and lines[-1] == "]" and len(lines) == 2 + 3  # one device a line
    assert sorted(json.loads(line.rstrip(","))["hostname"] for line in lines[1:-1]) == ["far", "here", "here"]
    assert [d["gpu"]["index"] for d in json.loads(out)] == [0, 0, 1]


async def test_the_fleet_view_is_there_once_the_daemon_answered_its_parsing_is_the_readers(tmp_path: Path) -> None:
    """A reading of the local fleet view is done once the daemon's answer is in; parsing it (1,000 hosts:
    ~0.5 s of this process's own work, longer than the quick wait) is left to whoever takes it, so
    ``gpusd list`` does not start a browse to race its own parsing (a browse that then settled first,
    with only the hosts of the link, was listed instead of the fleet on a loaded machine)."""
    session = unique_session()
    state = tmp_path / "state"
    hosts = [fleet_host(OWN_NODE, "here", session)] + [fleet_host(f"ffff{i:04d}", f"far-{i:03d}", session, n=8)
                                                       for i in range(300)]
    async with local_daemon(state, session, hosts) as port:
        view = fleetview.LocalFleetView(lambda: ([f"http://127.0.0.1:{port}/api/v1"], OWN_NODE),
                                        Filters(session=session))
        parsed: list[Any] = []
        parse = view.parse

        def spy(fetched: Any) -> Any:
            parsed.append(fetched)
            return parse(fetched)

        view.parse = spy  # type: ignore[method-assign]
        reading = view.start()
        assert await asyncio.get_running_loop().run_in_executor(None, reading.wait, 30)
    assert reading.done() and parsed == []  # answered, nothing parsed yet
    listing = reading.result()
    assert listing is not None and len(listing.hosts) == 301 and len(listing.devices) == 1 + 300 * 8
    assert reading.result() is listing and len(parsed) == 1  # parsed once


def test_the_fleet_views_hosts_keep_how_they_were_found_and_when_last_heard() -> None:
    """A host of the local daemon's fleet view is built from its record (RemoteHost.from_record):
    how that daemon found it (a static peer) and when it last heard from it are kept."""
    far = {**fleet_host("fedcba9876543210", "far", "s"), "via": "peer", "last_seen": 1765000000.5}
    listing = fleetview.parse_fleet(json.loads(json.dumps({"session": "s", "hosts": [fleet_host(OWN_NODE, "here", "s"),
                                                                                      far]})),
                                    Filters(session="s"), OWN_NODE, False)
    assert listing is not None
    by_name = {h.hostname: h for h in listing.hosts}
    assert (by_name["far"].via, by_name["far"].last_seen) == ("peer", 1765000000.5)
    assert by_name["here"].via == "mdns" and by_name["far"].txt.count == 1


def test_the_source_choice_lives_in_discovery() -> None:
    """discovery.fleetsource.choose: the daemon's view where it answers; the browse otherwise, handed
    no view once the daemon answered nothing usable."""
    import threading

    from gpusd.discovery import fleetsource
    from gpusd.discovery.source import Listing

    class Answered:
        def __init__(self, result: Listing | None) -> None:
            self.sent = threading.Event()
            self._result = result

        def arrived(self) -> bool:
            return True

        def done(self) -> bool:
            return True

        def result(self) -> Listing | None:
            return self._result

    view = Listing([], [], 0)
    browsed: list[object] = []

    def browse(local: object) -> Listing:
        browsed.append(local)
        return Listing([], [], 7)

    assert fleetsource.choose(Answered(view), browse) is view and browsed == []  # type: ignore[arg-type]
    assert fleetsource.choose(Answered(None), browse).unmatched == 7 and browsed == [None]  # type: ignore[arg-type]
    assert fleetsource.choose(None, browse).unmatched == 7 and browsed == [None, None]
