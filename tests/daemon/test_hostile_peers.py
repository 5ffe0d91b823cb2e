"""A daemon that hostile peers cannot take down (issue 9, findings 7 and 11).

Everything on 127.0.0.1 (or in namespaces this test creates), bounded in count and time:
half-open HTTP connections (slowloris), readers that stop reading an event stream, too many
readers, a flood of fake ``_gpusd._tcp`` services, a log flood, and threshold rules with typos.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from daemon_helpers import (  # noqa: F401
    fast_mdns,
    running_daemon,
    unique_session,
    wait_until,
)
from netns import lan, netns_ok  # noqa: F401

pytestmark = pytest.mark.usefixtures("fast_mdns")

PARTIAL_HEAD = b"GET /api/v1/gpus HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "  # never finished


Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def open_half_open(port: int, n: int, batch: int = 100) -> list[Conn]:
    """``n`` connections that each send half a request head and then nothing."""
    conns: list[Conn] = []

    async def one() -> None:
        r, w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 30)
        w.write(PARTIAL_HEAD)
        conns.append((r, w))

    for start in range(0, n, batch):
        await asyncio.gather(*(one() for _ in range(min(batch, n - start))))
    return conns


async def closed_by_server(reader: asyncio.StreamReader, timeout: float) -> bool:
    """Whether the server closed (or reset) the connection within ``timeout`` seconds."""
    try:
        while True:
            data = await asyncio.wait_for(reader.read(65536), timeout)
            if not data:
                return True
    except (ConnectionError, OSError):
        return True
    except asyncio.TimeoutError:
        return False


def close_all(conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]) -> None:
    for _, w in conns:
        w.transport.abort()


async def get(url: str, timeout: float = 10.0) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        return r.status, await r.json()


# -- slowloris -----------------------------------------------------------------------------------
async def test_half_open_connections_are_closed_and_the_api_answers(tmp_path: Path) -> None:
    """1,100 connections that never finish their request head (more than a 1024-descriptor daemon
    could hold): a normal request still answers, and every half-open one is closed once the header
    timeout has passed."""
    async with running_daemon(tmp_path, unique_session(), "loris", header_timeout=1.0) as d:
        port = d.port
        conns = await open_half_open(port, 1100)
        try:
            status, gpus = await get(d.urls[0] + "/gpus", timeout=20)
            assert status == 200 and len(gpus) == 2
            results = await asyncio.gather(*(closed_by_server(r, 20) for r, _ in conns))
            assert all(results), f"{results.count(False)} half-open connections still open"
            status, _ = await get(d.urls[0] + "/gpus")
            assert status == 200
        finally:
            close_all(conns)


async def test_connection_cap_closes_half_open_connections_first(tmp_path: Path) -> None:
    """At the cap, a new connection pushes out the oldest one still waiting for its request head;
    when every connection is busy (event streams), a new one is refused instead."""
    async with running_daemon(tmp_path, unique_session(), "cap", max_connections=20, header_timeout=60.0,
                              max_subscribers=50) as d:
        conns = await open_half_open(d.port, 40)
        try:
            status, _ = await get(d.urls[0] + "/gpus")
            assert status == 200
            # the 20 oldest half-open connections (and more, for the request) were closed, long
            # before their 60 s header timeout
            closed = await asyncio.gather(*(closed_by_server(r, 5) for r, _ in conns[:21]))
            assert all(closed)
            assert d.guard is not None and d.guard.count <= 20
        finally:
            close_all(conns)
        await wait_until(lambda: d.guard.count == 0)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
            streams = [await s.get(d.urls[0] + "/events") for _ in range(20)]
            try:
                assert all(r.status == 200 for r in streams)
                await wait_until(lambda: len(d.events) == 20)
                with pytest.raises((aiohttp.ClientError, asyncio.TimeoutError)):
                    async with s.get(d.urls[0] + "/gpus", timeout=aiohttp.ClientTimeout(total=5)) as r:
                        await r.read()
            finally:
                for r in streams:
                    r.close()
            await wait_until(lambda: len(d.events) == 0)
            async with s.get(d.urls[0] + "/gpus") as r:
                assert r.status == 200


# -- event streams ---------------------------------------------------------------------------------
async def test_slow_event_stream_reader_is_dropped(tmp_path: Path) -> None:
    """A reader that opens /api/v1/events and stops reading: once a write has waited
    ``write_timeout``, the daemon drops it (no subscription, connection closed)."""
    async with running_daemon(tmp_path, unique_session(), "slow", write_timeout=0.5) as d:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(loop.sock_connect(sock, ("127.0.0.1", d.port)), 5)
            await loop.sock_sendall(sock, b"GET /api/v1/events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            await wait_until(lambda: len(d.events) == 1)
            pad = "x" * 256 * 1024
            for i in range(40):  # 10 MB: more than the socket buffers hold
                d.publish("threshold", {"state": "exceeded", "i": i, "pad": pad})
                await asyncio.sleep(0.01)
                if len(d.events) == 0:
                    break
            await wait_until(lambda: len(d.events) == 0, timeout=15)
            # the connection is closed: reading what was sent ends with EOF (or a reset), not a stream
            received = 0
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                try:
                    chunk = await asyncio.wait_for(loop.sock_recv(sock, 1 << 20), 5)
                except (ConnectionError, OSError):
                    break
                if not chunk:
                    break
                received += len(chunk)
            else:
                pytest.fail("the stream to a reader that stopped reading is still open")
            assert received < 40 * len(pad)  # it did not get everything: it was cut off
        finally:
            sock.close()
        async with aiohttp.ClientSession() as s:  # others are served as before
            async with s.get(d.urls[0] + "/gpus") as r:
                assert r.status == 200


async def test_event_stream_subscriber_cap(tmp_path: Path) -> None:
    async with running_daemon(tmp_path, unique_session(), "subs", max_subscribers=3) as d:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
            streams = [await s.get(d.urls[0] + "/events") for _ in range(3)]
            assert [r.status for r in streams] == [200, 200, 200]
            async with s.get(d.urls[0] + "/events") as r:
                assert r.status == 503 and r.headers.get("Retry-After")
                assert "too many" in (await r.json())["error"]
            streams[0].close()
            await wait_until(lambda: len(d.events) == 2)
            again = await s.get(d.urls[0] + "/events")
            assert again.status == 200
            for r in streams[1:] + [again]:
                r.close()


# -- a flood of fake services -----------------------------------------------------------------------
async def test_fake_service_flood_is_capped_logged_once_and_fleet_answers(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """60 fake gpusd services announced on 127.0.0.1 (same session, pointing at a closed port):
    the fleet view follows at most ``fleet_max_hosts``, says how many it dropped, logs that once,
    and the fleet request answers."""
    from zeroconf import ServiceInfo

    from gpusd.wire.mdns import open_zeroconf
    from gpusd.wire.txt import SERVICE_TYPE, encode_txt

    session = unique_session("flood")
    zc = await open_zeroconf(["127.0.0.1"])
    infos = []
    for i in range(60):
        props = encode_txt(node_id=f"fake{i:04d}", hostname=f"fake-{i}", session=session,
                           inventory=[("A100-SXM4-80GB", 81920)], free=1)
        infos.append(ServiceInfo(SERVICE_TYPE, f"fake-{i}-{os.getpid()}.{SERVICE_TYPE}", port=9, properties=props,
                                 server=f"fake-{i}-{os.getpid()}.local.", parsed_addresses=["127.0.0.1"]))
    try:
        tasks = await asyncio.gather(*(zc.async_register_service(i, cooperating_responders=True) for i in infos))
        await asyncio.gather(*tasks)
        caplog.set_level(logging.WARNING, logger="gpusd.discovery.client")
        async with running_daemon(tmp_path, session, "real", fleet_max_hosts=25) as d:
            status, body = await get(d.urls[0] + "/fleet", timeout=30)
            assert status == 200
            assert d.fleet is not None and d.fleet.client is not None
            client = d.fleet.client
            await wait_until(lambda: client.dropped_hosts > 0, timeout=15)
            assert len(client._peers) <= 25
            status, body = await get(d.urls[0] + "/fleet", timeout=30)
            assert status == 200 and body["hosts_dropped"] == client.dropped_hosts > 0
            warnings = [r for r in caplog.records if "services announced" in r.getMessage()]
            assert len(warnings) == 1
    finally:
        await asyncio.gather(*(zc.async_unregister_service(i) for i in infos), return_exceptions=True)
        await zc.async_close()


# -- the log ----------------------------------------------------------------------------------------
def _fresh_logger(tmp_path: Path, **kw: Any) -> tuple[Any, Any]:
    from gpusd.daemon import logs

    clock = [0.0]
    flt = logs.RateLimitFilter(clock=lambda: clock[0])
    saved = logging.getLogger().handlers[:], logging.getLogger().level
    handler = logs.setup("INFO", tmp_path / "gpusd.log", rate_limit=flt, **kw)
    return (flt, clock, handler), saved


def _restore(saved: Any) -> None:
    root = logging.getLogger()
    for h in root.handlers[:]:
        root.removeHandler(h)
        h.close()
    for h in saved[0]:
        root.addHandler(h)
    root.setLevel(saved[1])


def test_log_rate_limit_bounds_growth(tmp_path: Path) -> None:
    """100,000 warnings about 1,000 fake hosts (one template) and 1,000 different messages: the
    log holds a few hundred lines, and says how many it left out."""
    (flt, clock, _), saved = _fresh_logger(tmp_path, max_bytes=10**9)
    try:
        log = logging.getLogger("gpusd.discovery.client")
        for i in range(100_000):
            log.warning("skipping %s: %s", f"fake-{i % 1000}._gpusd._tcp.local.", "no answer to the resolve query")
        log.error("x" * 100_000)
        for i in range(1000):  # 1,000 kinds: beyond the 256 tracked, they share one allowance
            logging.getLogger(f"gpusd.flood{i}").warning("message number %d", i)
        clock[0] = 61.0
        flt.flush(force=True)
    finally:
        _restore(saved)
    text = (tmp_path / "gpusd.log").read_text()
    lines = text.splitlines()
    assert len(text) < 100_000 and len(lines) < 3000
    assert sum("skipping fake-" in ln for ln in lines) == 10
    assert any("99990 more messages like this one" in ln for ln in lines)
    assert any("more characters" in ln for ln in lines)  # the 100 kB line was cut
    assert sum("message number" in ln for ln in lines) < 300


def test_no_control_byte_reaches_the_daemons_log(tmp_path: Path) -> None:
    """A GPU name or a peer's answer quoted in a log line: ``cat gpusd.log`` (or journalctl) ran its
    escape sequences. The daemon's log goes through the one rule for logs (gpusd.sanitize)."""
    (_, saved) = _fresh_logger(tmp_path, max_bytes=10**9)
    try:
        logging.getLogger("gpusd.inventory").warning("GPU %s: %s", "\x1b]0;owned\x07\x1b[2JA100", "lost\x1bc")
    finally:
        _restore(saved)
    text = (tmp_path / "gpusd.log").read_text()
    assert "GPU A100: lost" in text and not [c for c in text if ord(c) < 0x20 and c != "\n"], repr(text)


def test_log_rotates_while_running(tmp_path: Path) -> None:
    (flt, clock, _), saved = _fresh_logger(tmp_path, max_bytes=4096, backups=2)
    try:
        for i in range(300):
            clock[0] = 61.0 * i  # a new window for every line: nothing held back
            flt.flush(force=True)
            logging.getLogger("gpusd.test").info("line %d %s", i, "y" * 60)
    finally:
        _restore(saved)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["gpusd.log", "gpusd.log.1", "gpusd.log.2"]
    assert all((tmp_path / f).stat().st_size <= 4096 for f in files)
    assert "line 299" in (tmp_path / "gpusd.log").read_text()


def test_background_daemon_stderr_follows_rotation(tmp_path: Path) -> None:
    """A background daemon's stdout/stderr are its log file: after a rotation, stray output goes to
    the new file, not on growing the rotated one."""
    log_path = tmp_path / "gpusd.log"
    code = f"""
import logging, sys
from gpusd.daemon import logs
logs.setup("INFO", {str(log_path)!r}, max_bytes=4096, backups=2)
for i in range(100):
    logging.getLogger("gpusd.k%d" % i).info("%s", "z" * 80)
print("STRAY OUTPUT AFTER ROTATION", file=sys.stderr, flush=True)
"""
    with open(log_path, "ab") as f:
        r = subprocess.run([sys.executable, "-c", code], check=False, stdout=f, stderr=f, timeout=60,
                           env=dict(os.environ, PYTHONPATH=os.environ.get("PYTHONPATH", "")))
    assert r.returncode == 0
    assert (tmp_path / "gpusd.log.1").exists()
    assert "STRAY OUTPUT AFTER ROTATION" in log_path.read_text()
    assert "STRAY OUTPUT" not in (tmp_path / "gpusd.log.1").read_text()


# -- the process: open-file limit ------------------------------------------------------------------
def test_daemon_raises_its_open_file_limit_and_survives_half_open_connections(tmp_path: Path) -> None:
    """Started with a soft limit of 200 descriptors (hard limit higher), the daemon raises its soft
    limit to the hard one, so 300 half-open connections do not stop it from accepting."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1000:
        pytest.skip(f"hard open-file limit {hard} too low for this test")
    env = dict(os.environ, GPUSD_STATE_DIR=str(tmp_path / "state"), GPUSD_INTERFACES="127.0.0.1", GPUSD_MDNS_FAST="1")
    r, w = os.pipe()
    argv = [sys.executable, "-m", "gpusd", "start", "--foreground", "--simulate", "1xT4", "--interface", "127.0.0.1",
            "--port", "0", "--session", unique_session("fd"), "--fleet-view", "off", "--ready-fd", str(w)]

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (200, hard))

    log = open(tmp_path / "daemon.log", "wb")
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=log, pass_fds=(w,), preexec_fn=low_limit)
    os.close(w)
    socks: list[socket.socket] = []
    try:
        with os.fdopen(r) as f:
            line = f.readline()
        assert line, (tmp_path / "daemon.log").read_text()
        port = json.loads(line)["port"]
        for _ in range(300):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.sendall(PARTIAL_HEAD)
            socks.append(s)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/gpus", timeout=20) as resp:
            assert resp.status == 200 and len(json.loads(resp.read())) == 1
        limits = Path(f"/proc/{proc.pid}/limits").read_text()
        row = next(ln for ln in limits.splitlines() if ln.startswith("Max open files")).split()
        assert int(row[3]) == hard or row[3] == "unlimited", row
    finally:
        for s in socks:
            s.close()
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()


# -- finding 11: threshold rules are configuration ------------------------------------------------
def test_bad_threshold_rule_fails_in_the_config_for_python_api_and_cli(tmp_path: Path) -> None:
    from gpusd.daemon.config import DaemonConfig
    from gpusd.daemon.service import Daemon
    from gpusd.errors import ConfigError

    cfg = DaemonConfig(thresholds=["temperature>>85"], token="a-fleet-secret-of-32-characters!",
                       state_dir=tmp_path / "st", port=0)
    with pytest.raises(ConfigError, match="temperature>>85"):
        cfg.validate()
    with pytest.raises(ConfigError, match="temperature>>85"):
        Daemon(cfg)  # refused before anything starts
    with pytest.raises(ConfigError):
        DaemonConfig(thresholds="temperature>85").validate()  # a string is not a list of rules
    DaemonConfig(thresholds=["temperature>85", "lost for 30s"]).validate()
    env = dict(os.environ, GPUSD_STATE_DIR=str(tmp_path / "cli"), GPUSD_INTERFACES="127.0.0.1")
    r = subprocess.run([sys.executable, "-m", "gpusd", "start", "--foreground", "--simulate", "1xT4", "--port", "0",
                        "--threshold", "temperature>>85"], check=False, env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "temperature>>85" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("field, value", [("header_timeout", 0.0), ("header_timeout", float("nan")),
                                          ("max_connections", 0), ("max_subscribers", 1.5),
                                          ("write_timeout", -1.0), ("fleet_max_hosts", True)])
def test_limits_are_validated(field: str, value: Any) -> None:
    from gpusd.daemon.config import DaemonConfig
    from gpusd.errors import ConfigError

    with pytest.raises(ConfigError, match=field):
        DaemonConfig(**{field: value}).validate()


# -- finding 11 on a namespace LAN: the access layer is always there -----------------------------------
def test_bad_rule_refuses_to_start_and_a_stranger_never_sees_private_fields(lan: Any) -> None:
    """A daemon with a token and a mistyped threshold rule refuses to start (exit 2, nothing served);
    with valid rules, a reader on another machine without credentials gets GPU load but never
    process owners or command lines."""
    from fakenvml import FakeProcess, make_gpus

    gpus = make_gpus(1, util_gpu=10)
    gpus[0].processes = [FakeProcess(os.getpid(), 2 * 2**30)]
    host = lan.add_gpu_host("private-node", gpus, session=unique_session("acl"), fast=True,
                            args=["--threshold", "temperature>>85"],
                            extra_env={"GPUSD_TOKEN": "a-fleet-secret-of-32-characters!"})
    r = lan.gpusd(host.node, ["start", "--foreground", "--interface", host.ip, "--port", "4780",
                              "--threshold", "temperature>>85", "--simulate", "1xT4"], env=host.env)
    assert r.returncode == 2 and "temperature>>85" in r.stderr, r.stderr
    host.args = ["--threshold", "temperature>85"]
    host.start()
    stranger = lan.add_node("stranger")
    code = ("import json, urllib.request; "
            f"print(urllib.request.urlopen('http://{host.ip}:4780/api/v1/gpus', timeout=10).read().decode())")
    r = lan.run(stranger, [sys.executable, "-c", code])
    assert r.returncode == 0, r.stderr
    gpus_seen = json.loads(r.stdout)
    procs = gpus_seen[0]["processes"]
    assert procs and procs[0]["used_memory"] == 2 * 2**30
    assert all(p.get("user") is None and p.get("command") is None for p in procs)
