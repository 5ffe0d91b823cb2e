"""Issue 17, finding 2: a local user holding flocks on the lock files.

The test runs as root (the victim) and a forked child drops to an unprivileged uid (the attacker,
tests/other_user.py) that opens every file it can in the lock directory and holds a flock on it.
With a daemon as the lease authority, that must block nothing (the daemon's lock files are its own,
mode 0600); without one (the flock fallback), the GPU it blocks is named with its pid and uid in the
error, in ``gpusd leases`` (table and --json) and in ``gpusd devices``.  Skipped when not root.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import sys

import pytest

from authority_helpers import ServerThread
from conftest import gpusd_cli
from fakenvml import make_gpus
from other_user import MALLORY, AsUser, needs_root

GPUSD = [sys.executable, "-m", "gpusd"]


def _hold_everything(root: str, exclusive: bool) -> object:
    """Mallory's part: a flock (``exclusive``: LOCK_EX, else LOCK_SH) on every file under ``root`` she
    can open, read-write or read-only; the descriptors stay open while the child lives."""
    import fcntl

    held: list[str] = []  # the descriptors are never closed: they live as long as the child
    for where, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(where, name)
            fd = -1
            for flags in (os.O_RDWR, os.O_RDONLY):
                try:
                    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK)
                    break
                except OSError:
                    continue
            if fd < 0:
                continue
            try:
                fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            held.append(os.path.relpath(path, root))
    return ",".join(sorted(held))


def _seed_world_openable(env: dict[str, str]) -> None:
    """A lock directory as gpusd 0.2 left it: gpu-*.lock, select.lock and queue.seq, mode 0666."""
    flock_only = dict(env, GPUSD_LEASE_SOCKET="off")
    assert gpusd_cli(["run", "-n", "2", "--", "true"], env=flock_only).returncode == 0
    assert gpusd_cli(["run", "--wait", "--timeout", "10", "--", "true"], env=flock_only).returncode == 0


@pytest.fixture
def shared_locks(shared_tmp, monkeypatch):
    locks = shared_tmp / "locks"
    monkeypatch.setenv("GPUSD_LOCK_DIR", str(locks))
    return locks


# -- with a daemon as the lease authority ----------------------------------------------------------------

@needs_root
@pytest.mark.parametrize("exclusive", [False, True], ids=["LOCK_SH", "LOCK_EX"])
def test_foreign_flocks_on_every_file_block_nothing_through_the_daemon(fake_nvml_inprocess, cli_env, shared_locks,
                                                                      exclusive):
    fake_nvml_inprocess.write(make_gpus(2))
    env = dict(cli_env, GPUSD_LOCK_DIR=str(shared_locks), GPUSD_MUTEX_TIMEOUT="2")
    _seed_world_openable(env)
    server = ServerThread()
    try:
        # the daemon's own files exist too (a lease taken and ended through it), for mallory to try
        assert gpusd_cli(["run", "-n", "2", "--", "true"], env=env).returncode == 0
        assert gpusd_cli(["run", "--wait", "--timeout", "10", "--", "true"], env=env).returncode == 0
        mallory = AsUser(MALLORY, lambda: _hold_everything(str(shared_locks), exclusive), stay=True)
        try:
            assert mallory.result.startswith("ok "), mallory.result
            held = mallory.result[3:].split(",")
            # she holds the world-openable files of the shared directory, and none of the daemon's
            assert "select.lock" in held and "queue.seq" in held and sum(h.startswith("gpu-") for h in held) == 2
            # (the epoch files are readable by everyone on purpose, so that grants in the shared
            # directory stay above the daemon's: gpusd never locks them, so a flock there blocks nothing)
            assert not [h for h in held if h.startswith("authority/") and not h.startswith("authority/epoch-")], held
            r = gpusd_cli(["run", "-n", "1", "--", "sh", "-c", 'echo "$CUDA_VISIBLE_DEVICES"'], env=env, timeout=60)
            assert r.returncode == 0 and r.stdout.strip() in ("0", "1"), r.stderr
            r = gpusd_cli(["run", "-n", "2", "--", "true"], env=env, timeout=60)
            assert r.returncode == 0, r.stderr
            r = gpusd_cli(["run", "--wait", "--timeout", "30", "--", "true"], env=env, timeout=60)
            assert r.returncode == 0, r.stderr  # the queue too: the daemon's queue.seq is its own
            # a flock without a lease is no lease: the views show none of hers as a lease the daemon honours
            leases = json.loads(gpusd_cli(["leases", "--json"], env=env).stdout)["leases"]
            assert all(le.get("unleased") for le in leases), leases
        finally:
            mallory.stop()
    finally:
        server.stop()


@needs_root
async def test_foreign_flocks_do_not_stop_a_remote_lease(shared_locks, tmp_path):
    from daemon_helpers import running_daemon, unique_session
    from gpusd.alloc.leases import LeaseStore
    from gpusd.wire.http import request_json
    from gpusd.wire.signing import FleetKey

    token = secrets.token_hex(32)
    simulate = "2xA100-80GB"
    await asyncio.to_thread(_seed_world_openable, dict(os.environ, GPUSD_SIMULATE=simulate))
    async with running_daemon(tmp_path, unique_session(), token=token, simulate=simulate, tls=False,
                              leases=True) as d:
        url = f"http://127.0.0.1:{d.port}/api/v1/leases"
        mallory = AsUser(MALLORY, lambda: _hold_everything(str(shared_locks), False), stay=True)
        try:
            assert mallory.result.startswith("ok "), mallory.result
            blocked = mallory.result[3:].split(",")
            # the shared directory's view names her; the daemon's (its announcement, its API) has no
            # lock of hers in it: they block nothing there, so no GPU may look taken to the fleet
            assert {le.pid for le in LeaseStore().leases() if le.unleased} == {mallory.pid}
            assert LeaseStore.for_daemon().private and LeaseStore.for_daemon().leases() == []
            granted = []
            for _ in range(2):  # both GPUs: neither of her flocks counts
                r = await asyncio.to_thread(request_json, "POST", url, {"count": 1, "holder": "alice@laptop",
                                                                        "ttl": 30}, key=FleetKey(token),
                                            node_id=d.node_id)
                assert r.status == 201, r.data
                granted.append(r.data["lease_id"])
            held = [le for le in LeaseStore().leases() if not le.unleased]
            assert sorted(le.lease_id for le in held) == sorted(granted)
            assert all(le.remote_from == "127.0.0.1" for le in held)
            assert all(f"gpu-{le.device}.lock" in blocked for le in held)  # the very GPUs she holds flocks on
            assert all((LeaseStore.authority().dir / f"lease-{le.lease_id}.json").exists() for le in held)
        finally:
            mallory.stop()


# -- without a daemon: the flock fallback names who blocks -----------------------------------------------

@needs_root
def test_without_a_daemon_a_foreign_flock_is_named_with_its_pid_and_uid(fake_nvml, cli_env, shared_locks):
    gpus = make_gpus(1)
    fake_nvml.write(gpus)
    env = dict(cli_env, GPUSD_LOCK_DIR=str(shared_locks), GPUSD_LEASE_SOCKET="off")
    assert gpusd_cli(["run", "--", "true"], env=env).returncode == 0

    def hold_gpu() -> object:
        import fcntl

        fd = os.open(shared_locks / f"gpu-{gpus[0].uuid}.lock", os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_SH)
        return fd

    mallory = AsUser(MALLORY, hold_gpu, stay=True)
    try:
        assert mallory.result.startswith("ok "), mallory.result
        who = f"pid {mallory.pid} of uid {MALLORY}"
        r = gpusd_cli(["run", "--", "true"], env=env)
        assert r.returncode == 4 and who in r.stderr and "without a lease" in r.stderr, r.stderr
        r = gpusd_cli(["run", "--wait", "--timeout", "1", "--", "true"], env=env)
        assert r.returncode == 5 and who in r.stderr, r.stderr
        doc = json.loads(gpusd_cli(["leases", "--json"], env=env).stdout)
        [le] = doc["leases"]
        assert (le["unleased"], le["pid"], le["device"], le["shared"]) == (True, mallory.pid, gpus[0].uuid, True)
        assert f"uid {MALLORY}" in le["user"]
        r = gpusd_cli(["leases"], env=env)
        assert r.returncode == 0 and str(mallory.pid) in r.stdout and f"uid {MALLORY}" in r.stdout, r.stdout
        assert "without a lease" in r.stdout
        r = gpusd_cli(["devices"], env=env)
        assert r.returncode == 0 and f"uid {MALLORY}" in r.stdout and str(mallory.pid) in r.stdout, r.stdout
        devices = json.loads(gpusd_cli(["devices", "--json"], env=env).stdout)
        [held] = devices["gpus"][0]["leases"]
        assert held["pid"] == mallory.pid and held["unleased"] is True
        # a shared job may still share the GPU with her read lock: only exclusive leases are blocked
        assert gpusd_cli(["run", "--share", "--", "true"], env=env).returncode == 0
    finally:
        mallory.stop()
    assert gpusd_cli(["run", "--", "true"], env=env).returncode == 0
    assert json.loads(gpusd_cli(["leases", "--json"], env=env).stdout)["leases"] == []


@needs_root
def test_without_a_daemon_a_blocked_gpu_is_skipped_for_a_free_one(fake_nvml, cli_env, shared_locks):
    gpus = make_gpus(2)
    fake_nvml.write(gpus)
    env = dict(cli_env, GPUSD_LOCK_DIR=str(shared_locks), GPUSD_LEASE_SOCKET="off")
    assert gpusd_cli(["run", "-n", "2", "--", "true"], env=env).returncode == 0

    def hold_gpu0() -> None:
        import fcntl

        fd = os.open(shared_locks / f"gpu-{gpus[0].uuid}.lock", os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX)

    mallory = AsUser(MALLORY, hold_gpu0, stay=True)
    try:
        assert mallory.result == "ok None"
        r = gpusd_cli(["run", "--", "sh", "-c", 'echo "$CUDA_VISIBLE_DEVICES"'], env=env)
        assert r.returncode == 0 and r.stdout.strip() == "1", r.stderr  # not "taken at the same moment"
    finally:
        mallory.stop()


def test_a_flock_held_by_this_process_without_a_record_is_reported(monkeypatch, tmp_path):
    """The same report for any process (here: this one), without a second user."""
    import fcntl

    from gpusd.alloc.leases import LeaseStore

    store = LeaseStore()
    lease = store.acquire(["GPU-a"])
    assert lease is not None
    lease.release()
    fd = os.open(store.dir / "gpu-GPU-a.lock", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        [le] = store.leases()
        assert le.unleased and le.pid == os.getpid() and not le.shared and le.device == "GPU-a"
        assert store.acquire(["GPU-a"]) is None
        assert store.refusal is not None and f"pid {os.getpid()}" in store.refusal
        held = store.acquire(["GPU-b"])  # a real lease is a lease, not a blocker
        assert held is not None
        assert sorted((le.device, le.unleased) for le in store.leases()) == [("GPU-a", True), ("GPU-b", False)]
        held.release()
    finally:
        os.close(fd)
    assert store.leases() == []


def test_the_authority_store_refuses_lock_files_it_did_not_make(tmp_path, monkeypatch):
    from gpusd.alloc.leases import LeaseStore
    from gpusd.errors import GpusdError

    store = LeaseStore.authority()
    store.prepare()
    assert oct(os.stat(store.dir).st_mode & 0o7777) == "0o755"
    lease = store.acquire(["GPU-a"])
    assert lease is not None
    assert oct(os.stat(store.dir / "gpu-GPU-a.lock").st_mode & 0o777) == "0o600"
    assert oct(os.stat(lease.path).st_mode & 0o777) == "0o644"  # the record: anyone may read the lease
    lease.release()
    fd = os.open(store.dir / "gpu-GPU-b.lock", os.O_CREAT | os.O_WRONLY, 0o600)
    os.fchmod(fd, 0o666)  # as 0.2 would have made it
    os.close(fd)
    with pytest.raises(GpusdError, match="must be its own, mode 600"):
        store.acquire(["GPU-b"])
    assert oct(os.stat(store.dir / "gpu-GPU-b.lock").st_mode & 0o777) == "0o666"  # never chmod-ed


@needs_root
def test_a_squatted_authority_directory_is_moved_aside_not_used(shared_locks):
    from gpusd.alloc.leases import LeaseStore
    from other_user import as_user

    LeaseStore().ensure()

    def squat() -> None:
        os.mkdir(shared_locks / "authority", 0o777)
        os.chmod(shared_locks / "authority", 0o777)
        os.close(os.open(shared_locks / "authority" / "select.lock", os.O_CREAT | os.O_RDWR, 0o666))

    assert as_user(MALLORY, squat) == "ok None"
    assert LeaseStore().peers() == []  # hers is no authority's: clients ignore it
    store = LeaseStore.authority()
    store.prepare()
    st = os.stat(store.dir)
    assert st.st_uid == 0 and st.st_mode & 0o7777 == 0o755 and not (store.dir / "select.lock").exists()
    [aside] = [p for p in shared_locks.iterdir() if p.name.startswith("authority.refused-")]
    assert aside.stat().st_uid == MALLORY  # moved, not chmod-ed or entered
    with store.mutex():
        pass
    assert [p.dir for p in LeaseStore().peers()] == [store.dir]


def test_leases_in_the_two_stores_never_overlap_in_a_race(monkeypatch):
    """The authority's store and the shared one have different mutexes: many threads taking leases
    in both at once still never get one GPU twice (each publishes, then checks the other side)."""
    import threading

    from gpusd.alloc.api import LeaseRequest, allocate, shared_backend
    from gpusd.alloc.leases import LeaseStore
    from gpusd.alloc.select import Constraints
    from gpusd.errors import NoGpuAvailable

    simulate = "4xA100-80GB"
    backend = shared_backend(simulate)
    authority, shared = LeaseStore.authority(), LeaseStore()
    authority.prepare()
    clashes: list[str] = []
    lock = threading.Lock()

    def take(store: LeaseStore, start: threading.Barrier, held: list[tuple[str, object]]) -> None:
        start.wait()
        try:
            sel = allocate(LeaseRequest(Constraints(count=1)), store=store, backend=backend)
        except NoGpuAvailable:
            return
        with lock:
            held.append((sel.uuids[0], sel))

    for _ in range(15):
        held: list[tuple[str, object]] = []
        start = threading.Barrier(8)
        threads = [threading.Thread(target=take, args=(authority if i % 2 else shared, start, held))
                   for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        devices = [d for d, _ in held]
        if len(devices) != len(set(devices)):
            clashes.append(",".join(sorted(devices)))
        assert len(held) <= 4
        for _, sel in held:
            sel.release()  # type: ignore[attr-defined]
    assert clashes == []


@needs_root
def test_a_ticket_a_dead_daemon_left_cannot_be_kept_alive_by_another_user(shared_locks):
    """The authority's tickets are readable by every user; one left by a killed daemon and locked by
    another user is no waiter (else nobody could take a GPU without queueing behind it)."""
    import fcntl

    from gpusd.alloc import queue
    from gpusd.alloc.leases import LeaseStore

    store = LeaseStore.authority()
    store.prepare()
    ticket = queue.enqueue(store, 1, "sleep 60")
    assert [w.ticket for w in queue.waiters(LeaseStore())] == [ticket.path.name]  # seen from the shared side
    fd = os.open(ticket.path, os.O_RDONLY)  # the daemon "dies": its lock goes, its file stays
    os.close(ticket.fd)
    ticket.closed = True
    os.close(ticket.dir_fd)
    os.close(fd)

    def keep_alive() -> None:
        held = os.open(ticket.path, os.O_RDONLY)
        fcntl.flock(held, fcntl.LOCK_EX)

    mallory = AsUser(MALLORY, keep_alive, stay=True)
    try:
        assert mallory.result == "ok None"
        assert queue.waiters(LeaseStore()) == [] and queue.waiters(store) == []
    finally:
        mallory.stop()


@needs_root
def test_a_ticket_in_the_shared_directory_does_not_hold_up_the_daemons_clients(fake_nvml_inprocess, cli_env,
                                                                               shared_locks):
    """Anyone can queue in the shared directory and never take a GPU: through the daemon, such a ticket
    is nobody's turn (the shared side still queues behind the daemon's waiters)."""
    from gpusd.alloc import queue
    from gpusd.alloc.leases import LeaseStore

    fake_nvml_inprocess.write(make_gpus(2))
    env = dict(cli_env, GPUSD_LOCK_DIR=str(shared_locks))
    _seed_world_openable(dict(env))

    kept = []

    def queue_forever() -> object:
        kept.append(queue.enqueue(LeaseStore(shared_locks), 64, "sleep forever"))  # kept open: a waiter
        return kept[0].path.name

    mallory = AsUser(MALLORY, queue_forever, stay=True)
    server = ServerThread()
    try:
        assert mallory.result.startswith("ok queue-"), mallory.result
        flock_only = dict(env, GPUSD_LEASE_SOCKET="off")
        r = gpusd_cli(["run", "--", "true"], env=flock_only)
        assert r.returncode == 4 and "waiting for GPUs ahead" in r.stderr  # the shared queue is as it was
        r = gpusd_cli(["run", "--", "true"], env=env)
        assert r.returncode == 0, r.stderr
        r = gpusd_cli(["run", "--wait", "--timeout", "20", "--", "true"], env=env)
        assert r.returncode == 0, r.stderr
    finally:
        server.stop()
        mallory.stop()


@needs_root
def test_without_a_daemon_a_held_selection_mutex_is_named_in_leases_and_devices(fake_nvml, cli_env, shared_locks):
    fake_nvml.write(make_gpus(1))
    env = dict(cli_env, GPUSD_LOCK_DIR=str(shared_locks), GPUSD_LEASE_SOCKET="off")
    assert gpusd_cli(["run", "--", "true"], env=env).returncode == 0
    doc = json.loads(gpusd_cli(["leases", "--json"], env=env).stdout)
    assert doc["mutex_holders"] == []

    def hold_mutex() -> None:
        import fcntl

        fd = os.open(shared_locks / "select.lock", os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_SH)  # a read lock is enough to keep everyone's LOCK_EX out

    mallory = AsUser(MALLORY, hold_mutex, stay=True)
    try:
        assert mallory.result == "ok None"
        who = f"pid {mallory.pid} of uid {MALLORY}"
        doc = json.loads(gpusd_cli(["leases", "--json"], env=env).stdout)
        assert doc["mutex_holders"] == [{"pid": mallory.pid, "uid": MALLORY, "user": str(MALLORY)}]
        r = gpusd_cli(["leases"], env=env)
        assert r.returncode == 0 and who in r.stdout and "selection mutex" in r.stdout, r.stdout
        r = gpusd_cli(["devices"], env=env)
        assert r.returncode == 0 and who in r.stderr, r.stderr
        r = gpusd_cli(["run", "--", "true"], env=dict(env, GPUSD_MUTEX_TIMEOUT="1"))
        assert r.returncode == 1 and who in r.stderr  # and in the error, as before
    finally:
        mallory.stop()
