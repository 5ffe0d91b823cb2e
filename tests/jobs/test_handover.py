"""A job's hand-over and its wait (issue 24, the makespan): what the supervisor does between its lease
and its command, and while it waits for GPUs.  Mechanisms only: the speed is bench_alloc's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from gpusd.alloc.select import Constraints
from other_user import MALLORY, AsUser, needs_root


def _supervisor(**kw: object):
    from gpusd.jobs.supervisor import Supervisor

    return Supervisor(Constraints(count=1), kw.pop("cmd", ["true"]), command="true",  # type: ignore[arg-type]
                      simulate="1xA100-80GB", **kw)  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_a_stop_signal_ends_the_wait_for_gpus_at_once_without_polling(monkeypatch):
    """The main thread sleeps until the lease comes or a signal says stop (the handler wakes it):
    however long its safety poll, a SIGTERM while queued ends the wait."""
    from gpusd.jobs import supervisor as sv

    monkeypatch.setattr(sv, "STOP_POLL", 3600.0)  # no poll would notice in time: only the wake-up can
    sup = _supervisor()
    asked = threading.Event()

    def never() -> object:
        asked.set()
        threading.Event().wait()  # the lease never comes (a daemon thread, left behind)
        raise AssertionError

    def send() -> None:
        asked.wait(30)
        os.kill(os.getpid(), signal.SIGTERM)

    old = signal.signal(signal.SIGTERM, sup._on_signal(interactive=False))
    try:
        threading.Thread(target=send, daemon=True).start()
        with pytest.raises(sv.Stopped) as stopped:
            sup._until_stopped(never)  # type: ignore[arg-type]
        assert stopped.value.signum == signal.SIGTERM and asked.is_set()
    finally:
        signal.signal(signal.SIGTERM, old)
        sup.close()


def test_the_record_says_running_with_its_lease_and_command_in_one_write(monkeypatch):
    """At the hand-over the job's record goes from queued to running in one write that names the lease,
    the GPUs and the command's pid (each write wakes whoever watches the lock directory): a reader never
    sees a running job without its command."""
    sup = _supervisor()
    written: list[dict[str, object]] = []
    real = sup.writer.write

    def write(**changes: object) -> None:
        real(**changes)
        written.append(dict(sup.writer.record.to_dict()))

    monkeypatch.setattr(sup.writer, "write", write)
    try:
        assert sup.run() == 0
    finally:
        sup.close()
    running = [r for r in written if r["state"] == "running"]
    assert running, written
    first = running[0]
    assert first["lease"] and first["devices"] and first["indices"] == [0] and isinstance(first["child"], int)
    assert [r["state"] for r in written] == ["running"]  # queued -> running: one write, nothing before it


def test_a_command_in_its_own_group_leads_it():
    """A --preemptible/--pausable command leads a process group of its own (its pid), not the
    supervisor's; from Python 3.11 Popen makes it (process_group=0), so that no preexec_fn makes
    subprocess fork the whole supervisor instead of vfork()ing it, as the supervisor asks."""
    from gpusd.alloc.cpus import preexec
    from gpusd.jobs.child import GROUP_AT_SPAWN, Child

    fn = preexec(None, not GROUP_AT_SPAWN)  # what the supervisor passes for a command without --bind-cpus
    assert (fn is None) == GROUP_AT_SPAWN == (sys.version_info >= (3, 11))
    child = Child()
    r, w = os.pipe()
    proc = child.start([sys.executable, "-c", f"import os; os.write({w}, str(os.getpgid(0)).encode())"],
                       dict(os.environ), [w], True, fn)
    os.close(w)
    try:
        assert proc.wait(timeout=30) == 0
        assert int(os.read(r, 64)) == proc.pid != os.getpgid(0)
    finally:
        os.close(r)
        child.close()


def test_only_a_queued_local_job_takes_a_start_slot():
    from gpusd.cli import wants_start_slot as wanted

    assert wanted(["run", "-n", "1", "--wait", "--", "python", "x.py"])
    assert wanted(["-v", "run", "--wait", "--timeout", "9", "--", "true"])
    assert not wanted(["run", "-n", "1", "--", "python", "x.py", "--wait"])  # the command's own flag
    assert not wanted(["run", "--wait", "--fleet", "--", "true"])  # waits for a fleet host: no start-up here
    assert not wanted(["run", "--wait", "--no-lease", "--", "true"])  # not a job: the slot would be held throughout
    assert not wanted(["run", "--wait", "--help"])
    assert not wanted(["select", "--wait"])


@pytest.fixture
def slots(monkeypatch):
    """The start gate with two slots, and a short bound on the wait for one."""
    from gpusd.alloc import startgate as gate

    monkeypatch.setenv("GPUSD_START_SLOTS", "2")
    monkeypatch.setattr(gate, "WAIT", 0.5)
    yield gate
    gate.leave()


# Hold both slots of this user; then, for argv[1] turns, let other starts go through them (their turns
# counted) and end; with 0 turns, keep them (a hung holder).
HOLD_SLOTS = """
import fcntl, os, sys, time
from gpusd.alloc.leases import LeaseStore
from gpusd.alloc.lockdir import open_lock_file
from gpusd.alloc import startgate as gate
store = LeaseStore()
dfd = store.open(create=True)
fds = [open_lock_file(dfd, f"start-{os.geteuid()}-{k}.lock", store.dir, private=True) for k in range(2)]
for fd in fds:
    fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
turns = int(sys.argv[1])
if not turns:
    time.sleep(60)
for _ in range(turns):
    time.sleep(0.2)
    for fd in fds:
        gate._turn(fd)
"""


def test_a_start_waits_for_a_slot_a_bounded_time_and_takes_one_that_frees(slots):
    from gpusd.alloc.leases import lock_dir

    assert slots.enter() and slots.held()
    files = sorted(lock_dir().glob(f"start-{os.geteuid()}-*.lock"))
    assert [f.stat().st_mode & 0o777 for f in files] == [0o600]  # the user's own: nobody else can hold it
    slots.leave()
    assert not slots.held()
    # another process holds both slots: a start waits for one, but not for ever, then goes on without
    p = subprocess.Popen([sys.executable, "-c", HOLD_SLOTS, "0"], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        assert slots.enter() is False and not slots.held()
        p.kill()
        p.wait()  # the kernel drops a dead holder's locks: the slots are free again
        assert slots.enter() is True
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_a_start_waits_as_long_as_the_slots_keep_changing_hands(slots):
    """Forty jobs submitted together: the last waits for many turns of its slot, longer than a hung
    holder is given (WAIT), and gets one in the end instead of starting with the storm."""
    p = subprocess.Popen([sys.executable, "-c", HOLD_SLOTS, "8"], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        assert slots.enter() is True  # the holder let go after 8 turns of 0.2 s (> WAIT = 0.5 s)
        assert p.wait(timeout=30) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_a_slot_that_is_not_the_users_own_private_file_is_not_used(slots):
    from gpusd.alloc.leases import LeaseStore, lock_dir

    LeaseStore().ensure()
    for k in range(2):  # files others could open (and lock): not slots
        path = lock_dir() / f"start-{os.geteuid()}-{k}.lock"
        path.write_text("")
        path.chmod(0o666)
    assert slots.enter() is False and not slots.held()


def test_a_queued_job_gives_its_slot_back_before_its_command_runs(slots, monkeypatch):
    """The slot orders start-ups only: it is given back once the job has joined the queue, and never held
    while the command runs (nor inherited by it)."""
    sup = _supervisor(wait=True)
    seen: list[bool] = []
    real = sup.start_child

    def start_child() -> None:
        seen.append(slots.held())
        real()

    monkeypatch.setattr(sup, "start_child", start_child)
    assert slots.enter()
    try:
        assert sup.run() == 0
    finally:
        sup.close()
    assert seen == [False] and not slots.held()


@needs_root
@pytest.mark.timeout(60)
def test_another_user_cannot_hold_a_users_start_slot(shared_tmp, monkeypatch):
    """Mallory makes root's slot file first (mode 0666) and locks it: root's start does not wait on it,
    and the file is neither used nor chmod-ed (docs/allocation.md, the files of the lock directory)."""
    import stat

    from gpusd.alloc import startgate as gate
    from gpusd.alloc.leases import LeaseStore

    locks = shared_tmp / "locks"
    monkeypatch.setenv("GPUSD_LOCK_DIR", str(locks))
    monkeypatch.setenv("GPUSD_START_SLOTS", "1")
    monkeypatch.setattr(gate, "WAIT", 3600.0)  # were her file taken for a slot, the start would wait on her lock
    monkeypatch.setattr(gate, "MAX_WAIT", 3600.0)
    LeaseStore().ensure()

    def squat() -> None:
        import fcntl

        fd = os.open(locks / "start-0-0.lock", os.O_CREAT | os.O_RDWR, 0o666)
        os.fchmod(fd, 0o666)
        fcntl.flock(fd, fcntl.LOCK_EX)

    mallory = AsUser(MALLORY, squat, stay=True)
    try:
        assert mallory.result == "ok None"
        assert gate.enter() is False and not gate.held()  # at once: the squatted slot is not a slot
        st = (locks / "start-0-0.lock").stat()
        assert st.st_uid == MALLORY and stat.S_IMODE(st.st_mode) == 0o666
    finally:
        mallory.stop()
        gate.leave()


def test_a_preempted_job_gives_its_gpus_back_only_once_its_ticket_is_in_the_queue(monkeypatch):
    """Preempted, a job queues again with its old place (docs/jobs.md, "Fairness") and gives its GPUs
    back only once its ticket is in: given back first, a job queued behind it could take them in the
    moment before its ticket is in, and run ahead of it (the race that failed
    test_a_preempted_job_goes_back_at_the_head_of_its_class under load)."""
    from gpusd.alloc.api import Selection

    sup = _supervisor(preemptible=True)
    events: list[str] = []

    class Held:  # the lease the command ran with
        lease_id = "0123456789ab"
        released = False

        def release(self) -> None:
            if not self.released:
                self.released = True
                events.append("released")

    new = Selection([], None)

    def allocate(c, wait, timeout, first=False, resume=False, cancelled=None, queued=None):  # noqa: ANN001
        assert wait and resume and first  # waits again, with its place from when it started
        events.append("released" if Held.released else "queued with its GPUs")  # the ticket goes in now
        queued()
        events.append("waits")
        return new

    held = Held()
    sup.lease = held  # type: ignore[assignment]
    monkeypatch.setattr(sup, "_allocate", allocate)
    try:
        sup._requeue()
    finally:
        sup.close()
    assert events == ["queued with its GPUs", "released", "waits"], events
    assert held.released and sup.lease is None  # the new selection's (no lease here) is the job's now
    assert sup.writer.record.state == "preempted" and sup.restarts == 1


def test_a_preempted_job_whose_wait_fails_still_gives_its_gpus_back(monkeypatch):
    """If the queue never takes the ticket (an error, a stop), the GPUs go back all the same."""
    from gpusd.errors import GpusdError

    sup = _supervisor(preemptible=True)

    class Held:
        lease_id = "0123456789ab"
        released = False

        def release(self) -> None:
            self.released = True

    def allocate(*_a: object, **_kw: object) -> object:
        raise GpusdError("the lock directory is gone")

    held = Held()
    sup.lease = held  # type: ignore[assignment]
    monkeypatch.setattr(sup, "_allocate", allocate)
    try:
        with pytest.raises(GpusdError):
            sup._requeue()
    finally:
        sup.close()
    assert held.released
