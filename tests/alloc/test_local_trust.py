"""Issue 9, findings 4-6: a hostile local user and the shared lock directory.

These tests play two users: the test runs as root (the victim's `gpusd run`, as in CI) and a forked
child drops to an unprivileged uid (the attacker, "mallory").  They are skipped when not run as root.
"""

from __future__ import annotations

import json
import os
import stat
import time

import pytest

from conftest import gpusd_cli
from fakenvml import make_gpus
from other_user import ALICE, MALLORY, AsUser, as_user, needs_root  # noqa: F401

# -- finding 4: symlinks in a lock directory another user made -----------------------------------------

@needs_root
def test_lock_dir_made_by_another_user_with_symlinks_is_refused(fake_nvml, cli_env, shared_tmp):
    """Mallory makes the lock directory first, select.lock and queue.seq pointing at a root file."""
    fake_nvml.write(make_gpus(1))
    victim = shared_tmp / "root-owned"
    victim.write_text("root's data\n")
    os.chmod(victim, 0o600)
    locks = shared_tmp / "locks"

    def plant() -> None:
        os.mkdir(locks)
        os.chmod(locks, 0o1777)
        for name in ("select.lock", "queue.seq", "gpu-GPU-00000000-0000-0000-0000-000000000000.lock"):
            os.symlink(victim, locks / name)

    assert as_user(MALLORY, plant) == "ok None"
    env = dict(cli_env, GPUSD_LOCK_DIR=str(locks))
    for args in (["run", "--", "true"], ["run", "--wait", "--timeout", "5", "--", "true"], ["leases"]):
        r = gpusd_cli(args, env=env, timeout=30)
        assert r.returncode == 1, (args, r.stdout, r.stderr)
        assert "refusing the lock directory" in r.stderr and "uid 40001" in r.stderr
        assert "Traceback" not in r.stderr
    assert stat.S_IMODE(victim.stat().st_mode) == 0o600  # not chmod-ed
    assert victim.read_text() == "root's data\n"  # not overwritten


@needs_root
def test_symlinks_planted_in_a_good_lock_dir_are_never_followed(fake_nvml, cli_env, shared_tmp):
    """The directory is root's and sticky, but mallory plants symlinks where gpusd's files go."""
    gpus = make_gpus(1)
    fake_nvml.write(gpus)
    victim = shared_tmp / "root-owned"
    victim.write_text("root's data\n")
    os.chmod(victim, 0o600)
    locks = shared_tmp / "locks"
    env = dict(cli_env, GPUSD_LOCK_DIR=str(locks))
    assert gpusd_cli(["run", "--", "true"], env=env).returncode == 0  # root makes the directory
    assert stat.S_IMODE(locks.stat().st_mode) == 0o1777

    def plant() -> None:
        for name in ("select.lock", "queue.seq", f"gpu-{gpus[0].uuid}.lock"):
            try:
                os.unlink(locks / name)  # only works for files mallory owns: none here
            except OSError:
                pass
        os.symlink(victim, locks / "queue.seq")

    assert as_user(MALLORY, plant) == "ok None"
    r = gpusd_cli(["run", "--wait", "--timeout", "5", "--", "true"], env=env, timeout=30)
    assert r.returncode == 1 and "queue.seq: it is a symbolic link" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert stat.S_IMODE(victim.stat().st_mode) == 0o600 and victim.read_text() == "root's data\n"


def test_lock_dir_that_is_a_symlink_or_lacks_the_sticky_bit_is_refused(tmp_path, monkeypatch):
    from gpusd.alloc.leases import LeaseStore
    from gpusd.errors import GpusdError

    real = tmp_path / "real"
    real.mkdir()
    os.chmod(real, 0o1777)
    (tmp_path / "link").symlink_to(real)
    monkeypatch.setenv("GPUSD_LOCK_DIR", str(tmp_path / "link"))
    with pytest.raises(GpusdError, match="it is a symbolic link"):
        LeaseStore().acquire(["GPU-1"])
    os.chmod(real, 0o777)  # anyone may delete or replace anyone's lock files
    monkeypatch.setenv("GPUSD_LOCK_DIR", str(real))
    with pytest.raises(GpusdError, match="mode 777 lets other users.*chmod 1777"):
        LeaseStore().acquire(["GPU-1"])


@needs_root
def test_files_other_users_made_are_never_chmodded(shared_tmp, monkeypatch):
    from gpusd.alloc.leases import LeaseStore

    locks = shared_tmp / "locks"
    monkeypatch.setenv("GPUSD_LOCK_DIR", str(locks))
    LeaseStore().ensure()

    def make() -> None:
        fd = os.open(locks / "gpu-GPU-1.lock", os.O_CREAT | os.O_WRONLY, 0o644)
        os.close(fd)

    assert as_user(MALLORY, make) == "ok None"
    lease = LeaseStore().acquire(["GPU-1"])  # flock works on it as it is
    assert lease is not None
    assert stat.S_IMODE((locks / "gpu-GPU-1.lock").stat().st_mode) == 0o644
    lease.release()


# -- finding 5: the selection mutex held, or made unopenable -------------------------------------------

@needs_root
def test_a_held_selection_mutex_cannot_hang_other_users(fake_nvml, cli_env, shared_tmp):
    fake_nvml.write(make_gpus(1))
    locks = shared_tmp / "locks"
    env = dict(cli_env, GPUSD_LOCK_DIR=str(locks))
    assert gpusd_cli(["run", "--", "true"], env=env).returncode == 0

    def hold() -> None:
        import fcntl

        fd = os.open(locks / "select.lock", os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX)

    mallory = AsUser(MALLORY, hold, stay=True)
    try:
        assert mallory.result == "ok None"
        r = gpusd_cli(["run", "--wait", "--timeout", "3", "--", "true"], env=env, timeout=60)
        assert r.returncode == 5, r.stderr  # --timeout honoured
        assert f"pid {mallory.pid} of uid {MALLORY}" in r.stderr and "Traceback" not in r.stderr
        r = gpusd_cli(["run", "--", "true"], env=dict(env, GPUSD_MUTEX_TIMEOUT="1"), timeout=60)
        assert r.returncode == 1 and "held for more than 1s" in r.stderr and f"uid {MALLORY}" in r.stderr
    finally:
        mallory.stop()
    assert gpusd_cli(["run", "--", "true"], env=env).returncode == 0


@needs_root
def test_an_unopenable_selection_mutex_is_a_clear_error(shared_tmp, monkeypatch):
    from gpusd.alloc.leases import LeaseStore

    locks = shared_tmp / "locks"
    monkeypatch.setenv("GPUSD_LOCK_DIR", str(locks))
    LeaseStore().ensure()

    def plant() -> None:
        os.close(os.open(locks / "select.lock", os.O_CREAT | os.O_WRONLY, 0o000))

    assert as_user(MALLORY, plant) == "ok None"

    def take() -> str:
        with LeaseStore(locks).mutex():
            return "locked"

    result = as_user(ALICE, take)
    assert result.startswith("error GpusdError: cannot open"), result
    assert "select.lock: it belongs to uid 40001 with mode 000" in result


# -- finding 6: a forged lease record ------------------------------------------------------------------

@needs_root
def test_a_forged_lease_neither_blocks_gpus_nor_passes_for_someone_else(fake_nvml, cli_env, shared_tmp):
    gpus = make_gpus(2)
    fake_nvml.write(gpus)
    locks = shared_tmp / "locks"
    env = dict(cli_env, GPUSD_LOCK_DIR=str(locks))
    assert gpusd_cli(["run", "--", "true"], env=env).returncode == 0
    evil = "\x1b]0;pwned\x07\x1b[2J\x1b[31mrm -rf ~"

    def forge() -> None:
        import fcntl

        fd = os.open(locks / "lease-0123456789ab.json", os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, json.dumps({"lease_id": "0123456789ab", "pid": 1, "user": "alice", "started": time.time(),
                                 "shared": False, "memory": None, "command": evil,
                                 "devices": [g.uuid for g in gpus]}).encode())

    mallory = AsUser(MALLORY, forge, stay=True)
    try:
        assert mallory.result == "ok None"
        r = gpusd_cli(["select", "-n", "2"], env=env)  # the record holds no GPU: nothing is blocked
        assert r.returncode == 0, r.stderr
        assert gpusd_cli(["leases", "--json"], env=env).stdout.count('"lease_id"') == 0
    finally:
        mallory.stop()

    def forge_holding() -> None:  # now mallory really holds GPU 0 (as any user may) and claims it is alice
        import fcntl

        g = os.open(locks / f"gpu-{gpus[0].uuid}.lock", os.O_RDONLY)
        fcntl.flock(g, fcntl.LOCK_EX)
        fd = os.open(locks / "lease-0123456789ac.json", os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, json.dumps({"lease_id": "x", "pid": 1, "user": "alice", "command": evil,
                                 "devices": [gpus[0].uuid]}).encode())

    mallory = AsUser(MALLORY, forge_holding, stay=True)
    try:
        assert mallory.result == "ok None"
        held = json.loads(gpusd_cli(["leases", "--json"], env=env).stdout)["leases"]
        assert [(le["user"], le["pid"], le["device"]) for le in held] == [("40001", mallory.pid, gpus[0].uuid)]
        r = gpusd_cli(["leases"], env=env)
        assert r.returncode == 0 and "40001" in r.stdout and "alice" not in r.stdout
        assert "\x1b" not in r.stdout and "\x07" not in r.stdout and "rm -rf" in r.stdout
        r = gpusd_cli(["select", "-n", "1"], env=env)
        assert r.returncode == 0 and r.stdout.strip() == "1"  # GPU 0 is really held: the other one
    finally:
        mallory.stop()


def test_oversized_or_ill_typed_lease_records_are_skipped(caplog):
    import fcntl

    from gpusd.alloc.leases import LeaseStore

    store = LeaseStore()
    store.ensure()
    records = {
        "lease-big.json": b'{"pid": 5, "devices": ["GPU-1"], "command": "' + b"x" * 100_000 + b'"}',
        "lease-types.json": json.dumps({"pid": "1", "devices": ["GPU-1"]}).encode(),
        "lease-many.json": json.dumps({"pid": 5, "devices": [f"GPU-{i}" for i in range(1000)]}).encode(),
        "lease-deep.json": b"[" * 100_000 + b"]" * 100_000,
    }
    fds = []
    try:
        for name, raw in records.items():
            fd = os.open(store.dir / name, os.O_RDWR | os.O_CREAT)
            os.write(fd, raw)
            fcntl.flock(fd, fcntl.LOCK_EX)
            fds.append(fd)
        assert store.leases() == []
        for name in records:
            assert name in caplog.text
    finally:
        for fd in fds:
            os.close(fd)


@needs_root
def test_queue_waiters_are_attributed_to_the_ticket_owner(shared_tmp, monkeypatch):
    from gpusd.alloc import queue
    from gpusd.alloc.leases import LeaseStore

    locks = shared_tmp / "locks"
    monkeypatch.setenv("GPUSD_LOCK_DIR", str(locks))
    store = LeaseStore()
    with store.mutex():
        mine = queue.enqueue(store, 2, "python train.py")
    time.sleep(0.05)  # a later kernel clock tick (ties within one tick go by ticket number)

    def forge() -> None:
        import fcntl

        fd = os.open(locks / "queue-000000000000-1.ticket", os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, json.dumps({"pid": 1, "user": "alice", "count": 1, "command": "\x1b[2Jx" * 300}).encode())

    mallory = AsUser(MALLORY, forge, stay=True)
    try:
        assert mallory.result == "ok None"
        first, second = queue.waiters(store)
        # Her ticket number 0 does not put her first: a ticket's place is when it appeared (the kernel's ctime).
        assert (second.user, second.pid, second.count) == (str(MALLORY), None, 1)  # not alice, not pid 1
        assert second.command is not None and len(second.command) == 1024
        assert (first.user, first.pid, first.command) == ("root", os.getpid(), "python train.py")
    finally:
        mallory.stop()
        mine.close()


@needs_root
def test_other_users_lease_as_usual_in_a_shared_directory(shared_tmp, monkeypatch):
    from gpusd.alloc.leases import LeaseStore

    locks = shared_tmp / "locks"
    monkeypatch.setenv("GPUSD_LOCK_DIR", str(locks))
    mine = LeaseStore().acquire(["GPU-1"])  # root makes the directory (1777) and the first files

    def take() -> str:
        store = LeaseStore(locks)
        with store.mutex():
            if store.acquire(["GPU-1"]) is not None:
                return "took a leased GPU"
            lease = store.acquire(["GPU-2"], memory=5)
        assert lease is not None
        globals()["_keep"] = lease  # held while this child lives
        return lease.lease_id

    alice = AsUser(ALICE, take, stay=True)
    try:
        assert alice.result.startswith("ok "), alice.result
        held = {(le.device, le.user, le.pid) for le in LeaseStore().leases()}
        assert held == {("GPU-1", "root", os.getpid()), ("GPU-2", str(ALICE), alice.pid)}
    finally:
        alice.stop()
        mine.release()
    assert LeaseStore().leases() == []
