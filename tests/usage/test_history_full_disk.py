"""A full disk under the usage history loses nothing the daemon could know (docs/history.md, "A full
disk"): what the recorder cannot write (SQLITE_FULL, ENOSPC) is kept in memory, bounded, and written in
order when the disk has room again, with one log line when writing fails and one when it works again.

The first test fills a real disk: a small tmpfs in a private mount namespace (``unshare -m``), as
tests/alloc/test_full_disk.py does; the second needs no root: SQLite's ``max_page_count`` makes the
database itself full (the same SQLITE_FULL), then gives it room.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpusd.usage.db import connect
from gpusd.usage.recorder import Recorder

TESTS = Path(__file__).resolve().parent.parent
T0 = 1_800_000_000.0

# Shared by the driver (run in the namespace) and the tests here: a host of one GPU whose samples show
# the given processes (pid) and leases (id).
SNAPSHOTS = r'''
from gpusd.model import GpuInfo, HostSnapshot, LeaseInfo, ProcessInfo


def snap(t, procs=(), leases=()):
    g = GpuInfo(index=0, uuid="GPU-0", name="A100", memory_total=1 << 34, utilization_gpu=50.0, power_draw=200.0,
                processes=[ProcessInfo(pid=p, user="root", command=f"job {p}") for p in procs],
                leases=[LeaseInfo(lease_id=le, pid=1, user="root", command=f"lease {le}") for le in leases])
    return HostSnapshot(hostname="h", node_id="n", timestamp=t, gpus=[g])
'''

DRIVER = SNAPSHOTS + r'''
import json, logging, os, subprocess, sys, time
from pathlib import Path

from gpusd.usage import recorder as recorder_mod
from gpusd.usage.recorder import Recorder

logging.basicConfig(level=logging.WARNING, format="LOG %(message)s")
mnt = Path(sys.argv[1])
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mnt)], check=True)
T0 = float(sys.argv[2])
out = {}


def fill():
    fd = os.open(mnt / "fill", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)


def kept(rec):
    return getattr(rec, "kept", 0)


def wait_kept(rec, n=1):
    end = time.monotonic() + (10 if hasattr(rec, "kept") else 1)
    while kept(rec) < n and time.monotonic() < end:
        time.sleep(0.02)


def rows(db):
    import sqlite3
    c = sqlite3.connect(db)
    try:
        return [list(r) for r in c.execute("SELECT kind, key, gpus, start, last, ended, gpu_s FROM jobs ORDER BY id")]
    finally:
        c.close()


db = mnt / "history.sqlite"
rec = Recorder(db, 1.0)
rec.lease_started("A", "root", 0, "lease A", ["GPU-0"], T0)
for i in range(3):
    rec.submit(snap(T0 + i, procs=[100], leases=["A"]))
rec.flush()
fill()
t = T0 + 3
t_grant = time.monotonic()
out["grant_returned"] = rec.lease_started("B", "root", 0, "lease B", ["GPU-0"], t)  # the first write to fail
out["grant_s"] = time.monotonic() - t_grant
for i in range(3):  # a process that runs only while the disk is full; lease A ends then
    rec.submit(snap(t + i, procs=[200], leases=["A", "B"] if i < 2 else ["B"]))
    if i == 1:
        rec.lease_ended("A", t + 1.5)
rec.lease_ended("B", t + 2.5)
rec.lease_started("C", "root", 0, "lease C", ["GPU-0"], t + 2.6)  # shorter than a sample
rec.lease_ended("C", t + 2.8)
wait_kept(rec, 8)
time.sleep(1.5)  # retried at least once meanwhile, on a disk still full
out["kept_while_full"], out["errors_while_full"] = kept(rec), rec.errors
(mnt / "fill").unlink()
for i in range(3, 6):
    rec.submit(snap(t + i, procs=[300]))
rec.flush()
out["kept_after"], out["lost"], out["errors"] = kept(rec), getattr(rec, "lost", 0), rec.errors
rec.close()
out["rows"] = rows(db)

# the bound: at most KEEP_SAMPLES samples kept, the oldest dropped and counted
recorder_mod.KEEP_SAMPLES = 5
db2 = mnt / "bounded.sqlite"
rec = Recorder(db2, 1.0)
rec.submit(snap(T0, procs=[1]))
rec.flush()
fill()
for i in range(1, 21):
    rec.submit(snap(T0 + i, procs=[1000 + i]))
wait_kept(rec, 5)
time.sleep(0.5)
out["bounded_kept"], out["bounded_lost"] = kept(rec), getattr(rec, "lost", 0)
(mnt / "fill").unlink()
rec.submit(snap(T0 + 21))
rec.flush()
rec.close()
out["bounded_rows"] = rows(db2)

# a daemon that starts while the disk is full: its history is opened once there is room
recorder_mod.KEEP_SAMPLES = 600
fill()
db3 = mnt / "late.sqlite"
try:
    rec = Recorder(db3, 1.0)
except Exception as exc:
    out["late_open"] = repr(exc)
else:
    rec.lease_started("D", "root", 0, "lease D", ["GPU-0"], T0)
    for i in range(3):
        rec.submit(snap(T0 + i, procs=[400], leases=["D"]))
    rec.lease_ended("D", T0 + 2.5)
    wait_kept(rec, 5)
    (mnt / "fill").unlink()
    rec.submit(snap(T0 + 3))
    rec.flush()
    rec.close()
    out["late_rows"] = rows(db3)
print("RESULT " + json.dumps(out))
'''


def _jobs(rows: list[list]) -> dict[str, list]:
    return {r[1].rsplit("@", 1)[0]: r for r in rows}


@pytest.fixture(scope="module")
def full_disk(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("mounting a small tmpfs needs root and unshare(1)")
    tmp = tmp_path_factory.mktemp("fulldisk")
    mnt = tmp / "mnt"
    mnt.mkdir()
    driver = tmp / "driver.py"
    driver.write_text(DRIVER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent / "src"), str(TESTS)]))
    r = subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, str(driver), str(mnt),
                        str(T0)], env=env, capture_output=True, text=True, timeout=120)
    lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):]), r.stderr


def test_every_job_and_lease_of_a_full_disk_is_in_the_history_once_it_has_room(full_disk):
    out, log = full_disk
    # the disk really was full: nothing was written (8 items kept), or, without the keeping, failed
    assert out["kept_while_full"] == 8 or out["errors_while_full"] > 0
    by = {":".join(k.split(":")[:2]): v for k, v in _jobs(out["rows"]).items()}
    assert set(by) == {"l:A", "l:B", "l:C", "p:100", "p:200", "p:300"}
    assert len(out["rows"]) == 6  # each once
    kind, _, gpus, start, last, ended, gpu_s = by["l:A"]
    assert (kind, json.loads(gpus), start, ended) == ("lease", ["GPU-0"], T0, T0 + 4.5)  # its told end
    assert by["l:B"][3] == T0 + 3 and by["l:B"][5] == T0 + 5.5
    assert by["l:C"][3] == T0 + 5.6 and by["l:C"][5] == pytest.approx(T0 + 5.8)
    assert by["l:C"][6] == pytest.approx(0.2)  # its GPU for its 0.2 s, between two samples
    assert by["p:200"][3] == T0 + 3 and by["p:200"][5] == T0 + 5  # seen only while the disk was full
    assert by["p:100"][5] == T0 + 2
    assert by["p:300"][3] == T0 + 6
    assert out["kept_after"] == 0 and out["lost"] == 0 and out["errors"] == 0
    # the grant did not wait for a disk that has no room (its record is kept, not lost)
    assert out["grant_returned"] is True and out["grant_s"] < 0.5
    # one line when writing fails, one when everything kept is written
    assert sum("cannot write" in line and "history.sqlite" in line for line in log.splitlines()) == 1, log
    assert sum("again after" in line and "history.sqlite" in line for line in log.splitlines()) == 1, log


def test_a_full_disk_keeps_a_bounded_number_of_samples_the_oldest_dropped_and_logged(full_disk):
    out, log = full_disk
    pids = sorted(int(k.split(":")[1]) for k in _jobs(out["bounded_rows"]) if k.startswith("p:"))
    assert pids == [1, 1016, 1017, 1018, 1019, 1020]  # the newest five kept, and the first
    assert out["bounded_kept"] == 5 and out["bounded_lost"] == 15
    assert "15 sample(s) or event(s) dropped" in log, log


def test_a_database_that_is_full_for_a_while_gets_every_job_when_it_has_room(tmp_path):
    """No root: SQLite's page limit fills the database itself (SQLITE_FULL on the very statements a
    full disk fails), then is lifted."""
    ns: dict = {}
    exec(SNAPSHOTS, ns)  # noqa: S102 - the shared snapshot maker
    snap = ns["snap"]
    db = tmp_path / "history.sqlite"
    rec = Recorder(db, 1.0)
    try:
        rec.submit(snap(T0, procs=[1]))
        rec.flush()
        # the writer is idle (flushed): its connection's page limit (a per-connection setting) is set here
        assert rec.acc is not None
        conn = rec.acc.conn
        conn.execute(f"PRAGMA max_page_count={conn.execute('PRAGMA page_count').fetchone()[0]}")
        pids = list(range(2, 200))
        for i, pid in enumerate(pids):  # many short jobs: new rows need new pages, which are refused
            rec.lease_started(f"L{pid}", "root", 0, "x" * 2000, ["GPU-0"], T0 + 1 + i)
            rec.submit(snap(T0 + 1 + i + 0.5, procs=[pid], leases=[f"L{pid}"]))
            rec.lease_ended(f"L{pid}", T0 + 1 + i + 0.9)
        end = time.monotonic() + 10
        while not (getattr(rec, "kept", 0) or rec.errors) and time.monotonic() < end:
            time.sleep(0.02)
        time.sleep(0.3)
        assert getattr(rec, "kept", 0) or rec.errors  # the database was full
        conn.execute("PRAGMA max_page_count=1073741823")  # room again (the writer only retries meanwhile)
        rec.flush()
        end = time.monotonic() + 10
        while getattr(rec, "kept", 0) and time.monotonic() < end:
            time.sleep(0.05)
        kept_after, lost, errors = getattr(rec, "kept", 0), getattr(rec, "lost", 0), rec.errors
    finally:
        rec.close()
    conn = connect(db, readonly=True)
    try:
        got = conn.execute("SELECT kind, key, start, ended FROM jobs").fetchall()
    finally:
        conn.close()
    leases = {k.rsplit("@", 1)[0] for kind, k, _, _ in got if kind == "lease"}
    procs = {int(k.split(":")[1]) for kind, k, _, _ in got if kind == "process"}
    assert leases == {f"l:L{p}" for p in pids}
    assert procs == {1, *pids}
    assert all(ended is not None for *_, ended in got)
    assert kept_after == 0 and lost == 0 and errors == 0


def test_a_daemon_started_on_a_full_disk_records_its_history_once_the_disk_has_room(full_disk):
    out, log = full_disk
    assert "late_open" not in out, out.get("late_open")  # not a daemon without history until it restarts
    by = {":".join(k.split(":")[:2]): v for k, v in _jobs(out["late_rows"]).items()}
    assert set(by) == {"l:D", "p:400"}
    assert (by["l:D"][3], by["l:D"][5]) == (T0, T0 + 2.5)
    assert "late.sqlite" in log and "opened when the disk has room" in log
