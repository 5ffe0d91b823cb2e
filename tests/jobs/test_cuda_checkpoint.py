"""Issue 13 item 6: the cuda-checkpoint tool as gpusd calls it (gpusd.jobs.checkpoint), against a fake tool
that keeps each process's CUDA state as the real one does (tests/jobs_helpers.py): the calls, their order,
their bounds, and that a failure leaves no process locked.  No GPU here: the real tool is verified only on
a machine with one (docs/jobs.md)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fakenvml import fake_uuid
from gpusd.jobs.checkpoint import CheckpointFailed, CudaCheckpoint, process_tree
from jobs_helpers import fake_calls, fake_cuda_checkpoint, fake_state

OLD, NEW = fake_uuid(0), fake_uuid(1)


@pytest.fixture
def tool(tmp_path, monkeypatch):
    bindir, state = fake_cuda_checkpoint(tmp_path)
    monkeypatch.setenv("FAKE_CKPT_DIR", str(state))
    return CudaCheckpoint(str(bindir / "cuda-checkpoint"), timeout=10), state


@pytest.fixture
def proc():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        yield p
    finally:
        p.kill()
        p.wait()


def _actions(state, pid: int) -> list[list[str]]:
    return [c for c in fake_calls(state) if "--action" in c and c[c.index("--pid") + 1] == str(pid)]


def test_a_move_locks_checkpoints_restores_onto_the_new_gpu_and_unlocks(tool, proc):
    t, state = tool
    assert t.unsupported() is None
    assert t.migrate(proc.pid, {OLD: NEW}) == [proc.pid]
    assert [c[1] for c in _actions(state, proc.pid)] == ["lock", "checkpoint", "restore", "unlock"]
    lock, _, restore, _ = _actions(state, proc.pid)
    assert lock[-2] == "--timeout" and 0 < int(lock[-1]) < 10_000  # the tool gives up before gpusd does
    assert restore[-2:] == ["--device-map", f"{OLD}={NEW}"]
    assert fake_state(state, proc.pid) == "running"


def test_a_failed_restore_puts_the_process_back_on_its_gpu_and_unlocks_it(tool, proc):
    t, state = tool
    (state / "fail-restore").write_text("exit")  # the mapped restore fails (as in cuda-checkpoint issue 35)
    with pytest.raises(CheckpointFailed, match="restore failed .*invalid argument.*run on their old GPUs again"):
        t.migrate(proc.pid, {OLD: NEW})
    acts = _actions(state, proc.pid)
    assert [c[1] for c in acts] == ["lock", "checkpoint", "restore", "restore", "unlock"]
    assert "--device-map" in acts[2] and "--device-map" not in acts[3]  # put back where it was
    assert fake_state(state, proc.pid) == "running"  # never left locked


def test_every_call_is_bounded_and_a_hung_checkpoint_is_undone(tool, proc):
    t, state = tool
    t.timeout = 1.5
    (state / "fail-checkpoint").write_text("hang")
    with pytest.raises(CheckpointFailed, match="did not answer within 1.5s"):
        t.migrate(proc.pid, {OLD: NEW})
    assert [c[1] for c in _actions(state, proc.pid)] == ["lock", "checkpoint", "unlock"]
    assert fake_state(state, proc.pid) == "running"


def test_a_tool_without_gpu_migration_is_not_used(tool, proc):
    t, state = tool
    (state / "no-device-map").write_text("")
    assert "r580" in str(t.unsupported())
    with pytest.raises(CheckpointFailed, match="no --device-map"):
        t.migrate(proc.pid, {OLD: NEW})
    assert _actions(state, proc.pid) == []  # nothing was locked


def test_a_gpu_uuid_that_would_rewrite_the_device_map_is_refused(tool, proc):
    """A UUID comes from NVML (a GPU's data is hostile): one with ',' or '=' would add pairs of its own to
    --device-map; it is refused before the tool is run."""
    t, state = tool
    for bad in (f"{NEW},{OLD}={OLD}", f"{NEW}={OLD}", "--pid", f"{NEW}\n"):
        with pytest.raises(CheckpointFailed, match="not a GPU UUID"):
            t.migrate(proc.pid, {OLD: bad})
    assert fake_calls(state) == []


def test_a_process_someone_else_has_locked_is_left_alone(tool, proc):
    t, state = tool
    (state / f"state-{proc.pid}").write_text("locked")
    with pytest.raises(CheckpointFailed, match="is locked, not running"):
        t.migrate(proc.pid, {OLD: NEW})
    assert _actions(state, proc.pid) == []
    assert fake_state(state, proc.pid) == "locked"


def test_the_process_tree_is_the_command_and_its_descendants():
    p = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                          "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
                          "print(c.pid, flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        child = int(p.stdout.readline())
        tree = process_tree(p.pid)
        assert tree[0] == p.pid and child in tree and os.getpid() not in tree
        assert process_tree(p.pid, limit=1) == [p.pid]
    finally:
        os.kill(child, 9)
        p.kill()
        p.wait()
