"""Numbers and messages a newcomer reads (issue 18, items 10, 12, 13, 16, 17): the version, one
vocabulary for durations, what a table's column means, and errors that say what is wrong."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import gpusd_cli
from gpusd.cli import main
from tests_paths import SRC

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _loopback_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUSD_INTERFACES", "127.0.0.1")
    monkeypatch.delenv("GPUSD_TOKEN", raising=False)
    monkeypatch.delenv("GPUSD_TOKEN_FILE", raising=False)


def cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return rc, out, err


# -- item 12: the version ------------------------------------------------------------------------------
def test_version_is_0_3_in_development_and_the_docs_say_so(capsys: pytest.CaptureFixture[str]) -> None:
    import gpusd

    rc, out, _ = cli(["--version"], capsys)
    assert rc == 0 and out.strip() == f"gpusd {gpusd.__version__}"
    assert gpusd.__version__ == "0.4.0.dev0"
    for doc in ("README.md", "docs/cli.md"):
        text = (ROOT / doc).read_text()
        assert gpusd.__version__ in text and "0.4 in development" in text, doc
    assert "0.1.0" not in (ROOT / "docs/wire-format.md").read_text()


# -- item 13: one vocabulary for durations --------------------------------------------------------------
@pytest.mark.parametrize("argv", [["start", "--interval", "-1"], ["start", "--interval", "0"]])
def test_a_positive_duration_refuses_negative_and_zero_alike(argv: list[str], capsys) -> None:
    rc, _, err = cli([*argv, "--simulate", "1xT4"], capsys)
    assert rc == 2
    assert "argument --interval: must be a duration longer than 0" in err, err


@pytest.mark.parametrize("argv, flag", [
    (["report", "--since", "-1h"], "--since"),
    (["reserve", "--for", "-5m"], "--for"),
    (["top", "--once", "--history", "-1h"], "--history"),
    (["hostfile", "-n", "1", "--for", "-2h"], "--for"),
])
def test_a_negative_duration_with_a_unit_is_a_wrong_value_not_a_missing_one(argv: list[str], flag: str,
                                                                             capsys) -> None:
    rc, _, err = cli(argv, capsys)
    assert rc == 2 and "expected one argument" not in err, err
    assert f"argument {flag}: must be a duration longer than 0" in err, err


def test_every_duration_flag_takes_the_same_units(capsys) -> None:
    from gpusd.cli import build_parser

    args = build_parser("run").parse_args(["run", "--wait", "--timeout", "5m", "--", "true"])
    assert args.timeout == 300
    args = build_parser("start").parse_args(["start", "--interval", "500s"])
    assert args.interval == 500
    from gpusd.units import parse_duration

    assert parse_duration("90s") == 90 and parse_duration("2h") == 7200 and parse_duration("1.5m") == 90
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration("nan")


def test_report_from_blames_from_not_since(capsys) -> None:
    rc, _, err = cli(["report", "--db", "/nonexistent", "--from", "2026-13-01"], capsys)
    assert rc == 2 and "--from" in err and "--since" not in err, err
    rc, _, err = cli(["report", "--db", "/nonexistent", "--to", "tomorrow"], capsys)
    assert rc == 2 and "--to" in err and "--since" not in err, err


# -- item 13: errors that say what is wrong ------------------------------------------------------------------
def test_include_of_a_gpu_that_does_not_exist_says_so(capsys) -> None:
    rc, _, err = cli(["select", "--include", "7", "--simulate", "4xA100-80GB"], capsys)
    assert rc == 4 and "no GPU 7" in err and "not in --include" not in err, err
    rc, _, err = cli(["select", "-n", "5", "--simulate", "4xA100-80GB"], capsys)
    assert rc == 4 and "only 4 GPU" in err, err


def test_a_scenario_error_is_said_once(tmp_path: Path, capsys) -> None:
    spec = tmp_path / "s.json"
    spec.write_text('{"gpus": [{"util": {"min": 10}}]}')
    rc, _, err = cli(["devices", "--simulate", str(spec)], capsys)
    assert rc == 2 and err.count("gpus[0].util") == 1, err


def test_watch_interrupted_exits_130() -> None:
    env = dict(os.environ, PYTHONPATH=str(SRC), GPUSD_INTERFACES="127.0.0.1")
    p = subprocess.Popen([sys.executable, "-m", "gpusd", "watch", "--session", f"nobody-{os.getpid()}",
                          "--interface", "127.0.0.1"], env=env, stderr=subprocess.PIPE, text=True)
    time.sleep(3)  # past start-up, browsing
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 130, err
    assert "Traceback" not in err and "interrupted" in err


# -- items 16, 17: the fleet secret ------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [["reserve", "-n", "1"], ["launch", "-n", "1", "command", "--", "true"],
                                  ["hostfile", "-n", "1"], ["ray", "up", "-n", "1"]])
def test_without_a_secret_the_pool_says_how_to_make_one(argv: list[str], capsys) -> None:
    rc, _, err = cli(argv, capsys)
    assert rc == 2
    assert "openssl rand -hex 32 > fleet.key" in err and "chmod 600" in err and "--token-file" in err, err


# -- item 10: what the columns mean -------------------------------------------------------------------------
def test_jobs_gpus_column_is_a_count_and_the_legend_only_when_needed(monkeypatch, capsys) -> None:
    from gpusd.jobs import record

    jobs = [record.JobRecord("aaaa1111", os.getpid(), user="me", uid=os.geteuid(), command="sleep 1",
                             indices=[3], state="running", started=time.time() - 7200)]
    monkeypatch.setattr(record, "list_jobs", lambda cleanup=False: list(jobs))
    rc, out, _ = cli(["jobs"], capsys)
    assert rc == 0
    header, _, row = out.splitlines()[:3]
    cells = re.split(r"\s{2,}", row)
    assert cells[header.split().index("GPUS")] == "1 (3)", out
    assert "2h" in row and "7200s" not in row
    assert "preemptible" not in out  # no job is
    jobs.append(record.JobRecord("bbbb2222", os.getpid(), user="me", uid=os.geteuid(), command="x",
                                 indices=[0, 1], state="running", preemptible=True, started=time.time()))
    rc, out, _ = cli(["jobs"], capsys)
    assert "2 (0,1)" in out and "* preemptible" in out


def test_reservations_show_when_they_end_not_the_ttl(monkeypatch, capsys) -> None:
    from gpusd.cli import pool as cli_pool
    from gpusd.pool import client

    now = time.time()
    found = [{"lease_id": "ab12", "host": "node-1", "devices": [{"index": 0}], "user": "me", "remote_from": "x",
              "expires": now + 28, "ends": now + 2 * 3600 - 30, "command": "n"},
             {"lease_id": "cd34", "host": "node-2", "devices": [{"index": 1}], "user": "me", "remote_from": "x",
              "expires": now + 28, "command": None}]
    monkeypatch.setenv("GPUSD_TOKEN", "x" * 64)
    monkeypatch.setattr(cli_pool, "_hosts", lambda args, key: [])
    monkeypatch.setattr(client, "reservations", lambda key, hosts, mine=None: found)
    rc, out, _ = cli(["reservations", "--all"], capsys)
    assert rc == 0 and "EXPIRES IN" not in out
    lines = out.splitlines()
    assert "in 1h59m" in lines[2] and "28s" not in lines[2], out
    assert "with its holder (ttl 2" in lines[3], out


def test_the_daemon_keeps_the_end_its_holder_announced() -> None:
    """The renewer says how long it will keep renewing (a duration, never a time); the daemon
    shows it as ``ends`` on its own clock."""
    import asyncio
    from types import SimpleNamespace

    from gpusd.daemon import pool as dpool
    from gpusd.daemon.config import DaemonConfig

    held = dpool.Held("ab12", SimpleNamespace(env=lambda: {}, release=lambda: None, lease=None), "me", None, None, 30.0,
                      time.time(), time.monotonic(), time.monotonic() + 30)
    p = dpool.Pool(SimpleNamespace(hostname="h", node_id="n", config=DaemonConfig()))  # type: ignore[arg-type]
    p._renew = lambda held, remaining, ttl, ends=None: None  # type: ignore[method-assign]
    p.held["ab12"] = held
    status, out = asyncio.run(p.renew("ab12", {"left": 7200}))
    assert status == 200 and out["ends"] == pytest.approx(time.time() + 7200, abs=5)
    status, out = asyncio.run(p.renew("ab12", {"left": "soon"}))  # ignored: the last end stays
    assert status == 200 and out["ends"] == pytest.approx(time.time() + 7200, abs=5)
    p.executor.shutdown()
    p.keeping.shutdown()


def test_a_reserved_gpu_in_list_reads_as_when_it_ends_not_its_ttl() -> None:
    """A 2-hour reservation renewed every 10 s: `list` says until when it lasts (its holder's --for),
    never the TTL's 28 s; without an announced end, that it is renewed."""
    from gpusd.cli.discover import render_devices
    from gpusd.discovery.types import Device
    from gpusd.model import GpuInfo, LeaseInfo

    ends = time.time() + 2 * 3600
    g = GpuInfo(index=0, uuid="GPU-1", name="NVIDIA A100", memory_total=1, memory_used=0,
                leases=[LeaseInfo("ab12", 1, user=None, expires=time.time() + 28, remote_from="x", ends=ends)])
    text = render_devices([Device(hostname="h", node_id="n", session="s", gpu=g)], [])
    assert "reserved ?" not in text and "ttl" not in text, text
    assert f"reserved (until {time.strftime('%H:%M', time.localtime(ends))})" in text, text
    g.leases = [LeaseInfo("ab12", 1, user=None, expires=time.time() + 28, remote_from="x")]
    text = render_devices([Device(hostname="h", node_id="n", session="s", gpu=g)], [])
    assert "reserved (renewed)" in text and "ttl" not in text, text


def test_a_bad_value_is_one_line_without_the_usage_block() -> None:
    r = gpusd_cli(["select", "--count", "x"])
    assert r.returncode == 2 and r.stderr.splitlines() == [
        "gpusd select: error: argument -n/--count: invalid int value: 'x'", "see gpusd select --help"], r.stderr


def _host(name: str, gpus: int, verified: bool | None) -> object:
    from gpusd.discovery.types import RemoteHost
    from gpusd.model import GpuInfo, HostSnapshot
    from gpusd.wire.txt import TxtRecord

    snap = HostSnapshot(hostname=name, node_id=name, timestamp=time.time(),
                        gpus=[GpuInfo(index=i, uuid=f"GPU-{name}-{i}") for i in range(gpus)])
    txt = TxtRecord(hostname=name, node_id=name, session="s", count=gpus)
    return RemoteHost(key=name, txt=txt, snapshot=snap, alive=True,
                      url="http://127.0.0.1:1/api/v1", verified=verified)


def test_reserve_more_than_the_largest_host_says_its_size(capsys) -> None:
    from gpusd.pool.client import _largest

    hosts = [_host("node-1", 2, True), _host("node-2", 1, True), _host("big", 8, False)]
    why = _largest(hosts, 5, None, True)  # type: ignore[arg-type]
    assert "the largest verified host, node-1, has 2" in why and "--per-host" in why
    assert _largest(hosts, 2, None, True) == ""  # type: ignore[arg-type]
    assert "no verified host" in _largest([_host("x", 4, False)], 1, None, True)  # type: ignore[arg-type]


def test_unverified_hosts_are_said_once_with_a_count(capsys) -> None:
    from gpusd.cli.pool import say_unverified

    say_unverified([_host(f"stranger-{i}", 1, False) for i in range(4)] + [_host("ok", 1, True)])  # type: ignore[list-item]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "left out 4 host(s)" in err and "ok" not in err.split(":", 2)[2], err


# -- the newcomer's pass: what else was found ------------------------------------------------------------
@pytest.mark.parametrize("extra", [[], ["--foreground"]])
def test_a_state_directory_that_cannot_be_made_is_one_line(extra: list[str]) -> None:
    r = gpusd_cli(["start", "--state-dir", "/proc/gpusd-nope/state", "--simulate", "1xT4", "--port", "0",
                   "--interface", "127.0.0.1", *extra], timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("gpusd: cannot create the state directory /proc/gpusd-nope/state"), r.stderr


@pytest.mark.parametrize("argv, why", [
    (["run", "--wait", "-n", "5", "--simulate", "2xT4", "--", "true"], "only 2 GPU"),
    (["select", "--wait", "--include", "7", "--simulate", "2xT4"], "no GPU 7"),
])
def test_a_wait_that_can_never_end_is_refused_at_once(argv: list[str], why: str, tmp_path: Path) -> None:
    """--wait for more GPUs than the machine has waited for ever, silently."""
    env = dict(os.environ, PYTHONPATH=str(SRC), GPUSD_LOCK_DIR=str(tmp_path / "locks"), GPUSD_LEASE_SOCKET="off",
               GPUSD_STATE_DIR=str(tmp_path / "state"))
    r = gpusd_cli(argv, env=env, timeout=60)
    assert r.returncode == 4 and why in r.stderr and "waiting cannot help" in r.stderr, r.stderr


def test_top_width_must_be_a_width(capsys) -> None:
    rc, out, err = cli(["top", "--once", "--local", "--simulate", "1xT4", "--width", "-3"], capsys)
    assert rc == 2 and "--width" in err and out == ""


@pytest.mark.parametrize("argv", [["run", "--grace", "-1", "--", "true"],
                                  ["launch", "--grace", "-1", "--placement", "x", "command", "--", "true"]])
def test_grace_periods_are_durations_like_any_other(argv: list[str], capsys) -> None:
    """launch --grace took any float (a negative one too); run --grace said it in other words."""
    rc, _, err = cli(argv, capsys)
    assert rc == 2 and "argument --grace: must be a duration 0 or more" in err, err


def test_an_unknown_command_is_not_offered_the_unlisted_one(capsys) -> None:
    rc, _, err = cli(["bogus-command"], capsys)
    assert rc == 2 and "invalid choice: 'bogus-command'" in err and "'devices'" in err
    assert "fleet-job" not in err  # run --fleet's remote entry point, not a command for people


def test_the_daemons_record_of_a_reservation_carries_its_end_to_every_view(tmp_path, monkeypatch) -> None:
    """The renewal's announced end is written into the lease record, so the snapshot's LeaseInfo (what
    `list`, `devices` and the API show) carries it."""
    from gpusd.alloc.handle import Holder
    from gpusd.alloc.leases import LeaseStore

    store = LeaseStore()
    lease = store.acquire(["GPU-x"], shared=False, memory=None, holder=Holder(pid=os.getpid(), user="me"))
    assert lease is not None
    try:
        ends = time.time() + 7200
        store.rewrite(lease, expires=time.time() + 30, ends=ends)
        [info] = [le for le in store.leases() if le.lease_id == lease.lease_id]
        assert info.ends == pytest.approx(ends)
    finally:
        lease.release()


# -- whole-number flags: one rule, each flag's own words --------------------------------------------------
@pytest.mark.parametrize("argv, said", [
    (["top", "--once", "--width", "19"], "argument --width: must be a number of columns from 20 to 10000, not '19'"),
    (["top", "--once", "--width", "wide"], "argument --width: must be a number of columns from 20 to 10000"),
    (["hostfile", "-n", "1", "--port", "0"], "argument --port: a TCP port is 1-65535, not '0'"),
    (["hostfile", "-n", "1", "--port", "65536"], "argument --port: a TCP port is 1-65535, not '65536'"),
    (["hostfile", "-n", "1", "--port", "http"], "argument --port: a TCP port is 1-65535, not 'http'"),
    (["notify", "-n", "1", "--webhook", "http://127.0.0.1/", "--webhook-attempts", "21"],
     "argument --webhook-attempts: must be a whole number from 1 to 20, not '21'"),
    (["notify", "-n", "1", "--webhook", "http://127.0.0.1/", "--webhook-attempts", "x"],
     "argument --webhook-attempts: must be a whole number from 1 to 20, not 'x'"),
])
def test_a_whole_number_out_of_its_range_is_a_usage_error_in_its_flags_words(argv: list[str], said: str,
                                                                             capsys) -> None:
    rc, _, err = cli(argv, capsys)
    assert rc == 2 and said in err, err


def test_a_whole_number_at_either_end_of_its_range_is_taken() -> None:
    from gpusd.cli import build_parser

    assert build_parser("top").parse_args(["top", "--once", "--width", "20"]).width == 20
    assert build_parser("hostfile").parse_args(["hostfile", "-n", "1", "--port", "65535"]).port == 65535
    assert build_parser("hostfile").parse_args(["hostfile", "-n", "1", "--port", "1"]).port == 1
    args = build_parser("notify").parse_args(["notify", "-n", "1", "--webhook-attempts", "20"])
    assert args.webhook_attempts == 20
