"""Who runs a GPU process: user and command line from the pid, where this host can tell.

In a container without the host's PID namespace, NVML reports host pids that do not exist here (or
belong to someone else): those come back with ``user``/``command`` = None rather than wrong names.
Lookups are cached per (pid, start time) so a daemon sampling every second does not re-read /proc.
"""

from __future__ import annotations

from typing import Any, Iterable

from ..model import ProcessInfo


class ProcessResolver:
    def __init__(self) -> None:
        self._cache: dict[int, tuple[str | None, str | None]] = {}
        self._psutil: Any = None

    def _lookup(self, pid: int) -> tuple[str | None, str | None]:
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

    def fill(self, processes: Iterable[ProcessInfo], keep_only_seen: bool = False) -> None:
        seen = set()
        for p in processes:
            seen.add(p.pid)
            if p.user is not None or p.command is not None:
                continue
            cached = self._cache.get(p.pid)
            if cached is None:
                cached = self._cache[p.pid] = self._lookup(p.pid)
            p.user, p.command = cached
        if keep_only_seen:
            for pid in list(self._cache):
                if pid not in seen:
                    del self._cache[pid]
