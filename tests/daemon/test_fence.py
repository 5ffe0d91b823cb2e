"""gpusd.daemon.fence in this process: which processes a lease has on this host, how they are
stopped, and that the GPUs are given back only once they are gone (the whole story on a LAN with
sshd: tests/pool/test_fence_lan.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from gpusd.daemon import fence
from gpusd.ids import LeaseId

# a holder whose child cleared its environment, left for a session of its own and ignores SIGTERM
HOLDER = r"""
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import signal, time\n"
                          "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                          "time.sleep(120)"], env={}, start_new_session=True)
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(child.pid))
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(120)
"""


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.fixture
def holder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("GPUSD_FENCE_GRACE", "0.5")
    monkeypatch.setenv("GPUSD_FENCE_DELAY", "0.5")
    lease = LeaseId.new()
    child_file = tmp_path / "child"
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(child_file)], env=dict(os.environ, GPUSD_LEASE=lease))
    from waiting import wait_until_sync

    wait_until_sync(child_file.exists, 20, step=0.05, what="the holder's child to start")
    child = int(child_file.read_text())
    yield lease, p, child
    for pid in (p.pid, child):
        if not gone(pid):
            os.kill(pid, signal.SIGKILL)
    p.wait(10)


def run_fence(lease: str, on_gpus, reports: list[list[int]]) -> threading.Event:
    done = threading.Event()
    f = fence.Fence(lease, ["GPU-x"], on_gpus, lambda pids: done.set(), reports.append)
    f.start()
    return done


def test_the_lease_processes_are_its_holders_and_their_descendants_only(holder) -> None:
    lease, p, child = holder
    found = fence.lease_processes(lease)
    assert set(found) == {p.pid, child}  # the child cleared the variable: found through the tree
    assert fence.lease_processes(LeaseId.new()) == {}


def test_sigterm_then_sigkill_after_the_grace_reaches_every_descendant(holder) -> None:
    lease, p, child = holder
    reports: list[list[int]] = []
    done = run_fence(lease, lambda devices: set(), reports)
    assert done.wait(30)
    assert p.wait(10) == -signal.SIGTERM  # the holder ended with SIGTERM
    assert gone(child)  # the child ignored it: SIGKILLed after the grace
    assert reports == []


def test_a_gpu_that_still_shows_a_fenced_process_is_not_given_back(holder) -> None:
    lease, p, child = holder
    shown = {child}
    looks: list[int] = []

    def on_gpus(devices: list[str]) -> set[int]:
        looks.append(1)
        return set(shown)

    reports: list[list[int]] = []
    done = run_fence(lease, on_gpus, reports)
    from waiting import wait_until_sync

    wait_until_sync(lambda: reports, 30, step=0.05, what="the stuck process to be reported")
    assert reports == [[child]] and not done.is_set()  # after the lock-delay: reported, still held
    n = len(looks)
    wait_until_sync(lambda: len(looks) > n + 1, 30, step=0.05, what="the GPU to be looked at again")
    assert not done.is_set()
    shown.clear()  # the driver lets go of it
    assert done.wait(30)


def test_a_reused_pid_is_never_tracked(holder) -> None:
    lease, p, child = holder
    (started,) = [v for k, v in fence.lease_processes(lease).items() if k == child]
    tracked = fence.track({child: started})
    assert [t.pid for t in tracked] == [child]
    for t in tracked:
        t.close()
    assert fence.track({child: started + 1}) == []  # another process under that pid: left alone


def test_a_pid_on_the_gpu_that_another_process_took_does_not_hold_the_gpu() -> None:
    """A stopped process's pid shown on a GPU counts while no other process took it: gone from
    /proc (the driver's list lags) it holds the GPU, a new process under that pid does not."""
    me = os.getpid()
    f = fence.Fence(LeaseId.new(), ["GPU-x"], lambda devices: {me, 2**22 + 7}, lambda pids: None, lambda pids: None)
    st = fence._stat(me)
    assert st is not None
    f.fenced = {me: st[1], 2**22 + 7: 1}
    assert f._shown() == {me, 2**22 + 7}  # this very process, and a pid no process has
    f.fenced = {me: st[1] + 1, 2**22 + 7: 1}
    assert f._shown() == {2**22 + 7}  # another process under a fenced pid: not the fenced one
