"""The lease handle (gpusd.alloc.handle): the flock store's leases and the lease authority's behave
alike where code outside alloc relies on them, and only alloc touches the lock files."""

from __future__ import annotations

import ast
import os
import re
import time
from pathlib import Path

import pytest

from authority_helpers import ServerThread
from gpusd.alloc.api import LeaseRequest, allocate
from gpusd.alloc.authority import RemoteLease
from gpusd.alloc.handle import Holder, LeaseHandle
from gpusd.alloc.leases import Lease, LeaseStore
from gpusd.alloc.select import Constraints
from gpusd.errors import GpusdError

SIM = "3xA100-80GB"
JOB = "0123456789ab"
SRC = Path(__file__).resolve().parents[2] / "src" / "gpusd"


@pytest.fixture(params=["flock", "authority"])
def take(request):
    """A function taking a lease of ``count`` GPUs for a holder, in the lock directory or through a
    lease authority served by this test (its own socket and directory: tests/conftest.py)."""
    server = ServerThread(SIM) if request.param == "authority" else None

    def lease(count: int) -> LeaseHandle:
        holder = Holder(command="handle test", job=JOB)
        if server is None:
            sel = allocate(LeaseRequest(Constraints(count=count), simulate=SIM, holder=holder), store=LeaseStore())
        else:
            sel = allocate(LeaseRequest(Constraints(count=count), holder=holder))  # asked of the authority
        assert sel.lease is not None
        return sel.lease

    lease.kind = request.param  # type: ignore[attr-defined]
    yield lease
    if server is not None:
        server.stop()


def _recorded(lease_id: str) -> list:
    return [le for le in LeaseStore().leases() if le.lease_id == lease_id]


def _eventually(predicate, timeout: float = 20.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_a_lease_is_a_handle_that_says_what_it_holds_and_for_whom(take):
    lease = take(1)
    try:
        assert isinstance(lease, LeaseHandle)
        assert isinstance(lease, Lease if take.kind == "flock" else RemoteLease)
        assert len(lease.devices) == 1 and not lease.shared and not lease.released
        assert lease.holder.job == JOB and lease.holder.command == "handle test"
        recorded = _recorded(lease.lease_id)
        assert [le.device for le in recorded] == lease.devices
        assert recorded[0].job == JOB and recorded[0].command == "handle test" and recorded[0].pid == os.getpid()
        assert lease.fds and all(os.fstat(fd) for fd in lease.fds)  # what a command inherits
    finally:
        lease.release()


def test_a_handle_ends_its_lease_at_the_end_of_a_with_block(take):
    with take(1) as lease:
        lease_id = lease.lease_id
        assert _recorded(lease_id)
    assert lease.released and lease.fds == []
    assert _eventually(lambda: not _recorded(lease_id))
    lease.release()  # idempotent


def test_a_handle_gives_one_gpu_back_and_keeps_the_last(take):
    lease = take(2)
    try:
        keep, back = lease.devices
        lease.give_back(back)
        assert lease.devices == [keep]
        assert _eventually(lambda: [le.device for le in _recorded(lease.lease_id)] == [keep])
        with pytest.raises(GpusdError):
            lease.give_back(keep)  # a lease keeps at least one GPU
        assert lease.devices == [keep]
        again = take(2)  # 3 GPUs, 1 held: the GPU given back is free for someone else at once
        try:
            assert back in again.devices and keep not in again.devices
        finally:
            again.release()
    finally:
        lease.release()


def test_a_handle_updates_its_record_only_as_far_as_it_may(take):
    lease = take(1)
    try:
        lease.update(job=JOB, command="handle test")  # what it says already: both handles accept it
        assert [le.job for le in _recorded(lease.lease_id)] == [JOB]
        if take.kind == "flock":  # the holder writes its record itself (under the store's mutex)
            lease.update(expires=time.time() + 600)
            assert _recorded(lease.lease_id)[0].expires is not None
        else:  # the daemon keeps the record: no request can change it
            with pytest.raises(GpusdError, match="keeps this lease's record"):
                lease.update(expires=time.time() + 600)
    finally:
        lease.release()
    with pytest.raises(GpusdError):
        lease.update(job=JOB)  # the lease has ended


def test_a_flock_lease_keeps_recording_a_gpu_its_command_still_holds_until_it_settles():
    """A job shrunk while its command runs: the command's inherited copy keeps the GPU's lock, so the
    record keeps naming it (lingering) until the command is gone; a GPU the command moved off (with
    cuda-checkpoint) is unlocked for everyone at once.  All through the handle, under the mutex."""
    import subprocess

    store = LeaseStore()
    lease = store.acquire(["GPU-a", "GPU-b", "GPU-c"], holder=Holder(job=JOB))
    assert lease is not None
    command = subprocess.Popen(["sleep", "60"], pass_fds=lease.fds)  # the command inherits every lock
    try:
        lease.give_back("GPU-b", linger=True)
        assert lease.devices == ["GPU-a", "GPU-c"] and list(lease.lingering) == ["GPU-b"]
        assert sorted(le.device for le in _recorded(lease.lease_id)) == ["GPU-a", "GPU-b", "GPU-c"]
        assert store.acquire(["GPU-b"]) is None  # still locked: the command holds it
        lease.give_back("GPU-c", unlock=True)  # the command runs elsewhere now: free for everyone
        assert sorted(le.device for le in _recorded(lease.lease_id)) == ["GPU-a", "GPU-b"]
        other = store.acquire(["GPU-c"])
        assert other is not None
        other.release()
        command.kill()
        command.wait()
        lease.settle()  # the command is gone: the lingering GPU is freed and no longer recorded
        assert lease.lingering == {} and [le.device for le in _recorded(lease.lease_id)] == ["GPU-a"]
        other = store.acquire(["GPU-b"])
        assert other is not None
        other.release()
        assert [le.job for le in _recorded(lease.lease_id)] == [JOB]  # the record still names its holder
    finally:
        if command.poll() is None:
            command.kill()
            command.wait()
        lease.release()


# -- only alloc touches the lock files ------------------------------------------------------------

_LOCK_FILE = re.compile(r"^(gpu-\{\}\.lock|select\.lock|\.?lease-\{\}.*\.(json|tmp)|\.lease-.*)$")
_LOCK_PRIMITIVES = {"open_lock_file", "try_lock", "lock_within"}
_LEASE_INTERNALS = {"record_fd", "device_fds", "lingering", "info_fd"}


def _template(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    return None


def lock_file_uses(source: str) -> list[str]:
    """What in ``source`` opens, writes or locks a lease's lock files, or reaches into a lease's descriptors."""
    tree = ast.parse(source)
    matched = {id(a) for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
               and n.func.attr in ("match", "fullmatch") for a in n.args}  # a name checked, not a file opened
    found = []
    for node in ast.walk(tree):
        text = _template(node)
        if text is not None and id(node) not in matched and _LOCK_FILE.match(text):
            found.append(f"line {node.lineno}: the lock file name {text!r}")  # type: ignore[attr-defined]
        if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("alloc.lockdir"):
            found += [f"line {node.lineno}: imports {a.name}" for a in node.names if a.name in _LOCK_PRIMITIVES]
        if isinstance(node, ast.Attribute) and node.attr in _LEASE_INTERNALS:
            found.append(f"line {node.lineno}: a lease's {node.attr}")
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "fds":
            found.append(f"line {node.lineno}: indexes a lease's fds (the record is not fds[-1] any more)")
    return found


def test_no_module_outside_alloc_opens_a_lease_lock_file():
    offenders = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        if rel.parts[0] == "alloc":
            continue
        found = lock_file_uses(path.read_text())
        if found:
            offenders[str(rel)] = found
    assert offenders == {}


def test_the_check_sees_a_supervisor_that_writes_its_lease_record_itself():
    """The supervisor of 0.2 rewrote its lease record by hand (jobs/supervisor.py): the check above
    would have failed on it."""
    old = '''
from ..alloc.lockdir import create_exclusive
def _rewrite_lease(self):
    raw = os.pread(lease.info_fd, MAX_LEASE_BYTES, 0)
    tmp = f".lease-{lease.lease_id}-{os.urandom(3).hex()}.tmp"
    fd = create_exclusive(dfd, tmp, self.store.dir)
    old = lease.fds[-1]
'''
    found = lock_file_uses(old)
    assert any("info_fd" in f for f in found) and any(".lease-" in f for f in found) and any("fds" in f for f in found)
    assert lock_file_uses('if not _LEASE_NAME.match(f"lease-{args.lease}.json"): pass') == []  # a name check
