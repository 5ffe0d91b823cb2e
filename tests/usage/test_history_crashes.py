"""The history loses no lease the daemon granted, however the daemon ends (docs/history.md, "Crashes and
restarts"): a lease's record is written when it is granted and closed when its holder's connection ends,
or, when the daemon was killed meanwhile, by the next daemon at the time it was last known held."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from authority_helpers import DaemonProcess, wait_for
from fakenvml import make_gpus

GPUSD = [sys.executable, "-m", "gpusd"]
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the lease authority is root's daemon")



def _lease_rows(db) -> list[tuple]:
    from gpusd.usage.db import connect

    conn = connect(db, readonly=True)
    try:
        return conn.execute("SELECT command, gpus, start, ended, gpu_s FROM jobs WHERE kind='lease'").fetchall()
    finally:
        conn.close()


def test_every_lease_the_daemon_granted_is_in_the_history_across_kill_9(fake_nvml, cli_env, tmp_path):
    import json

    gpus = make_gpus(2)
    fake_nvml.write(gpus)
    out = tmp_path / "out"
    out.mkdir()
    # a sample every 5 s: the jobs below come and go between two samples, as short jobs do between 1 s ones
    daemon = DaemonProcess(cli_env, tmp_path / "state", "--interval", "5")
    walls: dict[str, float] = {}  # job -> how long its gpusd run lasted
    procs: list[subprocess.Popen] = []

    def job(name: str, seconds: float) -> subprocess.Popen:
        p = subprocess.Popen([*GPUSD, "run", "--", "sh", "-c",
                              f'echo "$CUDA_VISIBLE_DEVICES" > {out / name}; sleep {seconds}; : {name}'],
                             env=cli_env, start_new_session=True)
        procs.append(p)
        return p

    try:
        for r in range(3):
            daemon.start()
            t0 = time.monotonic()
            assert job(f"quick-{r}", 0.3).wait(60) == 0  # ends while the daemon runs
            walls[f"quick-{r}"] = time.monotonic() - t0
            cut = [job(f"cut-{r}-{i}", 1.0) for i in range(2)]
            t0 = time.monotonic()
            assert wait_for(lambda r=r: all((out / f"cut-{r}-{i}").exists() for i in range(2)))  # both hold a GPU
            daemon.kill9()  # while both run
            for i, p in enumerate(cut):
                assert p.wait(60) == 0
                walls[f"cut-{r}-{i}"] = time.monotonic() - t0
        daemon.start()  # the next daemon closes what the killed one left open
        time.sleep(0.5)
        daemon.stop()
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        daemon.kill9()
    rows = _lease_rows(tmp_path / "state" / "history.sqlite")
    for name, wall in walls.items():
        mine = [row for row in rows if row[0] and row[0].endswith(f": {name}'")]
        assert len(mine) == 1, (name, rows)  # once: never lost, never counted twice
        command, held, start, ended, gpu_s = mine[0]
        index = int((out / name).read_text().strip())
        assert json.loads(held) == [gpus[index].uuid]  # the GPU the job was given
        assert ended is not None and 0 <= ended - start <= wall + 1.0, (name, start, ended, wall)
        if name.startswith("quick"):  # its holder's end was seen: the whole lease, not a sample's share
            assert ended - start >= 0.3 and gpu_s >= 0.3, (name, ended - start, gpu_s)


def _snap(ts: float, lease: str | None = None):
    from daemon_helpers import make_snapshot
    from gpusd.model import LeaseInfo

    snap = make_snapshot(2)
    snap.timestamp = ts
    if lease is not None:
        snap.gpus[0].leases = [LeaseInfo(lease_id=lease, pid=7, user="alice", device=snap.gpus[0].uuid)]
    return snap


def _jobs(conn) -> list[tuple]:
    return conn.execute("SELECT key, start, last, ended, gpu_s FROM jobs ORDER BY id").fetchall()


def test_a_lease_between_two_samples_is_recorded_once_with_its_whole_time(tmp_path):
    """Told at its grant and its end, a lease shorter than a sample is recorded from one to the other;
    a sample taken while it was held but written after its end does not open it a second time."""
    from gpusd.usage.db import connect
    from gpusd.usage.recorder import Accountant

    acc = Accountant(connect(tmp_path / "h.sqlite"), 1.0)
    acc.add(_snap(100.0))
    acc.lease_started("L1", "alice", 1000, "train", ["GPU-h-0"], 100.25)
    acc.lease_ended("L1", 100.75)
    acc.add(_snap(100.5, lease="L1"))  # sampled while it was held, handed to the writer after its end
    acc.add(_snap(101.5))
    [(key, start, last, ended, gpu_s)] = _jobs(acc.conn)
    assert key.startswith("l:L1@") and (start, ended) == (100.25, 100.75) and gpu_s == 0.5


def test_a_killed_daemons_open_lease_is_closed_by_the_next_at_its_last_known_time(tmp_path):
    from gpusd.usage.db import connect
    from gpusd.usage.recorder import Accountant

    db = tmp_path / "h.sqlite"
    acc = Accountant(connect(db), 1.0)
    acc.add(_snap(100.0))
    acc.lease_started("gone", "alice", 1000, "a", ["GPU-h-0"], 100.5)
    acc.lease_started("kept", "bob", 1001, "b", ["GPU-h-1"], 100.6)
    acc.add(_snap(101.0, lease="kept"))  # the daemon is killed here: both records are open
    acc.conn.close()
    acc = Accountant(connect(db), 1.0)  # the next daemon
    acc.add(_snap(130.0, lease="kept"))  # "kept" is still held (its holder kept the lock), "gone" is not
    acc.lease_ended("kept", 131.0)
    rows = {key.split("@")[0]: (start, ended) for key, start, _, ended, _ in _jobs(acc.conn)}
    assert rows == {"l:gone": (100.5, 100.5), "l:kept": (100.6, 131.0)}


def test_a_lease_held_across_a_clean_restart_keeps_one_record(tmp_path):
    """A lease outlives a daemon that stops (its holder gets its descriptors): the stop leaves its record
    open for the next daemon, which continues it, instead of closing it and opening a second one."""
    from gpusd.usage.db import connect
    from gpusd.usage.recorder import Accountant

    db = tmp_path / "h.sqlite"
    acc = Accountant(connect(db), 1.0)
    acc.add(_snap(100.0, lease="L"))
    acc.add(_snap(101.0, lease="L"))
    acc.close_jobs()  # a clean stop
    acc.conn.close()
    acc = Accountant(connect(db), 1.0)
    acc.add(_snap(110.0, lease="L"))
    acc.add(_snap(111.0))
    [(key, start, last, ended, _)] = _jobs(acc.conn)
    assert key.startswith("l:L@") and (start, ended) == (100.0, 110.0)
