"""Idle leases and reservations: the event, the mark, and the opt-in release policy.

A lease (or reservation) is *idle* when every GPU it holds has stayed under 5 % utilisation for
longer than ``idle_after`` seconds.  :class:`IdleWatch` follows the samples (their timestamps are its
clock, so tests drive it with simulated time) and calls ``notify(event, data)``:

``lease_idle``
    the lease crossed ``idle_after`` (the dashboard marks its GPUs);
``lease_active``
    an idle lease's GPUs got busy again, or the lease ended;
``lease_release_notice``
    with the policy on: the holder is told the reservation will be released at ``release_at``
    (``grace`` seconds later) unless its GPUs are used;
``lease_released`` / ``lease_release_skipped``
    the release happened, or could not (no releaser for this kind of lease, or it refused).

Only a *reservation* is ever released: a lease with no process on any of its GPUs.  A lease whose
GPUs run a process is a running job's and is never released, however idle.  The release itself is
a hook (:class:`Releaser`): today's leases are ``flock`` locks held by their holder's process, which
no daemon can take away without killing that process, so the daemon has no releaser for them; the
daemon's pool of remote reservations is one (``gpusd.daemon.pool``, docs/pool.md).

Event data lists the lease under ``leases`` so that the daemon's access rules null its ``user`` and
``command`` for readers without the fleet secret.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..errors import ConfigError
from ..model import HostSnapshot, LeaseInfo
from .db import IDLE_UTIL


@dataclass
class IdlePolicy:
    # seconds under 5 % before a lease is idle (canhazgpu: 15 minutes)
    idle_after: float = 900.0
    # opt-in: release idle reservations
    release: bool = False
    # seconds between the notice and the release
    grace: float = 900.0

    def validate(self) -> None:
        if not 1 <= self.idle_after <= 30 * 86400:
            raise ConfigError("--idle-after must be between 1 second and 30 days")
        if not 0 <= self.grace <= 30 * 86400:
            raise ConfigError("--idle-grace must be between 0 and 30 days")


class Releaser(Protocol):
    """Releases a reservation on the daemon's behalf; returns False when it cannot."""

    def release(self, lease: LeaseInfo, reason: str) -> bool: ...


@dataclass
class _Track:
    lease: LeaseInfo
    gpus: set[str] = field(default_factory=set)
    idle_since: float | None = None
    flagged: bool = False
    notice_at: float | None = None
    running: bool = False
    done: bool = False


class IdleWatch:
    def __init__(self, policy: IdlePolicy, notify: Callable[[str, dict[str, Any]], None],
                 releaser: Releaser | None = None) -> None:
        self.policy = policy
        self.notify = notify
        self.releaser = releaser
        self.tracks: dict[str, _Track] = {}

    def idle(self) -> list[dict[str, Any]]:
        """The leases idle right now (for the dashboard's mark and ``GET /api/v1/history/idle``)."""
        return [self._data(t) for t in self.tracks.values() if t.flagged]

    def update(self, snap: HostSnapshot) -> None:
        now = snap.timestamp
        util: dict[str, float | None] = {}
        procs: dict[str, int] = {}
        seen: dict[str, _Track] = {}
        for g in snap.gpus:
            util[g.uuid] = g.utilization_gpu if g.healthy else None
            procs[g.uuid] = len(g.processes)
            for lease in g.leases:
                if lease.unleased:
                    # a lock held without a lease (docs/allocation.md): no lease to watch or release
                    continue
                t = self.tracks.get(lease.lease_id) or seen.get(lease.lease_id) or _Track(lease)
                t.gpus.add(g.uuid)
                seen[lease.lease_id] = t
        for lid in [k for k in self.tracks if k not in seen]:
            t = self.tracks.pop(lid)
            if t.flagged and not t.done:
                self.notify("lease_active", {**self._data(t), "reason": "ended"})
        for lid, t in seen.items():
            self.tracks[lid] = t
            if t.done:
                continue
            t.running = any(procs.get(u, 0) for u in t.gpus)
            quiet = all((util.get(u) is not None and util[u] < IDLE_UTIL) for u in t.gpus)  # type: ignore[operator]
            if not quiet:
                if t.flagged:
                    self.notify("lease_active", {**self._data(t), "reason": "busy"})
                t.idle_since, t.flagged, t.notice_at = None, False, None
                continue
            if t.idle_since is None:
                t.idle_since = now
            if not t.flagged and now - t.idle_since >= self.policy.idle_after:
                t.flagged = True
                self.notify("lease_idle", self._data(t))
            if not (t.flagged and self.policy.release) or t.running:
                # never a running job's lease
                continue
            if t.notice_at is None:
                t.notice_at = now
                self.notify("lease_release_notice", {**self._data(t), "release_at": now + self.policy.grace})
            elif now - t.notice_at >= self.policy.grace:
                t.done = True
                reason = f"idle (under {IDLE_UTIL:g} %) since {t.idle_since:.0f}"
                ok = False
                if self.releaser is not None:
                    try:
                        ok = bool(self.releaser.release(t.lease, reason))
                    except Exception:  # noqa: BLE001 - a failing hook must not stop the watch
                        ok = False
                self.notify("lease_released" if ok else "lease_release_skipped",
                            {**self._data(t), "reason": reason if ok else
                             "no releaser for this kind of lease" if self.releaser is None else "the releaser refused"})

    def _data(self, t: _Track) -> dict[str, Any]:
        lease = t.lease
        return {"lease_id": lease.lease_id, "gpus": sorted(t.gpus), "idle_since": t.idle_since,
                "running": t.running,
                "leases": [{"lease_id": lease.lease_id, "pid": lease.pid, "user": lease.user,
                            "command": lease.command, "started": lease.started}]}
