"""Recording samples into the history database, off the event loop.

:class:`Accountant` does the arithmetic on one connection (also used by the history generator of
``bench/``); :class:`Recorder` runs it on a writer thread: :meth:`Recorder.submit` only puts the
snapshot on a bounded queue, so sampling never waits on the disk (a full queue drops the sample and
counts it in ``dropped``).

Accounting is left-point: the interval between two samples is accounted to what the first of them
showed (its processes, leases, utilisation, power), in the buckets of the first one's time.  Each
sample is one transaction, so a daemon killed at any moment loses at most the interval after its last
committed sample, and a restart counts nothing twice: the first sample after it opens a new interval.
"""

from __future__ import annotations

import json
import logging
import queue
import sqlite3
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..model import GpuInfo, HostSnapshot, finite
from .db import IDLE_UTIL, STEP, TIERS, Retention, connect, prune, transaction

log = logging.getLogger(__name__)

PRUNE_EVERY = 3600.0  # seconds of sample time between retention passes
MAX_ENDED = 4096  # ended leases remembered (a sample older than their end must not open them again)
LEASE_WRITE_WAIT = 1.0  # seconds a grant waits for its lease's record to be written (then goes on)


@dataclass
class _Job:
    row: int
    gpus: set[str]
    seen: bool = True  # shown by a sample (or told) since this daemon started; False: a previous daemon's


@dataclass
class _GpuState:
    """What one sample showed of one GPU, kept until the next sample accounts the interval."""

    uuid: str
    util: float | None
    mem: int | None
    power: float | None
    temp: int | None
    users: list[str]  # distinct owners of its processes
    holders: list[str]  # distinct holders of its leases
    jobs: list[str]  # identities of the processes and leases on it
    unleased: list[str] = field(default_factory=list)  # distinct owners of its processes no lease covers
    # distinct holders of its leases taken in the shared directory while a daemon was the lease authority
    outside: list[str] = field(default_factory=list)


@dataclass
class _Seen:
    kind: str
    user: str | None
    command: str | None
    gpus: set[str] = field(default_factory=set)
    mem: int = 0


def _uid(user: str | None) -> int | None:
    if not user:
        return None
    try:
        import pwd

        return pwd.getpwnam(user).pw_uid
    except (KeyError, ImportError, ValueError):
        return None


class Accountant:
    """Turns samples into rows of ``series``, ``usage`` and ``jobs`` (one transaction per sample)."""

    def __init__(self, conn: sqlite3.Connection, interval: float, keep: Retention | None = None,
                 host: str | None = None) -> None:
        self.conn = conn
        self.interval = interval
        self.keep = keep or Retention()
        self.host = host
        self.max_gap = max(10 * interval, 30.0)  # a longer gap is downtime (a stopped daemon, a suspend)
        self.prev_ts: float | None = None
        self.prev: list[_GpuState] = []
        self.gpu_ids: dict[str, int] = {}
        self.gpu_meta: dict[str, tuple[Any, ...]] = {}
        self.open: dict[str, _Job] = {}
        # leases whose end was told (lease_ended): a sample taken before it, written after, must not
        # open them again
        self.told: dict[str, None] = {}
        # lease records a sample closed (it no longer showed them): their end may still be told
        self.closed: dict[str, int] = {}
        self.last_prune = 0.0
        self.samples = 0
        self._uids: dict[str, int | None] = {}
        for row, ident, gpus in conn.execute("SELECT id, key, gpus FROM jobs WHERE ended IS NULL"):
            # left open by a daemon that stopped or died: continued if still there at the next sample
            self.open[ident.rsplit("@", 1)[0]] = _Job(row, set(json.loads(gpus)), seen=False)
        for gid, uuid in conn.execute("SELECT id, uuid FROM gpus"):
            self.gpu_ids[uuid] = gid

    # -- one sample ----------------------------------------------------------------------------
    def add(self, snap: HostSnapshot) -> None:
        ts = float(snap.timestamp)
        if self.prev_ts is not None and ts <= self.prev_ts:
            return  # a repeated or older sample (a clock stepping back): nothing to account
        dt = 0.0 if self.prev_ts is None else min(ts - self.prev_ts, self.max_gap)
        seen = self._seen(snap)
        states = [self._state(g) for g in snap.gpus if g.healthy]
        with transaction(self.conn):
            self._gpus(snap, ts)
            if dt > 0 and self.prev_ts is not None:
                self._account(self.prev_ts, dt)
            self._jobs(seen, ts, dt)
        self.prev_ts, self.prev = ts, states
        self.samples += 1
        if ts - self.last_prune >= PRUNE_EVERY:
            self.last_prune = ts
            prune(self.conn, ts, self.keep)

    def _state(self, g: GpuInfo) -> _GpuState:
        users = sorted({p.user or "" for p in g.processes})
        holders = sorted({lease.user or "" for lease in g.leases})
        jobs = [_proc_ident(p.pid, p.user, p.command) for p in g.processes]
        jobs += [f"l:{lease.lease_id}" for lease in g.leases if not lease.unleased]
        unleased = sorted({p.user or "" for p in g.processes if p.unleased})
        outside = sorted({lease.user or "" for lease in g.leases if lease.outside_authority and not lease.unleased})
        return _GpuState(g.uuid, finite(g.utilization_gpu), g.memory_used, finite(g.power_draw), g.temperature,
                         users, holders, jobs, unleased, outside)

    def _seen(self, snap: HostSnapshot) -> dict[str, _Seen]:
        out: dict[str, _Seen] = {}
        for g in snap.gpus:
            for p in g.processes:
                s = out.setdefault(_proc_ident(p.pid, p.user, p.command),
                                   _Seen("unleased" if p.unleased else "process", p.user, p.command))
                s.gpus.add(g.uuid)
                s.mem += p.used_memory or 0
            for lease in g.leases:
                if lease.unleased:
                    continue  # not a lease: a lock held without one
                s = out.setdefault(f"l:{lease.lease_id}", _Seen("lease", lease.user, lease.command))
                s.gpus.add(g.uuid)
        return out

    def _gpus(self, snap: HostSnapshot, ts: float) -> None:
        host = self.host or snap.hostname
        for g in snap.gpus:
            meta = (host, g.index, g.name, g.memory_total)
            gid = self.gpu_ids.get(g.uuid)
            if gid is None:
                cur = self.conn.execute(
                    "INSERT INTO gpus(uuid, host, idx, model, mem_total, first, last) VALUES(?,?,?,?,?,?,?) "
                    "ON CONFLICT(uuid) DO UPDATE SET last=excluded.last RETURNING id",
                    (g.uuid, *meta, ts, ts))
                gid = self.gpu_ids[g.uuid] = int(cur.fetchone()[0])
                self.gpu_meta[g.uuid] = meta
            elif self.gpu_meta.get(g.uuid) != meta:
                self.conn.execute("UPDATE gpus SET host=?, idx=?, model=?, mem_total=? WHERE id=?", (*meta, gid))
                self.gpu_meta[g.uuid] = meta
        if self.samples % 60 == 0:
            self.conn.executemany("UPDATE gpus SET last=? WHERE uuid=?", [(ts, g.uuid) for g in snap.gpus])

    def _account(self, t: float, dt: float) -> None:
        series, usage = [], []
        for s in self.prev:
            gid = self.gpu_ids.get(s.uuid)
            if gid is None:
                continue
            util = s.util
            idle = util is not None and util < IDLE_UTIL
            power_s = (s.power or 0.0) * dt
            busy = bool(s.users)
            for tier in TIERS:
                b = int(t // STEP[tier] * STEP[tier])
                series.append((tier, gid, b, dt, (util or 0.0) * dt, dt if util is not None else 0.0,
                               (s.mem or 0) * dt, s.mem, power_s, s.temp, dt if busy else 0.0,
                               dt if s.holders else 0.0))
                for kind, who, energy in (("use", s.users, power_s), ("hold", s.holders, 0.0 if busy else power_s),
                                          ("unleased", s.unleased, 0.0),  # GPU time outside gpusd, by user
                                          # held by leases the lease authority did not grant (added in 0.4)
                                          ("outside", s.outside, 0.0)):
                    n = len(who)
                    for u in who:
                        usage.append((tier, gid, b, kind, u, dt / n, (util or 0.0) * dt / n, energy / n,
                                      dt / n if idle else 0.0))
        self.conn.executemany(
            "INSERT INTO series VALUES(?,?,?,?,?,?,?,?,?,?,?,?) ON CONFLICT(tier, gpu, ts) DO UPDATE SET "
            "seconds=seconds+excluded.seconds, util_s=util_s+excluded.util_s, util_n=util_n+excluded.util_n, "
            "mem_s=mem_s+excluded.mem_s, mem_max=max(coalesce(mem_max, 0), coalesce(excluded.mem_max, 0)), "
            "power_s=power_s+excluded.power_s, temp_max=max(coalesce(temp_max, -999), "
            "coalesce(excluded.temp_max, -999)), busy_s=busy_s+excluded.busy_s, held_s=held_s+excluded.held_s",
            series)
        self.conn.executemany(
            "INSERT INTO usage VALUES(?,?,?,?,?,?,?,?,?) ON CONFLICT(tier, ts, gpu, kind, user) DO UPDATE SET "
            "seconds=seconds+excluded.seconds, util_s=util_s+excluded.util_s, "
            "energy_j=energy_j+excluded.energy_j, idle_s=idle_s+excluded.idle_s", usage)

    def _jobs(self, seen: dict[str, _Seen], ts: float, dt: float) -> None:
        # the interval just ended is accounted to the jobs the previous sample showed
        if dt > 0:
            acc: dict[str, list[float]] = {}
            for s in self.prev:
                util = s.util
                n = max(1, len(s.users))
                for ident in s.jobs:
                    a = acc.setdefault(ident, [0.0, 0.0, 0.0, 0.0])
                    a[0] += dt
                    a[1] += (util or 0.0) * dt
                    a[2] += (s.power or 0.0) * dt / n
                    a[3] += dt if util is not None and util < IDLE_UTIL else 0.0
            rows = [(a[0], a[1], a[2], a[3], self.open[i].row) for i, a in acc.items() if i in self.open]
            self.conn.executemany("UPDATE jobs SET gpu_s=gpu_s+?, util_s=util_s+?, energy_j=energy_j+?, "
                                  "idle_s=idle_s+? WHERE id=?", rows)
        for ident in [i for i in self.open if i not in seen]:
            row = self.open.pop(ident).row
            self.conn.execute("UPDATE jobs SET ended=last WHERE id=?", (row,))
            if ident.startswith("l:"):
                _remember(self.closed, ident, row)  # its holder's end may still be told (lease_ended)
        for ident, j in seen.items():
            job = self.open.get(ident)
            if job is None and ident in self.told:
                continue  # a lease that ended (we were told) in a sample taken before it did
            if job is None:
                cur = self.conn.execute(
                    "INSERT INTO jobs(kind, key, uid, user, command, gpus, start, last, peak_mem) "
                    "VALUES(?,?,?,?,?,?,?,?,?) RETURNING id",
                    (j.kind, f"{ident}@{ts:.3f}", self._uid(j.user), j.user, (j.command or "")[:4096] or None,
                     json.dumps(sorted(j.gpus)), ts, ts, j.mem if j.kind == "process" else None))
                self.open[ident] = _Job(int(cur.fetchone()[0]), set(j.gpus))
                continue
            job.seen = True
            if not j.gpus <= job.gpus:
                job.gpus |= j.gpus
                self.conn.execute("UPDATE jobs SET gpus=? WHERE id=?", (json.dumps(sorted(job.gpus)), job.row))
            self.conn.execute("UPDATE jobs SET last=?, peak_mem=max(coalesce(peak_mem, 0), ?) WHERE id=?",
                              (ts, j.mem, job.row))

    def _uid(self, user: str | None) -> int | None:
        if user is None:
            return None
        if user not in self._uids:
            self._uids[user] = _uid(user)
        return self._uids[user]

    # -- leases told by the lease authority (their start and end, between samples too) ----------
    def lease_started(self, lease_id: str, user: str | None, uid: int | None, command: str | None,
                      gpus: list[str], ts: float) -> None:
        """A lease granted at ``ts``: its job record, written now (one transaction), so that a lease
        shorter than a sample, or granted just before the daemon dies, is in the history all the same.
        The samples then continue it, as any lease they show."""
        ident = f"l:{lease_id}"
        if ident in self.open or ident in self.told or ident in self.closed:
            return  # a sample showed it first
        with transaction(self.conn):
            cur = self.conn.execute(
                "INSERT INTO jobs(kind, key, uid, user, command, gpus, start, last) VALUES(?,?,?,?,?,?,?,?) "
                "ON CONFLICT(key) DO NOTHING RETURNING id",
                ("lease", f"{ident}@{ts:.3f}", uid, user, (command or "")[:4096] or None,
                 json.dumps(sorted(gpus)), ts, ts))
            got = cur.fetchone()
        if got is not None:
            self.open[ident] = _Job(int(got[0]), set(gpus))

    def lease_ended(self, lease_id: str, ts: float) -> None:
        """A lease released at ``ts`` (its holder's connection ended, however it ended): its record ends
        then, and holds its GPUs from its start to its end (the samples count only whole intervals
        they saw: a lease between two samples would count nothing)."""
        ident = f"l:{lease_id}"
        job = self.open.pop(ident, None)
        row = job.row if job is not None else self.closed.pop(ident, None)
        _remember(self.told, ident, None)
        if row is None:
            return
        with transaction(self.conn):
            self.conn.execute(
                "UPDATE jobs SET last=max(last, ?), ended=max(last, ?), "
                "gpu_s=max(gpu_s, (max(last, ?) - start) * json_array_length(gpus)) WHERE id=?",
                (ts, ts, ts, row))

    def close_jobs(self) -> None:
        """A clean stop: every open job ends at its last sample (a crash leaves them open, and the next
        start continues those still running) -- but a lease's: a lease outlives the daemon (its holder
        keeps its locks, handed over as the daemon stops), so the next daemon continues its record while
        it is held, or closes it at its last sample: one record per lease, across a restart too."""
        with transaction(self.conn):
            self.conn.execute("UPDATE jobs SET ended=last WHERE ended IS NULL AND kind != 'lease'")
            # the leases this daemon saw held stay open; a previous daemon's that it never saw end
            self.conn.executemany("UPDATE jobs SET ended=last WHERE id=?",
                                  [(job.row,) for job in self.open.values() if not job.seen])
        self.open.clear()

    def mark_idle(self, lease_id: str, ts: float, released: bool = False) -> None:
        """Flag a lease as held idle (the idle watch saw it under 5 % long enough), or released."""
        job = self.open.get(f"l:{lease_id}")
        if job is None:
            return
        col = "released" if released else "idle_flagged"
        with transaction(self.conn):
            self.conn.execute(f"UPDATE jobs SET {col}=coalesce({col}, ?) WHERE id=?", (ts, job.row))


def _remember(d: dict[str, Any], key: str, value: Any) -> None:
    """``d[key] = value``, forgetting the oldest entries past :data:`MAX_ENDED`."""
    d[key] = value
    while len(d) > MAX_ENDED:
        del d[next(iter(d))]


def _proc_ident(pid: int, user: str | None, command: str | None) -> str:
    return f"p:{pid}:{user or ''}:{zlib.crc32((command or '').encode()):08x}"


class Recorder:
    """An :class:`Accountant` on a writer thread.  ``submit`` never blocks; ``close`` drains and stops."""

    def __init__(self, path: Path, interval: float, keep: Retention | None = None, host: str | None = None,
                 queue_size: int = 600) -> None:
        self.path = path
        conn = connect(path)
        try:
            self.acc = Accountant(conn, interval, keep, host)
        except BaseException:
            conn.close()
            raise
        self.dropped = 0
        self.errors = 0
        self._q: queue.Queue[tuple[str, Any] | None] = queue.Queue(queue_size)
        self._thread = threading.Thread(target=self._run, name="gpusd-history", daemon=True)
        self._thread.start()

    def submit(self, snap: HostSnapshot) -> None:
        self._put(("sample", snap))

    def mark_idle(self, lease_id: str, ts: float, released: bool = False) -> None:
        self._put(("idle", (lease_id, ts, released)))

    def lease_started(self, lease_id: str, user: str | None, uid: int | None, command: str | None,
                      gpus: list[str], ts: float) -> bool:
        """:meth:`Accountant.lease_started` on the writer thread; returns once it is written (True), or
        after :data:`LEASE_WRITE_WAIT` seconds (False: the writer is behind, the record comes later)."""
        done = threading.Event()

        def write(conn: sqlite3.Connection) -> None:
            try:
                self.acc.lease_started(lease_id, user, uid, command, gpus, ts)
            finally:
                done.set()

        self._put(("call", write), block=LEASE_WRITE_WAIT)
        return done.wait(LEASE_WRITE_WAIT)

    def lease_ended(self, lease_id: str, ts: float) -> None:
        self._put(("call", lambda conn: self.acc.lease_ended(lease_id, ts)), block=LEASE_WRITE_WAIT)

    def call(self, fn: Callable[[sqlite3.Connection], Any]) -> None:
        """Run ``fn(connection)`` on the writer thread (tests, maintenance)."""
        self._put(("call", fn))

    def _put(self, item: tuple[str, Any], block: float = 0.0) -> None:
        """Queue ``item`` for the writer; a sample is dropped when the queue is full, a lease's start
        or end waits ``block`` seconds for room first (they are few, and each is a job's record)."""
        try:
            if block > 0:
                self._q.put(item, timeout=block)
            else:
                self._q.put_nowait(item)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("history: the writer is behind; %d sample(s) not recorded", self.dropped)

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                try:
                    self.acc.close_jobs()
                except sqlite3.Error as exc:
                    log.warning("history: cannot close the open jobs: %r", exc)
                break
            what, arg = item
            try:
                if what == "sample":
                    self.acc.add(arg)
                elif what == "idle":
                    self.acc.mark_idle(*arg)
                else:
                    arg(self.acc.conn)
            except Exception as exc:  # a full disk, a locked file: log, keep sampling, try the next one
                self.errors += 1
                if self.errors == 1 or self.errors % 1000 == 0:
                    log.warning("history: cannot record a sample: %r", exc)
        self.acc.conn.close()

    def flush(self, timeout: float = 10.0) -> None:
        """Wait until everything submitted so far is written."""
        done = threading.Event()
        self.call(lambda conn: done.set())
        done.wait(timeout)

    def close(self, timeout: float = 10.0) -> None:
        try:
            self._q.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
