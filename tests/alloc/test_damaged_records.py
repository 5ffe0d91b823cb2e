"""A damaged, empty or foreign lease record costs that one entry, never the host (issue 31, item 5).

The kernel's lock is the truth: a GPU whose lock is held stays held, shown as "record unreadable"
(``gpusd leases``, ``gpusd devices``, the daemon's API), never free; the other GPUs stay grantable.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from authority_helpers import ServerThread, kill_group, wait_for
from conftest import gpusd_cli
from fakenvml import make_gpus

GPUSD = [sys.executable, "-m", "gpusd"]


@pytest.fixture
def authority(fake_nvml_inprocess):
    if os.geteuid() != 0:
        pytest.skip("the lease authority's own directory is made by root only")
    server = ServerThread()
    yield server
    server.stop()


def _leases(env):
    return json.loads(gpusd_cli(["leases", "--json"], env=env).stdout)["leases"]




def _damage(path, how):
    """Overwrite a record in place (the holder keeps its lock: same file, same inode)."""
    with open(path, "r+b") as f:
        f.truncate(0)
        f.write({"empty": b"", "junk": b"\x00\xff not json", "foreign": b'{"format": 9, "hello": "world"}'}[how])


def _holders(n, env):
    jobs = []
    for _ in range(n):
        jobs.append(subprocess.Popen([*GPUSD, "run", "--", "sleep", "60"], env=env, start_new_session=True))
        assert wait_for(lambda: len(_leases(env)) == len(jobs)), _leases(env)
    return jobs


@pytest.mark.parametrize("how", ["empty", "junk"])
def test_damaged_records_in_the_authoritys_directory_cost_only_their_gpus(fake_nvml_inprocess, authority, cli_env,
                                                                          how):
    from gpusd.alloc.leases import LeaseStore

    fake_nvml_inprocess.write(make_gpus(4))
    jobs = _holders(2, cli_env)
    try:
        held = {le["device"]: le for le in _leases(cli_env)}
        records = sorted(LeaseStore.authority().dir.glob("lease-*.json"))
        assert len(records) == 2
        for rec in records:
            _damage(rec, how)
        now = _leases(cli_env)
        # never shown free: both GPUs still held, named for what they are
        assert sorted(le["device"] for le in now) == sorted(held), now
        assert all(le.get("unreadable") is True and "record unreadable" in le["command"] for le in now), now
        text = gpusd_cli(["leases"], env=cli_env).stdout
        assert "record unreadable" in text, text
        devices = json.loads(gpusd_cli(["devices", "--json"], env=cli_env).stdout)
        shown = {le["device"] for g in devices["gpus"] for le in g["leases"] if le.get("unreadable")}
        assert shown == set(held), devices
        table = gpusd_cli(["devices"], env=cli_env).stdout
        assert table.count("(record unreadable)") == 2, table
        # new requests get the other GPUs, through the daemon, one after another
        out = []
        for _ in range(2):
            r = gpusd_cli(["run", "--", "sh", "-c", 'echo "$CUDA_VISIBLE_DEVICES"'], env=cli_env)
            assert r.returncode == 0, r.stderr
            out.append(r.stdout.strip())
        assert out == ["2", "2"]
        r = gpusd_cli(["select", "-n", "2"], env=cli_env)
        assert r.returncode == 0 and r.stdout.strip() == "2,3", r.stderr
        r = gpusd_cli(["run", "-n", "3", "--", "true"], env=cli_env)
        assert r.returncode == 4 and "record unreadable" in r.stderr and "same moment" not in r.stderr, r.stderr
        # the damaged leases end with their holders, as any lease does
        for job in jobs:
            kill_group(job)
        assert wait_for(lambda: _leases(cli_env) == [])
        r = gpusd_cli(["select", "-n", "4"], env=cli_env)
        assert r.returncode == 0, r.stderr
    finally:
        for job in jobs:
            kill_group(job)


def test_a_damaged_record_in_the_shared_directory_keeps_its_gpu_held(fake_nvml_inprocess, cli_env):
    from gpusd.alloc.leases import LeaseStore

    fake_nvml_inprocess.write(make_gpus(2))
    flock_only = dict(cli_env, GPUSD_LEASE_SOCKET="off")
    [job] = _holders(1, flock_only)
    try:
        [rec] = LeaseStore().dir.glob("lease-*.json")
        _damage(rec, "foreign")
        [le] = _leases(flock_only)
        assert le["unreadable"] is True and le["pid"] == job.pid and "record unreadable" in le["command"], le
        r = gpusd_cli(["run", "--", "sh", "-c", 'echo "$CUDA_VISIBLE_DEVICES"'], env=flock_only)
        assert r.returncode == 0 and r.stdout.strip() == "1", r.stderr
    finally:
        kill_group(job)


def test_a_grant_that_fails_on_one_gpu_moves_on_to_the_others(fake_nvml_inprocess, monkeypatch):
    """A GPU whose lock is held where nothing says so (no record, not in /proc/locks: another pid
    namespace's view, say) fails its grant: the allocation takes the next qualifying GPU instead."""
    from gpusd.alloc import lockdir
    from gpusd.alloc.api import LeaseRequest, allocate
    from gpusd.alloc.leases import LeaseStore
    from gpusd.alloc.lockdir import safe_name
    from gpusd.alloc.select import Constraints

    fake_nvml_inprocess.write(make_gpus(3))
    monkeypatch.setenv("GPUSD_LEASE_SOCKET", "off")
    monkeypatch.setattr(lockdir, "read_proc_locks", lambda: None)  # the kernel's table cannot be read
    store = LeaseStore()
    store.ensure()
    from gpusd.alloc.api import shared_backend

    uuid0 = shared_backend().snapshot(detail=False).gpus[0].uuid
    fd = os.open(store.dir / f"gpu-{safe_name(uuid0)}.lock", os.O_RDWR | os.O_CREAT, 0o666)
    pid = os.fork()
    if pid == 0:  # a holder of GPU 0's lock that is not this process (a flock of ours would not conflict)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(1, b"")
        time.sleep(60)
        os._exit(0)
    try:
        os.close(fd)
        time.sleep(0.3)
        sel = allocate(LeaseRequest(Constraints.build(count=1)))
        try:
            assert sel.indices == [1]
        finally:
            sel.release()
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
