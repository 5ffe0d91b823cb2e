"""Fencing: a holder that lost its lease stops before its GPUs are granted again (docs/pool.md, "Fencing").

A remote lease whose holder stopped renewing (a network split longer than the TTL, a renewer gone)
ends without a release, while its job may still run on this host.  Before the GPUs can be granted
again, the daemon keeps the lease's locks and

1. finds the lease's processes: every process of this host whose environment names the lease
   (``GPUSD_LEASE=<id>``: what ``gpusd run --fleet``, ``gpusd launch`` and a reservation's ``env``
   give the commands they run; a process's environment is what whoever started it gave it, so
   naming someone else's lease only gets one's own processes stopped), and every descendant of one
   (followed through the process tree, so ranks in sessions of their own, and children that cleared
   the variable, count too).  Each is held by a
   pidfd opened while its start time still matches, so a reused pid is never signalled;
2. sends them SIGTERM, waits up to the grace (:data:`GRACE`, ``$GPUSD_FENCE_GRACE``), then stops
   every one left (and every descendant found since) with SIGKILL;
3. waits, up to the lock-delay (:data:`DELAY`, ``$GPUSD_FENCE_DELAY``, after the grace), until none of
   them runs and the GPUs' process lists (the daemon's backend) no longer show them; then releases.

Where a fenced process still shows on a GPU after the lock-delay (stuck in the driver, in another
pid namespace the daemon cannot signal), the GPU stays leased, the log and the event stream say which
process holds it, and it is looked at again every :data:`RECHECK` seconds: a GPU is never granted to
the next job while the last one may still write to it.

A daemon not running as root reads (and signals) only its own user's processes.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import threading
import time
from typing import Any, Callable

log = logging.getLogger("gpusd.pool")

# seconds between SIGTERM and SIGKILL
GRACE = 10.0
# seconds after the grace during which the processes must be gone: the documented lock-delay
DELAY = 15.0
# seconds between looks at a GPU a fenced process still shows on, after the lock-delay
RECHECK = 1.0
# processes one fence follows at most
MAX_PROCS = 4096
# bytes of an environment read at most
_ENV_MAX = 1 << 20


def _seconds(var: str, default: float) -> float:
    try:
        value = float(os.environ.get(var) or default)
    except ValueError:
        return default
    return value if 0 <= value <= 3600 else default


def grace() -> float:
    return _seconds("GPUSD_FENCE_GRACE", GRACE)


def delay() -> float:
    return _seconds("GPUSD_FENCE_DELAY", DELAY)


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of ``pid``; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read(4096)
        fields = raw[raw.rindex(b")") + 2:].split()
        return int(fields[1]), int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def _environ(pid: int) -> bytes | None:
    """``pid``'s environment as the kernel shows it (bounded); None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read(_ENV_MAX)
    except OSError:
        return None


def _has(env: bytes, needle: bytes) -> bool:
    return env.startswith(needle) or b"\0" + needle in env


def _names_lease(pid: int, needle: bytes) -> bool:
    env = _environ(pid)
    return env is not None and _has(env, needle)


def _pids() -> list[int]:
    try:
        return [int(n) for n in os.listdir("/proc") if n.isdigit()]
    except OSError:
        return []


def lease_processes(lease_id: str, roots: set[int] | None = None) -> dict[int, int]:
    """The processes of ``lease_id`` now: pid -> start time, for those whose environment names the
    lease, ``roots`` (processes known to be the lease's already) and all their descendants (never
    this process nor its descendants)."""
    needle = f"GPUSD_LEASE={lease_id}\0".encode()
    me = os.getpid()
    skip = {me, 1}
    info: dict[int, tuple[int, int]] = {}
    for pid in _pids():
        st = _stat(pid)
        if st is not None:
            info[pid] = st
    found = {pid for pid in info if pid not in skip and (pid in (roots or ()) or _names_lease(pid, needle))}
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in info.items():
        children.setdefault(ppid, []).append(pid)
    todo = list(found)
    while todo and len(found) < MAX_PROCS:
        for child in children.get(todo.pop(), []):
            if child not in found and child not in skip:
                found.add(child)
                todo.append(child)
    return {pid: info[pid][1] for pid in found}


def carriers(lease_ids: list[str]) -> dict[int, str]:
    """The processes (never this one) whose environment names one of ``lease_ids``: pid -> that id."""
    needles = [(f"GPUSD_LEASE={i}\0".encode(), i) for i in lease_ids]
    me = os.getpid()
    out: dict[int, str] = {}
    for pid in _pids():
        env = _environ(pid) if pid not in (me, 1) else None
        if env is None:
            continue
        for needle, lease_id in needles:
            if _has(env, needle):
                out[pid] = lease_id
                break
    return out


def stop_stale(lease_ids: list[str], timeout: float = 5.0) -> dict[int, str]:
    """Stop (SIGKILL: their lease is over, the GPU may already be another's) every process that still
    carries the id of a lease that has ended -- one started by hand after the lease's fence, with the
    variables of a reservation that had expired -- and wait (bounded) until they are gone."""
    found = carriers(lease_ids)
    if not found:
        return {}
    starts = {pid: st[1] for pid in found if (st := _stat(pid)) is not None}
    procs = track(starts)
    for p in procs:
        p.signal(signal.SIGKILL)
    until = time.monotonic() + timeout
    while any(p.alive() for p in procs) and time.monotonic() < until:
        time.sleep(0.02)
    for p in procs:
        p.close()
    return found


class Tracked:
    """A process held by its pidfd (never a reused pid)."""

    def __init__(self, pid: int, fd: int) -> None:
        self.pid, self.fd = pid, fd

    def alive(self) -> bool:
        r, _, _ = select.select([self.fd], [], [], 0)
        # a pidfd is readable once its process has exited
        return not r

    def signal(self, sig: int) -> None:
        try:
            signal.pidfd_send_signal(self.fd, sig)
        except OSError:
            # gone (ESRCH), or not ours to signal (EPERM): the wait below shows it
            pass

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


def track(pids: dict[int, int]) -> list[Tracked]:
    """pidfds of ``pids`` whose start time still matches after the pidfd is open."""
    out = []
    for pid, started in pids.items():
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            continue
        st = _stat(pid)
        # gone, or a new process under that pid already
        if st is None or st[1] != started:
            os.close(fd)
            continue
        out.append(Tracked(pid, fd))
    return out


class Fence:
    """Stopping one lease's processes, on a thread of its own; ``done(pids)`` is called (on that
    thread, with the processes it stopped) once the GPUs may be granted again, and ``report(pids)``
    when a process still shows on a GPU after the lock-delay."""

    def __init__(self, lease_id: str, devices: list[str], on_gpus: Callable[[list[str]], set[int]],
                 done: Callable[[list[int]], None], report: Callable[[list[int]], None]) -> None:
        self.lease_id, self.devices = lease_id, devices
        self.on_gpus, self.done, self.report = on_gpus, done, report
        self.tracked: dict[int, Tracked] = {}
        # pid -> start time of every process this fence stopped
        self.fenced: dict[int, int] = {}
        self.thread = threading.Thread(target=self._run, name=f"gpusd-fence-{lease_id[:8]}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _gather(self, sig: int | None = None) -> None:
        """Track the lease's processes not tracked yet (new children included), sending ``sig`` to
        each new one."""
        # the tracked ones still running are roots too: a child that cleared the variable, orphaned
        # meanwhile (its parent stopped first), is still found below them
        alive = {t.pid for t in self._alive()}
        fresh = {pid: st for pid, st in lease_processes(self.lease_id, alive).items() if pid not in self.tracked}
        for t in track(fresh):
            self.tracked[t.pid] = t
            self.fenced[t.pid] = fresh[t.pid]
            if sig is not None:
                t.signal(sig)

    def _shown(self) -> set[int]:
        """The stopped processes the GPUs' process lists still show: a pid counts while no other
        process has taken it (gone from /proc, a zombie, or the same start time: ours)."""
        out = set()
        for pid in self.on_gpus(self.devices) & set(self.fenced):
            st = _stat(pid)
            if st is None or st[1] == self.fenced[pid]:
                out.add(pid)
        return out

    def _alive(self) -> list[Tracked]:
        return [t for t in self.tracked.values() if t.alive()]

    def _wait(self, until: float, sig: int | None = None) -> bool:
        """Wait until every tracked process has exited (True) or ``until`` (monotonic) passed; every
        second, processes of the lease that appeared meanwhile are tracked too (and sent ``sig``)."""
        looked = time.monotonic()
        while True:
            if time.monotonic() - looked >= 1.0:
                self._gather(sig)
                looked = time.monotonic()
            alive = self._alive()
            if not alive:
                return True
            left = until - time.monotonic()
            if left <= 0:
                return False
            select.select([t.fd for t in alive], [], [], min(left, 0.2))

    def _run(self) -> None:
        try:
            self._fence()
        except Exception:  # noqa: BLE001 -- a fence that failed must still end in a release decision
            log.exception("fencing lease %s failed", self.lease_id)
        finally:
            for t in self.tracked.values():
                t.close()
            self.done(sorted(self.fenced))

    def _fence(self) -> None:
        start = time.monotonic()
        self._gather()
        if self.tracked:
            log.warning("lease %s ended without a release: stopping its %d process(es) %s", self.lease_id,
                        len(self.tracked), ",".join(map(str, sorted(self.tracked)))[:200])
            for t in self.tracked.values():
                t.signal(signal.SIGTERM)
            if not self._wait(start + grace(), signal.SIGTERM):
                # SIGKILL until no new descendant appears: a process forking meanwhile is caught next round
                killed: set[int] = set()
                for _ in range(8):
                    for t in self._alive():
                        t.signal(signal.SIGKILL)
                        killed.add(t.pid)
                    before = len(self.tracked)
                    self._gather(signal.SIGKILL)
                    killed.update(list(self.tracked)[before:])
                    if len(self.tracked) == before:
                        break
                log.warning("lease %s: SIGKILL after the %gs grace to %s", self.lease_id, grace(),
                            ",".join(map(str, sorted(killed)))[:200] or "none left")
        deadline = start + grace() + delay()
        self._wait(deadline, signal.SIGKILL)
        said = False
        while True:
            left = {t.pid for t in self._alive()} | self._shown()
            if not left:
                return
            if time.monotonic() >= deadline:
                if not said:
                    said = True
                    log.error("lease %s: process(es) %s still on its GPUs %gs after the stop; the GPUs stay "
                              "leased until they are gone", self.lease_id, ",".join(map(str, sorted(left)))[:200],
                              grace() + delay())
                    self.report(sorted(left))
                for t in self._alive():
                    t.signal(signal.SIGKILL)
            time.sleep(RECHECK if time.monotonic() >= deadline else 0.1)


def gpu_pids(backend: Any) -> Callable[[list[str]], set[int]]:
    """The pids the GPUs' process lists show (through the daemon's backend), by UUID."""
    def look(devices: list[str]) -> set[int]:
        if backend is None:
            return set()
        try:
            snap = backend.snapshot(detail=True)
        except Exception:  # noqa: BLE001 -- a backend that fails shows nothing: the pidfds still decide
            return set()
        wanted = set(devices)
        out: set[int] = set()
        for g in snap.gpus:
            if g.uuid in wanted or any(m.uuid in wanted for m in g.mig_instances):
                out.update(p.pid for p in g.processes)
        return out
    return look
