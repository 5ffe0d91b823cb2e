"""``gpusd adopt PID``: a running GPU process made a lease, held until it exits (docs/allocation.md,
"Adopting a running process").

The owner of the process (or root) asks; the kernel says who that is (the caller's uid, and the
process's from /proc), never a request field.  The lease is on the GPUs NVML lists the process on,
its holder is the process's user, and it is kernel-held like every lease: a small holder process
(``python -m gpusd.alloc.adopt``, in a session of its own; started by root for someone's process, it
becomes that user before it asks the lease authority, which believes only the kernel, and in the lock
directory writes root's record naming that user, as only root's may) takes it,
through the lease authority where a daemon serves one, else in the lock directory, and keeps its
descriptors until the process's pidfd says it exited.  The pidfd is opened before the lease is taken,
and the process's start time checked after, so a pid reused meanwhile is never adopted.

Refused: another user's process, a process on no GPU, a GPU leased to someone (each lease named),
and what the fair-use policy's caps refuse (:mod:`.policy`).
"""

from __future__ import annotations

import array  # noqa: F401 -- the lease authority's fd passing, imported before _become switches user
import json
import os
import pwd
import select
import socket  # noqa: F401 -- as array
import subprocess
import sys

from ..errors import BackendUnavailable, ConfigError, GpusdError, NoGpuAvailable
from ..sanitize import for_terminal, json_object
from .api import LeaseRequest, allocate, shared_backend
from .authority import connect
from .handle import Holder
from .leases import LeaseStore
from .lockdir import user_name
from .select import Constraints

# typing is not imported at run time: start-up time
TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from typing import Any, Sequence

# seconds the CLI waits for the holder's answer (a lease through a busy daemon)
ANSWER_TIMEOUT = 120.0


def owner_and_start(pid: int) -> tuple[int, int]:
    """(real uid, start time in clock ticks) of ``pid`` from /proc; ConfigError when there is none."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            status = f.read(16384)
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read(4096)
    except OSError:
        raise ConfigError(f"no process {pid} on this machine") from None
    uid = next((int(line.split()[1]) for line in status.splitlines() if line.startswith(b"Uid:")), None)
    try:
        # field 22, after the command's parentheses
        start = int(stat[stat.rindex(b")") + 2:].split()[19])
    except (ValueError, IndexError):
        raise ConfigError(f"cannot read process {pid}") from None
    if uid is None:
        raise ConfigError(f"cannot read process {pid}")
    return uid, start


def _user(uid: int) -> str:
    return user_name(uid) or str(uid)


def gpus_of(pid: int) -> tuple[list[str], bool]:
    """The UUIDs of the GPUs NVML lists ``pid`` on (a MIG slice's own UUID where it runs on one), and
    whether they are MIG slices."""

    try:
        snap = shared_backend().snapshot()
    except BackendUnavailable as exc:
        # no simulated GPUs to offer: a real process runs on real ones
        raise BackendUnavailable(f"cannot list the GPU processes: {exc.reason}") from None
    out: list[str] = []
    slices = False
    for g in snap.gpus:
        for p in g.processes:
            if p.pid != pid:
                continue
            mig = next((m for m in g.mig_instances if p.gpu_instance_id is not None
                        and m.gpu_instance_id == p.gpu_instance_id), None)
            slices = slices or mig is not None
            uuid = mig.uuid if mig is not None else g.uuid
            if uuid not in out:
                out.append(uuid)
    return out, slices


def check(pid: int, caller: int | None = None) -> tuple[int, int, list[str], bool]:
    """(the process's uid, its start time, its GPUs) once everything that can be checked before the
    lease is: the caller (``os.geteuid()``) owns it or is root; NVML lists it on a GPU; no lease is on
    those GPUs (each named).  Raises ConfigError / NoGpuAvailable with a one-line reason."""
    if pid <= 0 or pid >= 2**31:
        raise ConfigError(f"not a process id: {pid}")
    caller = os.geteuid() if caller is None else caller
    uid, start = owner_and_start(pid)
    if caller != 0 and uid != caller:
        raise ConfigError(f"process {pid} belongs to {_user(uid)}: only its owner or root may adopt it")
    uuids, slices = gpus_of(pid)
    if not uuids:
        raise ConfigError(f"process {pid} runs on no GPU (NVML lists it on none): nothing to adopt")

    held = [le for le in LeaseStore().leases() if le.device in uuids and not le.unleased]
    if held:
        names = "; ".join(f"{for_terminal(le.device, 48)} by {for_terminal(le.user, 32) or '?'} (lease "
                          f"{for_terminal(le.lease_id, 16)}, pid {le.pid})" for le in held[:8])
        raise NoGpuAvailable(f"process {pid}'s GPUs are leased already: {names}")
    return uid, start, uuids, slices


def adopt(pid: int, note: str | None = None, timeout: float = ANSWER_TIMEOUT) -> dict[str, Any]:
    """Adopt ``pid``: the holder's answer (``lease``, ``devices``, ``holder`` pid) once it holds the
    lease; raises the refusal (one line) otherwise."""
    uid, start, uuids, slices = check(pid)
    cmd = [sys.executable, "-m", "gpusd.alloc.adopt", str(pid), str(start), str(uid), ",".join(uuids),
           "mig" if slices else "gpu", (note or "")[:200]]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            start_new_session=True, close_fds=True)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline(65536) if ready else b""
    proc.stdout.close()
    try:
        answer: dict[str, Any] | None = json_object(line)
    except ValueError:
        answer = None
    if answer is None or answer.get("ok") is not True:
        if proc.poll() is None and not ready:
            proc.kill()
        proc.wait(timeout=10) if proc.poll() is None and not ready else None
        why = answer.get("error") if isinstance(answer, dict) else None
        raise NoGpuAvailable(str(why)[:400] if why else f"the adopting holder of process {pid} failed")
    return answer


# -- the holder ----------------------------------------------------------------------------------------
def _become(uid: int) -> None:
    """Run as ``uid`` (root adopting someone's process: the lease is then that user's, by the kernel's
    word, through the lease authority too).  What the lease needs is imported first: after the switch,
    the interpreter's own files may not be readable: this module imports it all at its top."""
    try:
        pw = pwd.getpwuid(uid)
        gid, home, name = pw.pw_gid, pw.pw_dir, pw.pw_name
    except KeyError:
        # a uid without a passwd entry: the kernel knows only numbers
        gid, home, name = uid, "/", str(uid)
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    os.environ.update(HOME=home, USER=name, LOGNAME=name)


def hold(pid: int, start: int, uid: int, uuids: Sequence[str], note: str, slices: bool = False) -> int:
    """The holder: take the lease as ``uid``, answer on stdout, keep it until ``pid`` exits."""
    def answer(d: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(d) + "\n")
        sys.stdout.flush()

    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        answer({"ok": False, "error": f"process {pid} has exited"})
        return 1
    try:
        if owner_and_start(pid) != (uid, start):
            raise ConfigError(f"process {pid} has exited (its pid is another process's now)")

        what = f"adopted pid {pid}" + (f": {note}" if note else "")
        c = Constraints.build(count=len(uuids), include=list(uuids), topology="any", within_visible=False,
                              vendor="any", mig=slices)
        holder = Holder(command=what)
        # root, for someone's process
        if uid != os.geteuid():
            sock = connect()
            # the daemon believes only the kernel: ask it as that user
            if sock is not None:
                sock.close()
                _become(uid)
            else:
                # in the lock directory, root's record may name the user (whose caps then apply)
                holder = Holder(command=what, user=_user(uid), uid=uid)
        sel = allocate(LeaseRequest(c, lease=True, wait=False, holder=holder))
    except GpusdError as exc:
        answer({"ok": False, "error": str(exc)})
        return 1
    except Exception as exc:  # noqa: BLE001 -- one line for the caller, never a traceback
        answer({"ok": False, "error": f"cannot adopt process {pid}: {type(exc).__name__}: {str(exc)[:200]}"})
        return 1
    got = sorted(d.uuid for d in sel.devices)
    # never a lease on other GPUs than the process's
    if got != sorted(uuids):
        sel.release()
        answer({"ok": False, "error": f"could not lease exactly process {pid}'s GPUs"})
        return 1
    lease = sel.lease
    answer({"ok": True, "lease": lease.lease_id if lease is not None else None, "devices": got,
            "holder": os.getpid(), "user": _user(uid)})
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    # a pidfd is readable once its process has exited
    while not poller.poll(None):
        pass
    sel.release()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    pid, start, uid = int(args[0]), int(args[1]), int(args[2])
    return hold(pid, start, uid, [u for u in args[3].split(",") if u], args[5] if len(args) > 5 else "",
                args[4] == "mig")


if __name__ == "__main__":
    sys.exit(main())
