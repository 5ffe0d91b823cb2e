"""Outputs that promised more than they gave: `select --json` (no lease), `gpusd leases` (who is
waiting), threshold lines (which rule), MIG rows in `gpusd devices` (aligned)."""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path

import pytest

from gpusd.cli import main

GiB = 2**30


def cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return rc, out, err


# -- select takes no lease, and says nothing that suggests one -------------------------------------------
def test_select_json_claims_no_lease(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = cli(["select", "--json", "--simulate", "2xA100-80GB"], capsys)
    assert rc == 0
    d = json.loads(out)
    assert set(d) == {"devices", "env", "explain"}, d  # no "lease": null that reads as a lease it never takes
    rc, out, _ = cli(["leases", "--json"], capsys)
    assert json.loads(out)["leases"] == []  # and indeed none was taken
    rc, out, _ = cli(["select", "--help"], capsys)
    assert "takes no lease" in out


# -- gpusd leases lists who is waiting --------------------------------------------------------------
def test_leases_lists_the_waiters(capsys: pytest.CaptureFixture[str]) -> None:
    from gpusd.alloc import queue
    from gpusd.alloc.leases import LeaseStore

    store = LeaseStore()
    first = queue.enqueue(store, 2, "python train.py --big")
    time.sleep(0.01)
    second = queue.enqueue(store, 1, "python eval.py")
    try:
        rc, out, _ = cli(["leases"], capsys)
        assert rc == 0
        assert "2 job(s) waiting" in out
        lines = out.splitlines()
        head = lines.index(next(ln for ln in lines if ln.startswith("#")))
        assert lines[head].split() == ["#", "USER", "PID", "GPUS", "PRIORITY", "WAITING", "COMMAND"]
        rows = [ln.split(None, 6) for ln in lines[head + 2:head + 4]]
        assert [(r[0], r[2], r[3], r[4], r[6]) for r in rows] == [
            ("1", str(os.getpid()), "2", "normal", "python train.py --big"),
            ("2", str(os.getpid()), "1", "normal", "python eval.py")]
        assert all(r[5].endswith("s") for r in rows)
        rc, out, _ = cli(["leases", "--json"], capsys)
        waiting = json.loads(out)["waiting"]
        assert [(w["position"], w["pid"], w["count"], w["command"]) for w in waiting] == [
            (1, os.getpid(), 2, "python train.py --big"), (2, os.getpid(), 1, "python eval.py")]
        assert all(isinstance(w["since"], float) and isinstance(w["user"], str) for w in waiting)
    finally:
        first.close()
        second.close()
    rc, out, _ = cli(["leases"], capsys)
    assert "0 job(s) waiting" in out and "WAITING" not in out


def test_hostile_ticket_is_shown_without_harm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A ticket is another user's file: junk, control characters, a link — never a traceback."""
    from gpusd.alloc.leases import LeaseStore

    store = LeaseStore()
    store.ensure()
    bad = store.dir / "queue-000000000007-4242.ticket"
    bad.write_text(json.dumps({"pid": "x", "user": "ev\x1b[2Jil", "count": True, "since": "now",
                               "command": "rm -rf /\x07" + "A" * 1000}))
    secret = tmp_path / "secret"
    secret.write_text(json.dumps({"command": "SECRET"}))
    link = store.dir / "queue-000000000008-4243.ticket"
    os.symlink(secret, link)
    fds = []
    try:
        for p in (bad, secret):
            fd = os.open(p, os.O_RDONLY)
            fcntl.flock(fd, fcntl.LOCK_EX)  # a live waiter holds its ticket
            fds.append(fd)
        rc, out, err = cli(["leases"], capsys)
        assert rc == 0 and "Traceback" not in err
        assert "\x1b" not in out and "\x07" not in out and "SECRET" not in out
        row = next(ln for ln in out.splitlines() if ln.startswith("1 "))
        # the pid in the ticket is junk, and its file name is no more trustworthy: no pid is shown
        assert row.split()[:3] == ["1", "evil", "-"] and len(row) < 200
        rc, out, _ = cli(["leases", "--json"], capsys)
        w = json.loads(out)["waiting"][0]
        assert (w["pid"], w["count"]) == (None, None) and len(w["command"]) <= 1024
        assert w["since"] == pytest.approx(bad.stat().st_ctime)  # the kernel's time, not the file's "now"
        assert w["priority_name"] == "normal"
    finally:
        for fd in fds:
            os.close(fd)


# -- threshold lines name the rule ------------------------------------------------------------------
def test_threshold_lines_name_the_rule() -> None:
    from daemon_helpers import make_snapshot
    from gpusd.discovery.types import Device, DiscoveryEvent, RemoteHost
    from gpusd.thresholds import ThresholdEngine, parse_rule
    from gpusd.wire.txt import TxtRecord

    snap = make_snapshot(1, hostname="gpu-node-3", util=97.0)
    engine = ThresholdEngine([parse_rule("utilization>90", name="busy")])
    (ev,) = engine.update(snap, now=100.0)
    assert "busy: utilization>90%" in ev.message  # the daemon's event and log line: name and rule
    host = RemoteHost(key="k", txt=TxtRecord(node_id="0", hostname="gpu-node-3", session="default", count=1))
    dev = Device(hostname="gpu-node-3", node_id="0", session="default", gpu=snap.gpus[0], url=None)
    line = str(DiscoveryEvent("threshold_exceeded", host, device=dev, data=ev.to_dict()))
    assert line.startswith("threshold_exceeded gpu-node-3:0 ")
    assert "rule 'busy: utilization>90%'" in line and "value 97" in line  # as `gpusd watch` prints it
    hostile = dict(ev.to_dict(), rule="x\x1b[31m", expr=None, value="NaN")
    line = str(DiscoveryEvent("threshold_exceeded", host, device=dev, data=hostile))
    assert "\x1b" not in line and "rule 'x?[31m'" in line


# -- MIG rows line up with the GPU rows ---------------------------------------------------------------
def test_mig_rows_are_aligned(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "mig.json"
    spec.write_text(json.dumps({"gpus": [{"model": "A100-80GB", "mig": ["3g.40gb", "2g.20gb"]},
                                         {"model": "RTX4090"}]}))
    rc, out, _ = cli(["devices", "--simulate", str(spec)], capsys)
    assert rc == 0
    lines = out.splitlines()
    header, rule, rows = lines[1], lines[2], lines[3:]
    starts = [i for i, c in enumerate(rule) if c == "-" and (i == 0 or rule[i - 1] == " ")]
    assert len(starts) == len(header.split()) == 9
    mig = [r for r in rows if r.startswith("0:")]
    assert len(mig) == 2
    for row in rows:
        assert len(row) <= len(rule)  # no cell wider than its column (a MIG UUID was 40 wide)
        cells = [row[a:b].strip() for a, b in zip(starts, starts[1:] + [len(rule)])]
        assert all(cells), (row, cells)  # every column filled: "-" where a slice has no reading
        assert all(row[s - 1] == " " for s in starts[1:] if s - 1 < len(row))
    assert [r.split()[-1] for r in mig] == ["ok", "ok"]
    assert max(len(r) for r in rows) == max(len(r) for r in rows if not r.startswith("0:"))
