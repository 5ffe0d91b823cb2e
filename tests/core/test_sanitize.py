"""Hostile data shown safely (issue 9, finding 9): GPU names, host names, users and commands with rich
markup, terminal escape sequences, bidi overrides or 100,000 characters, and NaN/Infinity readings,
through every terminal path (``gpusd top``, ``devices``, ``list``, ``watch``, ``scan``, ``leases``,
error messages) and every JSON output path."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import gpusd_cli
from daemon_helpers import fast_mdns  # noqa: F401 - a fixture
from fakenvml import FakeProcess, make_gpus
from gpusd.discovery.types import Device, DiscoveryEvent, RemoteHost
from gpusd.model import GpuInfo, HostSnapshot
from gpusd.sanitize import dumps, for_terminal, json_safe
from gpusd.views.top import HostView, TopState, render, render_text
from gpusd.wire.txt import TxtRecord
from monitor_fakes import sim_host

GiB = 2**30
OSC_TITLE = "\x1b]0;pwned\x07"  # sets the terminal's window title
CLEAR = "\x1b[2J\x1b[H"  # clears the screen
C1_CSI = "\x9b31m"  # the 8-bit form of ESC [
BIDI = "\u202e"  # right-to-left override: "abc\u202edcba" reads as something else
MARKUP = "[/bold]x"  # made gpusd top crash (rich MarkupError) for every viewer
HOSTILE = f"{MARKUP}{OSC_TITLE}{CLEAR}{C1_CSI}{BIDI}evil"
HUGE = "N" * 100_000

# What must never reach a terminal: ESC (and so every escape sequence), BEL, other C0 controls,
# C1 controls, bidi overrides and isolates.
FORBIDDEN = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
SGR = re.compile(r"\x1b\[[0-9;]*m")  # colours rich itself writes (with --color)


def assert_clean(text: str, colours: bool = False) -> None:
    if colours:
        text = SGR.sub("", text)
    bad = FORBIDDEN.findall(text)
    assert not bad, f"control characters reached the terminal: {bad[:5]!r}"
    assert "pwned" not in text  # the OSC payload went with its sequence


def strict_json(text: str) -> Any:
    def refuse(name: str) -> None:
        raise AssertionError(f"{name} in JSON output")

    return json.loads(text, parse_constant=refuse)


# -- the sanitiser itself ----------------------------------------------------------------------------

@pytest.mark.parametrize(("raw", "shown"), [
    (f"A100{OSC_TITLE}", "A100"),
    (f"{CLEAR}A100", "A100"),
    (f"A{C1_CSI}100", "A100"),
    ("A\x1bP1;2|secret\x1b\\100", "A100"),  # DCS string
    ("A\x1b]52;c;cGF5bG9hZA==\x1b\\100", "A100"),  # OSC 52: write the clipboard
    ("A\x1b]8;;http://evil/\x1b\\link\x1b]8;;\x1b\\", "Alink"),  # a hidden hyperlink
    (f"abc{BIDI}fed", "abcfed"),
    ("a\u2066b\u2069c\u200bd", "abcd"),
    ("tab\tnew\nline\rcr", "tab new line cr"),
    ("bell\x07nul\x00del\x7f", "bellnuldel"),
    ("lone \ud800surrogate", "lone surrogate"),  # cannot even be encoded for output
    ("NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3"),
    ("Ünïcödé 名前 ok", "Ünïcödé 名前 ok"),
    (MARKUP, MARKUP),  # markup is text here; rich gets it as Text, never parsed
    (None, ""),
])
def test_for_terminal(raw: str | None, shown: str) -> None:
    assert for_terminal(raw) == shown


def test_for_terminal_bounds_the_length() -> None:
    out = for_terminal(HUGE, 64)
    assert len(out) == 64 and out.endswith("…")
    assert for_terminal("x" * 64, 64) == "x" * 64
    assert len(for_terminal(OSC_TITLE * 50_000 + "tail", 16)) <= 16


def test_json_output_never_carries_nan_or_infinity() -> None:
    data = {"u": float("nan"), "p": [float("inf"), -float("inf"), 1.5], "s": "NaN", "n": None}
    text = dumps(data)
    assert strict_json(text) == {"u": None, "p": [None, None, 1.5], "s": "NaN", "n": None}
    assert json_safe((1.0, float("nan"))) == [1.0, None]


# -- gpusd top ---------------------------------------------------------------------------------------

def hostile_fleet() -> list[HostView]:
    snap = sim_host("gpu-node-1" + HOSTILE, "2xA100-80GB,1xH100-80GB")
    g0, g1, g2 = snap.gpus
    g0.name = HOSTILE
    g0.processes[0].user = f"[red]mallory{OSC_TITLE}"
    g0.processes[0].command = f"/tmp/{CLEAR}[/]{OSC_TITLE}evil --flag"
    g0.leases[0].user = f"[/]{C1_CSI}eve"
    g1.name = HUGE
    g1.utilization_gpu, g1.power_draw, g1.power_limit = float("nan"), float("inf"), float("nan")
    g2.healthy, g2.error = False, f"GPU is lost{CLEAR}[/bold]"
    snap.driver_version = f"550{OSC_TITLE}"
    good = sim_host("gpu-node-2", "1xA100-80GB")
    return [HostView(snap.hostname, "[/bold]" + snap.node_id, snap), HostView(good.hostname, good.node_id, good)]


@pytest.mark.parametrize("width", [220, 140, 100, 60, 30])
@pytest.mark.parametrize("color", [False, True])
def test_top_renders_hostile_names_without_crashing_or_escapes(width: int, color: bool) -> None:
    text = render_text(hostile_fleet(), width=width, color=color)
    assert_clean(text, colours=color)
    plain = SGR.sub("", text)
    assert "gpu-node-2" in plain  # the good host is there too
    assert max(len(line) for line in plain.splitlines()) <= width
    if width >= 100:
        assert "[/bold]x" in plain  # the markup is shown as the text it is
    if width >= 140:
        assert "mallory" in plain and "evil" in plain and "eve" in plain


def test_top_filter_and_sort_with_nan_readings() -> None:
    for key in ("util", "power", "memory", "free", "temp"):
        assert_clean(render_text(hostile_fleet(), TopState(sort=key), width=160))
    assert "gpu-node-1" in render_text(hostile_fleet(), TopState(filter="mallory"), width=160)


def test_top_error_line_is_sanitised() -> None:
    from rich.console import Console

    console = Console(width=100, force_terminal=True, color_system="truecolor", record=False)
    with console.capture() as cap:
        console.print(render([], message=f"cannot refresh: bad answer {OSC_TITLE}{CLEAR}[/bold]"))
    out = cap.get()
    assert_clean(out, colours=True)
    assert "[/bold]" in out


def test_top_live_view_survives_hostile_names() -> None:
    """The full-screen loop (gpusd top in a terminal) draws a hostile fleet and quits normally."""
    import io

    from rich.console import Console

    from gpusd.views.live import run_live
    from gpusd.views.top import HostBook

    class Keys:
        interactive = True
        calls = 0

        def __enter__(self) -> Keys:  # noqa: PYI034
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def read(self, timeout: float) -> list[str]:
            self.calls += 1
            return ["s"] if self.calls < 3 else ["q"]

    buf = io.StringIO()
    console = Console(file=buf, width=160, height=40, force_terminal=True, color_system="truecolor")
    rc = run_live(hostile_fleet, TopState(), HostBook(), 0.01, console, keys=Keys())  # type: ignore[arg-type]
    assert rc == 0
    out = buf.getvalue()
    # rich's own control sequences (alternate screen, cursor moves) are fine; the hosts' are not
    assert "pwned" not in out and "\x1b[2J" not in out.replace("\x1b[?1049h", "")
    assert not re.findall("[\x07\x9b\u202e]", out)
    assert "mallory" in out and "gpu-node-2" in out


def evil_program(tmp_path: Path) -> subprocess.Popen[bytes]:
    """A process whose command line (argv[0], as `ps` and NVML process lists show it) is hostile."""
    link = tmp_path / f"{OSC_TITLE}[red]evil{CLEAR}"
    link.symlink_to("/bin/sleep")
    return subprocess.Popen([str(link), "30"], stdin=subprocess.DEVNULL)


def test_top_cli_on_fake_nvml_with_hostile_gpu_names_and_commands(fake_nvml, cli_env, tmp_path) -> None:
    proc = evil_program(tmp_path)
    try:
        gpus = make_gpus(2, util_gpu=10)
        gpus[0].name = f"{MARKUP}{OSC_TITLE}{CLEAR}A100"
        gpus[1].name = "\u202eA100\x1b[31m red"
        gpus[0].processes = [FakeProcess(proc.pid, GiB)]
        fake_nvml.write(gpus)
        r = gpusd_cli(["top", "--once", "--local", "--width", "200"], env=cli_env)
        assert r.returncode == 0, r.stderr
        assert_clean(r.stdout)
        assert "[/bold]x" in r.stdout and "evil" in r.stdout
    finally:
        proc.kill()
        proc.wait()


# -- gpusd devices -----------------------------------------------------------------------------------

def test_devices_table_and_json_on_fake_nvml_with_hostile_names(fake_nvml, cli_env) -> None:
    gpus = make_gpus(2, util_gpu=10)
    gpus[0].name = f"{OSC_TITLE}{CLEAR}A100{C1_CSI}"
    gpus[1].name = f"{BIDI}A100[/bold]"
    fake_nvml.write(gpus, driver_version=f"550{OSC_TITLE}")
    r = gpusd_cli(["devices"], env=cli_env)
    assert r.returncode == 0, r.stderr
    assert_clean(r.stdout)
    assert "A100[/bold]" in r.stdout
    r = gpusd_cli(["devices", "--json"], env=cli_env)
    data = strict_json(r.stdout)  # JSON keeps the name as it is: JSON escapes it
    assert data["gpus"][0]["name"] == gpus[0].name


def test_devices_table_of_a_hostile_snapshot() -> None:
    from gpusd.cli.table import render_host

    snap = sim_host("h" + OSC_TITLE, "2xA100-80GB")
    snap.gpus[0].name = HUGE
    snap.gpus[0].processes[0].user = f"{CLEAR}mallory"
    snap.gpus[0].leases[0].user = f"eve{C1_CSI}"
    snap.gpus[1].power_draw = float("nan")
    snap.gpus[1].healthy, snap.gpus[1].error = False, f"lost{OSC_TITLE}"
    text = render_host(snap)
    assert_clean(text)
    assert max(len(line) for line in text.splitlines()) < 1000
    assert "mallory" in text and "eve" in text


# -- gpusd list / scan / watch -----------------------------------------------------------------------

def remote_host(hostname: str, snap: HostSnapshot) -> RemoteHost:
    txt = TxtRecord(node_id=snap.node_id, hostname=hostname, session="default", count=len(snap.gpus))
    return RemoteHost(key=f"{hostname}._gpusd._tcp.local.", txt=txt, addresses=["198.18.0.9"], port=4780,
                      url="http://198.18.0.9:4780/api/v1", snapshot=snap, alive=True)


def test_list_table_is_clean_and_bounded() -> None:
    from gpusd.cli.discover import render_devices

    snap = sim_host("evil", "2xA100-80GB")
    snap.gpus[0].name = HOSTILE
    snap.gpus[1].name = HUGE
    snap.gpus[1].healthy, snap.gpus[1].error = False, HUGE
    host = remote_host(HOSTILE + HUGE, snap)
    text = render_devices(host.devices(), [host])
    assert_clean(text)
    assert len(text) < 2000  # gpusd 0.1 printed the whole name: 27 MB for a fleet of such hosts
    assert "[/bold]x" in text


def test_watch_event_lines_are_clean_and_bounded() -> None:
    snap = sim_host("evil", "1xA100-80GB")
    snap.gpus[0].name = HOSTILE + HUGE
    host = remote_host(HOSTILE + HUGE, snap)
    dev = host.devices()[0]
    for ev in (DiscoveryEvent("host_added", host), DiscoveryEvent("device_added", host, device=dev)):
        line = for_terminal(ev, 512)
        assert_clean(str(ev))
        assert len(str(ev)) < 400 and len(line) <= 512
        assert "[/bold]x" in line


def test_scan_table_is_clean() -> None:
    from gpusd.cli.table import render_table

    rows = [[HOSTILE, OSC_TITLE + "node", "default", "1", "1", f"1x {HUGE}", "198.18.0.9:4780", "gpusd"]]
    text = render_table(["HOST", "NODE", "SESSION", "GPUS", "FREE", "INVENTORY", "ADDRESS", "SOURCE"], rows)
    assert_clean(text)
    assert len(text) < 1000


# the real CLI against a daemon on 127.0.0.1 whose GPU names are hostile

@pytest.fixture
def proc_env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(GPUSD_STATE_DIR=str(tmp_path / "state"), GPUSD_INTERFACES="127.0.0.1", GPUSD_MDNS_FAST="1")
    return env


def test_list_and_watch_cli_against_a_daemon_with_hostile_gpu_names(fake_nvml, proc_env, tmp_path) -> None:
    from daemon_helpers import unique_session

    gpus = make_gpus(2, util_gpu=10)
    gpus[0].name = f"{MARKUP}{OSC_TITLE}{CLEAR}A100"
    gpus[1].name = f"{BIDI}H100{C1_CSI}" + "N" * 60
    fake_nvml.write(gpus)
    env = fake_nvml.env(proc_env)
    session = unique_session("sanitise")
    r = gpusd_cli(["start", "--interface", "127.0.0.1", "--port", "0", "--session", session,
                   "--hostname", "evil-host"], env=env)
    assert r.returncode == 0, r.stderr
    try:
        deadline = time.monotonic() + 20
        while True:
            r = gpusd_cli(["list", "--session", session, "--timeout", "2"], env=env)
            if "evil-host" in r.stdout or time.monotonic() > deadline:
                break
        assert r.returncode == 0, r.stderr
        assert "evil-host" in r.stdout, r.stderr
        assert_clean(r.stdout)
        assert "[/bold]x" in r.stdout
        r = gpusd_cli(["list", "--session", session, "--timeout", "2", "--json"], env=env)
        names = sorted(d["gpu"]["name"] for d in strict_json(r.stdout))
        assert names == sorted(g.name for g in gpus)
        r = gpusd_cli(["watch", "--session", session, "--duration", "3"], env=env)
        assert "evil-host" in r.stdout, r.stderr
        assert_clean(r.stdout)
    finally:
        gpusd_cli(["stop"], env=env)


# -- gpusd leases ------------------------------------------------------------------------------------

def test_leases_table_and_json_with_a_hostile_lease_file(tmp_path, monkeypatch) -> None:
    """Another local user's lease file: its command and user are theirs to choose."""
    from gpusd.alloc import leases as leases_mod
    from gpusd.alloc import queue
    from gpusd.cli.alloc import leases
    from gpusd.model import LeaseInfo

    class Hostile:
        dir = tmp_path

        def leases(self) -> list[LeaseInfo]:
            return [LeaseInfo(lease_id="l1", pid=1, user=f"[red]root{OSC_TITLE}", started=float("nan"),
                              command=f"{CLEAR}rm -rf /{C1_CSI}" + HUGE, device="GPU-1")]

        def mutex_holders(self) -> list[tuple[int, int | None]]:
            return []

    monkeypatch.setattr(leases_mod, "LeaseStore", Hostile)
    monkeypatch.setattr(queue, "waiters", lambda store: [])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert leases(argparse.Namespace(json=False)) == 0
    assert_clean(out.getvalue())
    assert "rm -rf" in out.getvalue() and max(len(x) for x in out.getvalue().splitlines()) < 400
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert leases(argparse.Namespace(json=True)) == 0
    assert strict_json(out.getvalue())["leases"][0]["started"] is None


# -- error messages that quote a peer ----------------------------------------------------------------

def test_cli_error_quoting_a_peer_is_sanitised(monkeypatch, capsys) -> None:
    from gpusd import cli
    from gpusd.errors import GpusdError

    def boom(args: object) -> int:
        raise GpusdError(f"http://198.18.0.9:4780: HTTP 500 {OSC_TITLE}{CLEAR}broken")

    monkeypatch.setattr("gpusd.cli.discover.list_devices", boom)
    rc = cli.main(["list"])
    err = capsys.readouterr().err
    assert rc != 0 and "broken" in err
    assert_clean(err)


# -- the daemon's own JSON (HTTP answers and event streams) ------------------------------------------

@pytest.mark.usefixtures("fast_mdns")
async def test_daemon_json_and_events_never_carry_nan(tmp_path) -> None:
    import aiohttp

    from daemon_helpers import (
        FakeBackend,
        make_snapshot,
        running_daemon,
        unique_session,
    )
    from gpusd.wire.sse import SSEParser

    snap = make_snapshot(2, hostname="nan-host")
    snap.gpus[0].utilization_gpu = float("nan")
    snap.gpus[1].power_draw = float("inf")
    async with running_daemon(tmp_path, unique_session(), "nan-host", backend=FakeBackend(snap)) as d, \
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        for path in ("/api/v1/gpus", "/api/v1/host", "/api/v1/fleet"):
            async with s.get(d.urls[0].removesuffix("/api/v1") + path) as r:
                assert r.status == 200
                strict_json(await r.text())
        async with s.get(d.urls[0] + "/events") as r:
            parser = SSEParser()
            events: list[tuple[str, str]] = []
            while not any(e == "snapshot" for e, _ in events):
                chunk = await r.content.readany()
                assert chunk, "the event stream ended before its first snapshot"
                events.extend(parser.feed(chunk))
            data = strict_json(next(v for e, v in events if e == "snapshot"))
            assert data["gpus"][0]["utilization_gpu"] is None and data["gpus"][1]["power_draw"] is None


def test_hosts_with_nan_from_a_fleet_answer_render(monkeypatch) -> None:
    from gpusd.views.sources import hosts_from_fleet

    snap = sim_host("nan-host", "1xA100-80GB").to_dict()
    snap["gpus"][0]["utilization_gpu"] = float("nan")
    snap["gpus"][0]["name"] = HOSTILE
    views = hosts_from_fleet({"hosts": [{"node_id": "n", "hostname": HOSTILE, "snapshot": snap}, None, 7]})
    assert_clean(render_text(views, width=160))


def test_gpu_without_anything_renders() -> None:
    snap = HostSnapshot(hostname=HUGE, node_id=HUGE, timestamp=time.time(), gpus=[GpuInfo(index=0, uuid=HUGE)])
    text = render_text([HostView(snap.hostname, snap.node_id, snap)], width=120)
    assert_clean(text)
    assert len(text) < 2000
    d = Device(hostname=HUGE, node_id=HUGE, session="s", gpu=snap.gpus[0])
    assert len(str(d)) < 300


def test_cli_log_lines_quoting_a_peer_are_sanitised(monkeypatch, capsys) -> None:
    import logging

    from gpusd import cli

    def chatty(args: object) -> int:
        logging.getLogger("gpusd.discovery.client").info("host %s removed", f"evil{OSC_TITLE}{CLEAR}")
        return 0

    monkeypatch.setattr("gpusd.cli.discover.list_devices", chatty)
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        root.handlers = []
        assert cli.main(["-v", "list"]) == 0
    finally:
        root.handlers, root.level = saved[0], saved[1]
    err = capsys.readouterr().err
    assert "host evil removed" in err
    assert_clean(err)


def test_one_rule_for_bytes_into_a_bounded_json_object() -> None:
    import pytest

    from gpusd.sanitize import json_object

    assert json_object(b'{"a": 1}', 100) == {"a": 1}
    for bad, says in ((b"[1]", "not a JSON object"), (b"{", "not JSON"),
                      (b'{"a": "' + b"x" * 200 + b'"}', "more than 100 bytes")):
        with pytest.raises(ValueError, match=says):
            json_object(bad, 100)
    with pytest.raises(ValueError, match="not JSON"):  # nested past the recursion limit: no RecursionError
        json_object(b"[" * 100_000)


# Modules that decode JSON of another shape (job.py: standard library only, inside users' jobs;
# thresholds.py: a list or an object), and those whose owners change them in parallel.
_JSON_PENDING = {"sanitize.py", "job.py", "thresholds.py", "slurm/jobs.py", "daemon/slurmjobs.py"}


def test_no_other_module_decodes_bytes_into_a_json_object_itself() -> None:
    """``json.loads`` then ``isinstance(d, dict)`` is gpusd.sanitize.json_object's job."""
    import re

    from tests_paths import REPO

    src = REPO / "src" / "gpusd"
    found = []
    for path in src.rglob("*.py"):
        rel = path.relative_to(src).as_posix()
        lines = path.read_text().splitlines()
        found += [f"{rel}:{i + 1}" for i, line in enumerate(lines) if "json.loads(" in line
                  and re.search(r"isinstance\(\w+, dict\)", "\n".join(lines[i:i + 5])) and rel not in _JSON_PENDING]
    assert found == []
