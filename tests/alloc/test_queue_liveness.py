"""Liveness of the queue and of the supervisor (found in the review of issue 13): the head does not
spin, waiters never wait for each other, a stopped command's whole group is gone before its GPUs are."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from gpusd.alloc import api
from gpusd.alloc.api import LeaseRequest, allocate
from gpusd.alloc.leases import LeaseStore
from gpusd.alloc.priority import LOW, NORMAL
from gpusd.alloc.select import Constraints
from gpusd.errors import GpusdError
from other_user import AsUser, needs_root
from waiting import wait_until_sync

SIM = "1xA100-80GB"


def test_the_head_does_not_spin_while_a_gpu_is_locked_without_a_record():
    """A GPU whose lock outlives its record (a preempted command's child still holds the inherited
    descriptor; or a record another user cannot read): the head must wait for a change, not spin."""
    store = LeaseStore()
    sel = allocate(LeaseRequest(Constraints(count=1), simulate=SIM), store=store)
    child = subprocess.Popen(["sleep", "30"], pass_fds=[sel.lease.fds[0]])
    sel.release()  # the record goes; the child's copy keeps the lock
    attempts = [0]
    real = api._attempt

    def counting(*a, **k):  # type: ignore[no-untyped-def]
        attempts[0] += 1
        return real(*a, **k)

    api._attempt = counting  # type: ignore[assignment]
    try:
        with pytest.raises(GpusdError):
            allocate(LeaseRequest(Constraints(count=1), wait=True, timeout=1.5, simulate=SIM), store=store)
    finally:
        api._attempt = real  # type: ignore[assignment]
        child.kill()
        child.wait()
    # SETTLE (5 looks) + one look per poll second + the last look: about 8.  Measured on main: thousands.
    assert attempts[0] < 50


@needs_root
def test_a_policy_only_root_can_read_does_not_make_two_waiters_wait_for_each_other(shared_tmp, monkeypatch):
    locks = shared_tmp / "locks"
    locks.mkdir()
    os.chmod(locks, 0o1777)
    policy = shared_tmp / "priorities.json"
    policy.write_text(json.dumps({"aging_minutes": 0.01}))  # 0.6 s
    os.chmod(policy, 0o600)  # an administrator's umask 077: users silently get the defaults (30 min)
    monkeypatch.setenv("GPUSD_PRIORITY_POLICY", str(policy))
    store = LeaseStore(locks)
    warm = LeaseRequest(Constraints(count=1), simulate=SIM)
    allocate(warm, store=LeaseStore(tmp := shared_tmp / "warm")).release()  # imports
    del tmp
    # The GPU is held by another process: a lease taken here would be inherited by the forked user below.
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\n"
                               "from gpusd.alloc.api import LeaseRequest, allocate\n"
                               "from gpusd.alloc.leases import LeaseStore\n"
                               "from gpusd.alloc.select import Constraints\n"
                               f"s = allocate(LeaseRequest(Constraints(count=1), simulate={SIM!r}), "
                               f"store=LeaseStore({str(locks)!r}))\n"
                               "print('held', flush=True)\ntime.sleep(120)\n"], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"

    def user_waits() -> str:  # a low job of another user, queued first
        from gpusd.alloc import policy

        policy.forget_files()  # a fresh process of that user: it reads the policy itself
        sel = allocate(LeaseRequest(Constraints(count=1), wait=True, timeout=12, simulate=SIM, priority=LOW),
                       store=LeaseStore(locks))
        sel.release()
        return "got"

    user = threading.Thread(target=lambda: results.append(AsUser(40001, user_waits).result))
    results: list[str] = []
    user.start()
    from gpusd.alloc import queue

    wait_until_sync(lambda: len(queue.waiters(store)) == 1, timeout=20)
    got: list[float] = []
    got_err: list[str] = []

    def root_waits() -> None:  # root's normal job (as the daemon waits for a client), queued second
        try:
            req = LeaseRequest(Constraints(count=1), wait=True, timeout=12, simulate=SIM, priority=NORMAL)
            sel = allocate(req, store=store)
        except GpusdError as exc:
            got_err.append(repr(exc))
            return
        got.append(time.monotonic())
        sel.release()

    r = threading.Thread(target=root_waits)
    r.start()
    wait_until_sync(lambda: len(queue.waiters(store)) == 2, timeout=20)
    time.sleep(2.0)  # past two of root's aging periods: root now puts the user's job first, the user puts root's first
    freed = time.monotonic()
    holder.kill()
    holder.wait()
    r.join(30)
    user.join(30)
    # Someone must take the free GPU before the other's timeout (12 s) ends the wait; on main neither does.
    assert got and got[0] - freed < 8, (got and got[0] - freed, results, got_err)


_SUPERVISOR = """
import sys
from gpusd.jobs.supervisor import Supervisor
from gpusd.alloc.select import Constraints
s = Supervisor(Constraints(count=1), ["sh", "-c", '(trap "" TERM; exec sleep 60) & wait'], command="t", priority=0,
               preemptible=True, grace=1.0, wait=True, simulate="1xA100-80GB")
print(s.job_id, flush=True)
sys.exit(s.run())
"""


def test_a_preempted_commands_whole_group_is_gone_after_the_grace_period():
    from gpusd.jobs import control
    from gpusd.jobs.record import list_jobs

    sup = subprocess.Popen([sys.executable, "-c", _SUPERVISOR], stdout=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        assert sup.stdout is not None
        job = sup.stdout.readline().strip()
        rec = wait_until_sync(lambda: next((r for r in list_jobs(LeaseStore()) if r.job == job and r.state == "running"
                                            and r.child), None), timeout=30, what="the job runs")
        group = rec.child
        assert control.request(job, os.geteuid(), {"op": "preempt", "by": "t", "priority": NORMAL})["ok"]

        def group_gone() -> bool:
            try:
                os.killpg(group, 0)
            except ProcessLookupError:
                return True
            return False

        # --grace 1: SIGKILL for the whole group 1 s after SIGTERM (docs/jobs.md); bounded wait, not a timing check
        wait_until_sync(group_gone, timeout=10, what="the preempted command's process group ends")
    finally:
        try:
            os.killpg(sup.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        sup.wait(10)
        try:
            os.killpg(group, signal.SIGKILL)  # type: ignore[possibly-undefined]
        except (ProcessLookupError, NameError, UnboundLocalError):
            pass
