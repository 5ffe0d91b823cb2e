"""The command a job's supervisor runs (docs/jobs.md): started, signalled, stopped, started again.

A :class:`Child` is one command at a time (a restart starts the next one in the same object).  It
is signalled only through the pidfd opened at spawn, before anyone could reap it, so a signal never
reaches a process that reused its pid (nor, for a command in its own process group, a group that
reused its group id).  A stop is SIGCONT (a paused command must be able to exit), SIGTERM, and
SIGKILL after the grace period, for the whole group; what is left of the group after the leader
exits gets the rest of the grace, then SIGKILL (:meth:`Child.end_group`).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

# typing is not imported at run time: start-up time
TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    import subprocess
    from typing import Any, Callable, Sequence

# subprocess forks the whole supervisor when given a preexec_fn, and vfork()s it otherwise (checked with strace on
# CPython 3.10-3.12; 3.13 vforks the plain and process_group cases too): from 3.11 on, Popen makes the command's
# own process group itself (process_group=0), so a --preemptible or --pausable command is spawned as cheaply as
# any other.
GROUP_AT_SPAWN = sys.version_info >= (3, 11)


def private_dir(job_id: str) -> str:
    """A new directory for the job's protocol file, the command's to read: ``gpusd-job-<ID>-<random>``
    in the temporary directory (``$TMPDIR``, ``$TEMP``, ``$TMP``, else /tmp, /var/tmp), mode 0700, made by
    ``mkdir`` (which fails where the name exists: never someone else's directory or link), as
    ``tempfile.mkdtemp`` makes it, without its import (shutil, random, bz2, lzma: ~4 ms of every
    ``gpusd run``, 40 of them starting at once in a burst of submissions)."""
    bases = [os.environ.get(var, "") for var in ("TMPDIR", "TEMP", "TMP")] + ["/tmp", "/var/tmp"]
    last: OSError | None = None
    for base in (b for b in bases if b):
        for _ in range(100):
            path = os.path.join(os.path.abspath(base), f"gpusd-job-{job_id}-{os.urandom(6).hex()}")
            try:
                os.mkdir(path, 0o700)
            except FileExistsError:
                # (a name taken: another random one)
                continue
            except OSError as exc:
                # not there, not ours to write: the next place
                last = exc
                break
            return path
    raise last or FileExistsError("no free name for the job's directory")


def remove_private_dir(path: str | os.PathLike[str]) -> None:
    """Remove what :func:`private_dir` made: its files one by one through a descriptor of the directory
    itself (opened ``O_NOFOLLOW``: a link put in its place is not followed; each file unlinked, never
    followed), then the directory; where more is in it (a directory the command made), ``shutil.rmtree``,
    which follows no link either."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    except OSError:
        # not a directory (a link in its place): not ours to look into
        return
    try:
        for name in os.listdir(fd):
            try:
                os.unlink(name, dir_fd=fd)
            except FileNotFoundError:
                continue  # (gone meanwhile)
        os.rmdir(path)
    except OSError:
        import shutil

        shutil.rmtree(path, ignore_errors=True)
    finally:
        os.close(fd)


def log(message: str) -> None:
    print(f"gpusd: {message}", file=sys.stderr, flush=True)


class Child:
    """The job's command (:attr:`proc`), its own process group (:attr:`pgid`, when it has one) and
    its pidfd (:attr:`pidfd`)."""

    def __init__(self, name: str = "job") -> None:
        # for the log: "job <ID>"
        self.name = name
        self.proc: subprocess.Popen[bytes] | None = None
        # the command's own process group (when it has one)
        self.pgid: int | None = None
        # the command's pidfd: signals that cannot reach a reused pid
        self.pidfd: int | None = None
        # when the grace of the last stop ends
        self.stop_deadline: float | None = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, cmd: Sequence[str], env: dict[str, str], pass_fds: Sequence[int], own_group: bool,
              preexec_fn: Callable[[], None] | None) -> subprocess.Popen[bytes]:
        """Start ``cmd`` (FileNotFoundError, PermissionError as Popen raises them), in a process group
        of its own with ``own_group`` (made by Popen where :data:`GROUP_AT_SPAWN`, else by
        ``preexec_fn``).  The previous command was reaped before."""
        # on the first start: a job waiting for GPUs (its whole queue time) needs none
        import subprocess

        kw: dict[str, Any] = {"process_group": 0} if own_group and GROUP_AT_SPAWN else {}
        proc = subprocess.Popen(list(cmd), env=env, pass_fds=list(pass_fds), preexec_fn=preexec_fn, **kw)
        self.proc = proc
        self.pgid = proc.pid if own_group else None
        self.stop_deadline = None
        # the previous command's (reaped before a new one starts)
        if self.pidfd is not None:
            os.close(self.pidfd)
        # before anyone can reap it: the pidfd names this command for good
        try:
            self.pidfd = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):  # pragma: no cover - a kernel without pidfds
            self.pidfd = None
        return proc

    def wait(self) -> int:
        assert self.proc is not None
        return self.proc.wait()

    def signal(self, signum: int) -> None:
        """Signal the running command (its process group when it has one), never a process that
        reused its pid: see :func:`signal_command`."""
        if self.proc is not None:
            signal_command(self.pidfd, self.pgid, self.proc.pid, signum)

    def notify(self, signum: int) -> str:
        """Send ``signum`` to the command, but only if it catches it (the kernel's ``SigCgt``): a
        program without a handler would be ended by it (SIGUSR1's default action).  Says how the
        command was told, for grow's and shrink's answer."""
        name = signal.Signals(signum).name
        proc, pidfd = self.proc, self.pidfd
        if proc is None or proc.poll() is not None:
            return "no command runs now: it sees the job file when it starts"
        catching = catches(proc.pid, signum)
        # The main thread may reap the command between poll() and here, and its pid go to another
        # process: the mask read was the command's only if its pidfd still names a live process, and
        # the signal goes through the pidfd (never to whoever has the pid now).
        try:
            if pidfd is not None:
                signal.pidfd_send_signal(pidfd, 0)
            if not catching:
                return (f"the command does not catch {name}: not signalled (that would end it), it sees the "
                        "change in $GPUSD_JOB_FILE")
            if pidfd is not None:
                signal.pidfd_send_signal(pidfd, signum)
            else:  # pragma: no cover - a kernel without pidfds (before Linux 5.3)
                os.kill(proc.pid, signum)
        except ProcessLookupError:
            return "the command had exited"
        return f"the command was sent {name}"

    def stop(self, grace: float) -> bool:
        """SIGCONT and SIGTERM to the command (its group), SIGKILL after ``grace`` seconds; False when
        no command runs."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return False
        self.stop_deadline = time.monotonic() + grace
        pgid = self.pgid
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        # the thread's own descriptor of this command: self.pidfd is closed (and its number may be
        # reused) when the next command starts, before the grace period is over
        pidfd, had = _dup(self.pidfd), self.pidfd is not None

        # imported by start() already
        from subprocess import TimeoutExpired

        def kill_later() -> None:
            try:
                proc.wait(grace)
            except TimeoutExpired:
                log(f"{self.name}: no exit within the {grace:g}s grace period: SIGKILL")
                # no dup (out of descriptors): never by the bare pid
                if pidfd is not None or not had:
                    signal_command(pidfd, pgid, proc.pid, signal.SIGKILL)
            finally:
                if pidfd is not None:
                    os.close(pidfd)

        threading.Thread(target=kill_later, daemon=True).start()
        return True

    def end_group(self, deadline: float) -> None:
        """The leader is gone; what is left of its group (children that ignore SIGTERM) gets until
        ``deadline``, then SIGKILL, before its GPUs are reused."""
        if self.pgid is not None:
            end_group(self.pgid, deadline)

    def close(self) -> None:
        if self.pidfd is not None:
            try:
                os.close(self.pidfd)
            except OSError:
                pass
            self.pidfd = None


def end_group(pgid: int, deadline: float) -> None:
    """Wait (until ``deadline``) for the process group ``pgid`` to empty, then SIGKILL what is left.
    The kernel does not reuse a pid while it names a group with members, so ``pgid`` is still the
    job's group; once it is seen empty it is never signalled again."""
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        except PermissionError:
            return  # not ours any more
        if time.monotonic() >= deadline:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except OSError:
                return
            # SIGKILL is delivered at once; the reaping may lag a little
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:
                try:
                    os.killpg(pgid, 0)
                except OSError:
                    return
                time.sleep(0.02)
            return
        time.sleep(0.05)


def catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum``: the ``SigCgt`` mask of
    /proc/PID/status (bit ``signum - 1``).  False when it cannot be read."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split(":", 1)[1].strip(), 16) >> (signum - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def signal_command(pidfd: int | None, pgid: int | None, pid: int, signum: int) -> None:
    """Signal the command that ``pidfd`` names (opened at spawn, before anyone could reap it): its
    process group ``pgid`` (the one made at spawn: --preemptible, --pausable, --on-change restart) while
    that pidfd still names a process not yet reaped — its pid, and so its group id, cannot have been
    reused then — else the command alone, through the pidfd.  A command already reaped is never
    signalled, nor whoever has its pid now (``pid`` serves only a kernel without pidfds)."""
    try:
        if pidfd is None:  # pragma: no cover - a kernel without pidfds (before Linux 5.3)
            if pgid is not None:
                os.killpg(pgid, signum)
            else:
                os.kill(pid, signum)
            return
        if pgid is None:
            signal.pidfd_send_signal(pidfd, signum)
            return
        # raises once the command was reaped
        signal.pidfd_send_signal(pidfd, 0)
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _dup(fd: int | None) -> int | None:
    try:
        return None if fd is None else os.dup(fd)
    except OSError:  # pragma: no cover - out of descriptors: the SIGKILL then goes nowhere
        return None
