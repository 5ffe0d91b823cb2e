"""What the engine commands keep about a held reservation (docs/engines.md): the record Horovod's
discovery script reads, and the renewer pid that ``gpusd ray down`` signals, which comes from a file
and is only signalled while it is still one of gpusd's renewers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from gpusd.alloc.lockdir import process_start as _process_start
from gpusd.engines.placement import Placement
from gpusd.engines.records import end_renewer, held_placement, renewer_of

P = Placement.of([("node-1", [0, 2]), ("node-2", [1])], job_id="job-7")


def _record(tmp_path: Path, pid: int, until: float | None, started: float | None = None) -> str:
    path = tmp_path / "job-7.json"
    started = _process_start(pid) if started is None else started
    path.write_text(json.dumps({"placement": P.to_dict(), "pid": pid, "pid_started": started, "until": until}))
    return str(path)


def test_the_discovery_record_lists_the_hosts_only_while_they_are_held(tmp_path: Path) -> None:
    assert held_placement(_record(tmp_path, os.getpid(), None)) == P
    # the holder's pid now names another process (reused): its start time is not the holder's
    mine = _process_start(os.getpid())
    assert mine is not None
    assert held_placement(_record(tmp_path, os.getpid(), None, started=mine - 3600)) is None
    assert held_placement(_record(tmp_path, os.getpid(), time.time() + 60)) == P
    assert held_placement(_record(tmp_path, os.getpid(), time.time() - 1)) is None  # --for is up
    dead = subprocess.Popen(["true"])
    dead.wait()
    assert held_placement(_record(tmp_path, dead.pid, None)) is None  # the holder is gone
    assert held_placement(str(tmp_path / "missing.json")) is None  # released
    (tmp_path / "bad.json").write_text("{not json")
    assert held_placement(str(tmp_path / "bad.json")) is None


def test_ray_down_signals_only_a_renewer_of_gpusd(tmp_path: Path) -> None:
    """A renewer pid read back from the state file may have been reused by any process: ray down
    leaves a process that is not ``gpusd.pool.renewer`` alone."""
    other = subprocess.Popen(["sleep", "30"])
    try:
        assert renewer_of(other.pid, _process_start(other.pid)) is None
        end_renewer({"renewer_pid": other.pid, "renewer_started": _process_start(other.pid)}, timeout=1)
        assert other.poll() is None
        for bad in (None, "12", True, 1, -5):
            assert renewer_of(bad, time.time()) is None
    finally:
        other.kill()
        other.wait()
    # a real renewer with nothing to renew ends on its own; one waiting on its input is ours to stop
    renewer = _idle_renewer()
    try:
        started = _wait_renewer(renewer)
        end_renewer({"renewer_pid": renewer.pid, "renewer_started": started}, timeout=10)  # returns once ended
        renewer.wait(timeout=0.5)  # raises if it still runs
    finally:
        if renewer.poll() is None:
            renewer.kill()
        renewer.wait()


def _idle_renewer() -> "subprocess.Popen[bytes]":
    """A real ``python -m gpusd.pool.renewer`` waiting on its input (nothing to renew yet)."""
    return subprocess.Popen([sys.executable, "-m", "gpusd.pool.renewer"], stdin=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")})


def _wait_renewer(renewer: "subprocess.Popen[bytes]") -> float:
    """The renewer's start time, once its command line says it is one."""
    started = _process_start(renewer.pid)
    assert started is not None
    deadline = time.monotonic() + 10
    while renewer_of(renewer.pid, started) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert renewer_of(renewer.pid, started) == renewer.pid
    return started


def test_ray_down_never_signals_a_renewer_that_reused_the_pid() -> None:
    """The pid a cluster record names may now be another renewer of the same user (same uid, same
    command line): only the kernel's start time tells them apart, and ray down leaves it alone."""
    renewer = _idle_renewer()
    try:
        started = _wait_renewer(renewer)
        # the record's renewer started an hour before the process that now has its pid
        record = {"renewer_pid": renewer.pid, "renewer_started": started - 3600}
        assert renewer_of(renewer.pid, started - 3600) is None
        end_renewer(record, timeout=1)
        end_renewer({**record}, timeout=1, release=False)
        end_renewer({"renewer_pid": renewer.pid}, timeout=1)  # a record without a start time (0.2)
        time.sleep(0.3)
        assert renewer.poll() is None  # neither SIGTERM nor SIGUSR1 reached it
    finally:
        if renewer.poll() is None:
            renewer.kill()
        renewer.wait()
