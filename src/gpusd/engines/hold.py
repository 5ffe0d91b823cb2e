"""The host-side guard of an engine that outlives the command which started it (``gpusd ray up``).

``python3 -m gpusd.engines.hold --lease ID [--margin S] [--grace S] -- CMD ARGS`` runs on the host
whose daemon holds lease ID for us (started there over ssh, like every engine command):

* it forks; the part that stays becomes a session leader and a *child subreaper*
  (``PR_SET_CHILD_SUBREAPER``), so everything CMD starts — Ray's ``ray start`` daemonises raylet,
  GCS, the dashboard and the workers — stays its descendant even after CMD exits;
* it runs CMD with the caller's output; the part in the foreground exits with CMD's status once CMD
  has ended (``ray start`` returns when the node is up), so ssh returns;
* it then watches the lease the way the daemon sees it, in this host's lock directory (the daemon's
  record of a remote lease carries ``expires`` on this host's clock, docs/pool.md): when the time left
  is below ``--margin`` seconds (renewals stopped: a renewer killed, ``--for`` over, a laptop closed, a
  cut link), when the record is gone (released, the daemon restarted), or on SIGTERM (``--stop``), it
  sends SIGTERM to every descendant, SIGKILL ``--grace`` seconds later, and exits once none is left.

So the processes are gone *before* the daemon can give the GPUs to anyone else (it frees them at
``expires``), as long as the margin covers the stop: ``gpusd ray up`` passes ``--margin`` = TTL/4 (at
least 1 s) and ``--grace`` = half of it.  A renewal that comes late by more than TTL - TTL/3 - margin
(two heartbeats lost) stops the engine, as the lease would have ended soon after.

``python3 -m gpusd.engines.hold --stop --lease ID`` stops the guard of lease ID (found by its command
line among this user's processes: no pid file to go stale), waits until it has stopped its
processes, and exits 0; 3 when no guard of that lease runs here.

Exit status of the guard: CMD's when it fails (its processes are stopped too); 3 when the lease is not
held here (nothing is started); 2 on bad arguments.  Linux only (``/proc``).
"""

# Imports inside functions: start-up (a command's own module).
from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time
from typing import Callable, Sequence

from ..alloc.leases import LeaseStore
from ..errors import GpusdError, exec_failure

NO_LEASE = 3
# seconds between looks at the lease
POLL = 0.2
_ME = "gpusd.engines.hold"


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, session) of ``pid`` from /proc, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read(4096)
        fields = raw[raw.rindex(b")") + 2:].split()
        return fields[0].decode(), int(fields[1]), int(fields[3])
    except (OSError, ValueError, IndexError):
        return None


def members(root: int | None = None) -> list[int]:
    """The live (not zombie) processes started under ``root`` (default: this process): its
    descendants, and the processes of its session (``root`` is a session leader)."""
    root = os.getpid() if root is None else root
    parents: dict[int, int] = {}
    session: set[int] = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        st = _proc_stat(pid)
        if st is None or st[0] in ("Z", "X"):
            continue
        parents[pid] = st[1]
        if st[2] == root and pid != root:
            session.add(pid)
    out = set(session)
    for pid in parents:
        p, seen = pid, 0
        while p in parents and p not in (0, 1, root) and seen < 4096:
            p, seen = parents[p], seen + 1
        if p == root and pid != root:
            out.add(pid)
    return sorted(out)


def reap_children(child: int | None = None) -> int | None:
    """Collect every ended child (a subreaper's orphans included) without waiting; the wait status
    of ``child`` when it is among them."""
    found = None
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return found
        if pid == 0:
            return found
        if pid == child:
            found = status


def _reap() -> None:
    reap_children()


def stop_all(grace: float, reap: Callable[[], None] | None = None) -> int:
    """SIGTERM every process started under this one, SIGKILL what is left ``grace`` seconds later,
    and return once none is left (or 10 s after the SIGKILL: a process in uninterruptible sleep).
    ``reap`` collects ended children (default: discard their status).  How many were left for SIGKILL."""
    reap = reap or _reap
    killed = 0
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        pids = members()
        if sig == signal.SIGKILL:
            killed = len(pids)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + wait
        while True:
            reap()
            if not members() or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        if not members():
            return killed
    return killed


def lease_expires(store: LeaseStore, lease_id: str) -> float | bool:
    """When the daemon ends lease ``lease_id`` unless renewed (epoch, this host's clock); True for a
    lease without an end (a local one); False when no live lease of that id is here.

    Only the record of that lease is read (:meth:`LeaseStore.lease_of`, no scan that other users'
    files could fill), and it is believed only when root (the daemon that holds remote leases) or
    this user owns the file: the lock directory is open to every local user (mode 1777), and once
    the daemon removes the record of a lease that ended, anyone may write one of that id, live and
    due in a year, which would keep the engine running on GPUs the daemon has freed."""
    got = store.lease_of(lease_id)
    if got is None:
        return False
    owner, infos = got
    if owner not in (0, os.getuid()):
        return False
    expires = infos[0].expires
    return float(expires) if expires is not None else True


def set_subreaper() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        # PR_SET_CHILD_SUBREAPER; without it, the session still counts
        libc.prctl(36, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def guard(lease_id: str, margin: float, stopped: list[str], store: LeaseStore) -> str:
    """Watch until the processes must stop (or have all ended); the reason."""
    missing = 0
    rounds = 0
    while True:
        if stopped:
            return stopped[0]
        rounds += 1
        # a scan of /proc: once a second is enough for this
        if rounds % 5 == 1 and not members():
            return "its processes ended"
        end = lease_expires(store, lease_id)
        if end is False:
            missing += 1
            # read twice (POLL apart): the record is gone, not being replaced
            if missing >= 2:
                return f"the lease {lease_id} is gone (released, or the daemon restarted)"
        else:
            missing = 0
            if isinstance(end, float) and time.time() >= end - margin:
                return f"the lease {lease_id} was not renewed (it ends in {max(0.0, end - time.time()):.1f}s)"
        time.sleep(POLL)


def hold(lease_id: str, cmd: Sequence[str], margin: float, grace: float) -> int:
    store = LeaseStore()
    if lease_expires(store, lease_id) is False:
        print(f"gpusd: no lease {lease_id} in this host's lock directory ({store.dir}): not starting "
              f"{cmd[0]} (is the daemon's lock directory $GPUSD_LOCK_DIR here? a record is believed only when "
              "root, the daemon, or you own it)", file=sys.stderr, flush=True)
        return NO_LEASE
    sys.stdout.flush()
    sys.stderr.flush()
    r, w = os.pipe()
    child = os.fork()
    # the foreground part: CMD's status, then ssh may return
    if child:
        os.close(w)
        with os.fdopen(r, "rb") as f:
            said = f.read(16)
        try:
            return int(said)
        except ValueError:
            return 1
    os.close(r)
    try:
        os.setsid()
        set_subreaper()
        stopped: list[str] = []
        signal.signal(signal.SIGTERM, lambda _s, _f: stopped.append("stopped (SIGTERM)"))
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            rc = subprocess.call(list(cmd))
        except OSError as exc:
            print(f"gpusd: cannot start {cmd[0]}: {exc.strerror or exc}", file=sys.stderr, flush=True)
            rc = exec_failure(exc, cmd[0])[0]
        if rc != 0 or stopped:
            stop_all(grace)
            os.write(w, str(rc or 1).encode())
            os._exit(0)
        os.write(w, b"0")
        os.close(w)
        null = os.open(os.devnull, os.O_RDWR)
        # let go of ssh's channel
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        guard(lease_id, margin, stopped, store)
        stop_all(grace)
    except BaseException:  # noqa: BLE001 - the guard must not leave its processes behind
        try:
            stop_all(grace)
        finally:
            os._exit(1)
    os._exit(0)


def _is_guard_of(pid: int, lease_id: str) -> bool:
    try:
        if os.stat(f"/proc/{pid}").st_uid != os.getuid():
            return False
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = f.read(1 << 16).split(b"\0")
    except OSError:
        return False
    if _ME.encode() not in words or b"--stop" in words:
        return False
    try:
        i = words.index(b"--lease")
    except ValueError:
        return False
    return words[i + 1:i + 2] == [lease_id.encode()]


def guards_of(lease_id: str) -> list[int]:
    """This user's guards of ``lease_id`` (the foreground part too, while it waits)."""
    me = os.getpid()
    return [int(n) for n in os.listdir("/proc") if n.isdigit() and int(n) != me and _is_guard_of(int(n), lease_id)]


def stop(lease_id: str, timeout: float) -> int:
    pids = guards_of(lease_id)
    if not pids:
        print(f"gpusd: no guard of lease {lease_id} runs here (it stopped its processes when the lease ended, "
              "or was never started)", file=sys.stderr)
        return NO_LEASE
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass
    deadline = time.monotonic() + timeout
    while guards_of(lease_id):
        if time.monotonic() >= deadline:
            print(f"gpusd: the guard of lease {lease_id} did not stop within {timeout:g}s", file=sys.stderr)
            return 1
        time.sleep(0.05)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python3 -m {_ME}", description=__doc__.split("\n\n")[0])
    p.add_argument("--lease", required=True, help="the lease this host's daemon holds for the command")
    p.add_argument("--margin", type=float, default=5.0, help="stop this many seconds before the lease ends")
    p.add_argument("--grace", type=float, default=2.0, help="seconds between SIGTERM and SIGKILL")
    p.add_argument("--stop", action="store_true", help="stop the guard of --lease and wait for it")
    p.add_argument("--timeout", type=float, default=60.0, help="with --stop: wait this long at most")
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    from ..ids import LeaseId

    if not LeaseId.is_valid(args.lease):
        p.error(f"--lease: not a lease id: {args.lease[:40]!r}")
    if args.stop:
        return stop(args.lease, args.timeout)
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        p.error("no command given: -- CMD ARGS")
    if not (0 < args.margin <= 3600 and 0 <= args.grace < args.margin):
        p.error("--margin must be 0-3600 seconds and --grace below it")

    try:
        return hold(args.lease, cmd, args.margin, args.grace)
    except GpusdError as exc:
        # before anything started: the lock directory cannot be used
        print(f"gpusd: {exc}; not starting {cmd[0]}", file=sys.stderr)
        return NO_LEASE


if __name__ == "__main__":
    sys.exit(main())
