"""Who runs a GPU process: user and command line from the pid, where this host can tell.

In a container without the host's PID namespace, NVML reports host pids that do not exist here (or
belong to someone else): those come back with ``user``/``command`` = None rather than wrong names.
The container a process runs in is read from its cgroup (:mod:`.cgroups`) at the same lookup.
Lookups are cached per pid (for as long as the pid stays on a GPU) so a daemon sampling every second
does not re-read /proc.  On Linux /proc is read directly (importing psutil alone costs a one-shot CLI
about 14 ms); elsewhere psutil answers.
"""

# Imports inside functions: start-up (quick commands import this module).
from __future__ import annotations

import os

from ..model import GpuInfo, ProcessInfo

# typing is not imported at run time: start-up time
TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from typing import Any, Iterable

    from .cgroups import Container

    Found = tuple[str | None, str | None, Container | None]

_HAVE_PROC = os.path.isdir("/proc/self")


def _set(p: ProcessInfo, found: Found) -> None:
    p.user, p.command = found[0], found[1]
    # (a lookup that knows no container answers two)
    c = found[2] if len(found) > 2 else None
    if c is not None:
        p.container, p.container_runtime, p.pod = c.id, c.runtime, c.pod


def _from_proc(pid: int) -> tuple[str | None, str | None]:
    """(user, command line) of ``pid`` from /proc; (None, None) when this host cannot see it."""
    base = f"/proc/{pid}"
    try:
        with open(f"{base}/status", "rb") as f:
            status = f.read()
        with open(f"{base}/cmdline", "rb") as f:
            raw = f.read(4096)
    except OSError:
        # no such process here (container without host PIDs), or not allowed
        return None, None
    user = None
    for line in status.splitlines():
        if line.startswith(b"Uid:"):
            uid = int(line.split()[1])
            try:
                import pwd

                user = pwd.getpwuid(uid).pw_name
            except (KeyError, ImportError):
                user = str(uid)
            break
    cmd = raw.rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")
    # kernel threads and zombies have no command line: use the name
    if not cmd:
        for line in status.splitlines():
            if line.startswith(b"Name:"):
                cmd = line.split(None, 1)[1].decode(errors="replace") if len(line.split()) > 1 else ""
                break
    return user, (cmd[:512] or None)


class ProcessResolver:
    def __init__(self) -> None:
        self._cache: dict[int, Found] = {}
        self._psutil: Any = None

    def _lookup(self, pid: int) -> Found:
        if _HAVE_PROC:
            # here: only where a GPU runs a process (start-up time)
            from .cgroups import of_pid

            user, cmd = _from_proc(pid)
            return user, cmd, (of_pid(pid) if user is not None or cmd is not None else None)
        return (*self._lookup_psutil(pid), None)

    def _lookup_psutil(self, pid: int) -> tuple[str | None, str | None]:
        if self._psutil is None:
            import psutil

            self._psutil = psutil
        psutil = self._psutil
        try:
            proc = psutil.Process(pid)
            with proc.oneshot():
                try:
                    user = proc.username()
                except (psutil.AccessDenied, KeyError):
                    user = None
                try:
                    cmd = " ".join(proc.cmdline()) or proc.name()
                except psutil.AccessDenied:
                    cmd = proc.name()
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied, ValueError):
            return None, None
        return user, (cmd[:512] if cmd else None)

    def fill_gpus(self, gpus: Iterable[GpuInfo]) -> None:
        """:meth:`fill` with every process of ``gpus`` (a snapshot's), ``keep_only_seen``: without
        gathering them in a list first (the snapshot's cost)."""
        cache = self._cache
        get = cache.get
        seen: set[int] = set()
        add = seen.add
        for g in gpus:
            for p in g.processes:
                pid = p.pid
                add(pid)
                if p.user is None and p.command is None:
                    cached = get(pid)
                    if cached is None:
                        cached = cache[pid] = self._lookup(pid)
                    _set(p, cached)
        if not seen.issuperset(cache):
            # pids no longer on a GPU
            for pid in cache.keys() - seen:
                del cache[pid]

    def fill(self, processes: Iterable[ProcessInfo], keep_only_seen: bool = False) -> None:
        cache = self._cache
        seen = set()
        for p in processes:
            pid = p.pid
            seen.add(pid)
            if p.user is not None or p.command is not None:
                continue
            cached = cache.get(pid)
            if cached is None:
                cached = cache[pid] = self._lookup(pid)
            _set(p, cached)
        if keep_only_seen:
            # pids no longer on a GPU
            for pid in cache.keys() - seen:
                del cache[pid]
