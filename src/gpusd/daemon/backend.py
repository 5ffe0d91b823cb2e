"""The daemon's one inventory backend: the sampling loop, the lease authority on its Unix
socket, the pool's remote leases and rebalancing all read the GPUs through the same
:class:`SharedBackend`, so a lease is decided on the very readings (and utilisation window) that
``GET /api/v1/gpus`` and the announcement serve, and a driver library is opened once per daemon.

One snapshot at a time (a lock), and a reopen after a failure (:meth:`SharedBackend.reopen`) is seen
by every part at once: they hold this object, never the backend inside it.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable, Mapping

from ..errors import BackendUnavailable
from ..model import DEFAULT_VENDOR

if TYPE_CHECKING:  # pragma: no cover
    from ..inventory import Backend
    from ..model import HostSnapshot


class SharedBackend:
    """An inventory backend shared by the daemon's threads; it implements
    :class:`gpusd.inventory.backend.Backend` itself, delegating to the backend it opened."""

    def __init__(self, opener: Callable[[], Backend], current: Backend | None = None) -> None:
        self._opener = opener
        # the backend read now (a test may put its own here before start)
        self.current = current
        self.lock = threading.Lock()
        # backends opened by this daemon (one, but for reopens after failures)
        self.opens = 0

    # -- the Backend protocol -----------------------------------------------------------------
    @property
    def backend(self) -> str:
        return self.current.backend if self.current is not None else "none"

    @property
    def vendors(self) -> tuple[str, ...]:
        return tuple(getattr(self.current, "vendors", (DEFAULT_VENDOR,)))

    @property
    def hostname(self) -> str:
        return str(getattr(self.current, "hostname", ""))

    @property
    def node_id(self) -> str:
        return str(getattr(self.current, "node_id", ""))

    def snapshot(self, util_since: Mapping[str, float] | None = None, detail: bool = True) -> HostSnapshot:
        with self.lock:
            return self._now().snapshot(util_since=util_since, detail=detail)

    def close(self) -> None:
        with self.lock:
            current, self.current = self.current, None
            if current is not None:
                current.close()

    def __enter__(self) -> SharedBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the daemon's side (blocking: call from a worker thread) --------------------------------
    def open(self) -> Backend:
        """The backend, opened now if there is none yet."""
        with self.lock:
            if self.current is None:
                self.current = self._opener()
                self.opens += 1
            return self.current

    def reopen(self) -> None:
        """Close the backend and open a new one (after the old one failed as a whole).  Where the new
        one cannot be opened, the old one stays (closed: its snapshots keep failing) and this raises."""
        with self.lock:
            old = self.current
            if old is not None:
                old.close()
            self.current = self._opener()
            self.opens += 1

    def _now(self) -> Backend:
        current = self.current
        if current is None:
            raise BackendUnavailable("the daemon's GPU backend is not open")
        return current
