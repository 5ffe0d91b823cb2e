"""Recording samples into the history database, off the event loop.

:class:`Accountant` does the arithmetic on one connection (also used by the history generator of
``bench/``); :class:`Recorder` runs it on a writer thread: :meth:`Recorder.submit` only puts the
snapshot on a bounded queue, so sampling never waits on the disk (a full queue drops the sample and
counts it in ``dropped``).  What the writer cannot write for want of room (a full disk) it keeps,
bounded, and writes in order when there is room (docs/history.md, "A full disk").

Accounting is left-point: the interval between two samples is accounted to what the first of them
showed (its processes, leases, utilisation, power), in the buckets of the first one's time.  Each
sample is one transaction, so a daemon killed at any moment loses at most the interval after its last
committed sample, and a restart counts nothing twice: the first sample after it opens a new interval.
"""

from __future__ import annotations

import errno
import json
import logging
import pwd
import queue
import sqlite3
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..model import GpuInfo, HostSnapshot, ProcessInfo, finite
from .db import IDLE_UTIL, STEP, TIERS, Retention, connect, prune, transaction

log = logging.getLogger(__name__)

# seconds of sample time between retention passes
PRUNE_EVERY = 3600.0
# ended leases remembered (a sample older than their end must not open them again)
MAX_ENDED = 4096
# seconds a grant waits for its lease's record to be written (then goes on)
LEASE_WRITE_WAIT = 1.0
# What cannot be written (a full disk) is kept in memory, bounded, and written when there is room:
# samples kept (10 minutes at the default 1 s; as many as the writer's queue holds)
KEEP_SAMPLES = 600
# lease starts and ends, idle marks kept (each a few hundred bytes)
KEEP_EVENTS = 10000
# seconds between tries while nothing new comes (each new item tries once too)
RETRY_EVERY = 1.0
# kept items written per turn once there is room (then the queue is looked at)
RETRY_BATCH = 256
# seconds a stop waits for room to write what is kept
CLOSE_WAIT = 5.0


@dataclass
class _Job:
    row: int
    gpus: set[str]
    # shown by a sample (or told) since this daemon started; False: a previous daemon's
    seen: bool = True


@dataclass
class _GpuState:
    """What one sample showed of one GPU, kept until the next sample accounts the interval."""

    uuid: str
    util: float | None
    mem: int | None
    power: float | None
    temp: int | None
    # distinct owners of its processes
    users: list[str]
    # distinct holders of its leases
    holders: list[str]
    # identities of the processes and leases on it
    jobs: list[str]
    # distinct owners of its processes no lease covers
    unleased: list[str] = field(default_factory=list)
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
        return pwd.getpwnam(user).pw_uid
    except (KeyError, ValueError):
        return None


class Accountant:
    """Turns samples into rows of ``series``, ``usage`` and ``jobs`` (one transaction per sample)."""

    def __init__(self, conn: sqlite3.Connection, interval: float, keep: Retention | None = None,
                 host: str | None = None) -> None:
        self.conn = conn
        self.interval = interval
        self.keep = keep or Retention()
        self.host = host
        # a longer gap is downtime (a stopped daemon, a suspend)
        self.max_gap = max(10 * interval, 30.0)
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
            # a repeated or older sample (a clock stepping back): nothing to account
            return
        dt = 0.0 if self.prev_ts is None else min(ts - self.prev_ts, self.max_gap)
        seen = self._seen(snap)
        states = [self._state(g) for g in snap.gpus if g.healthy]
        # What this object knows changes only with a committed transaction: a sample that fails (a full
        # disk) is written again later (Recorder), and must find everything as it was before it.
        saved = ({k: _Job(j.row, set(j.gpus), j.seen) for k, j in self.open.items()}, dict(self.gpu_ids),
                 dict(self.gpu_meta))
        try:
            with transaction(self.conn):
                self._gpus(snap, ts)
                if dt > 0 and self.prev_ts is not None:
                    self._account(self.prev_ts, dt)
                closed = self._jobs(seen, ts, dt)
        except BaseException:
            self.open, self.gpu_ids, self.gpu_meta = saved
            raise
        for ident, row in closed:
            # its holder's end may still be told (lease_ended)
            _remember(self.closed, ident, row)
        self.prev_ts, self.prev = ts, states
        self.samples += 1
        if ts - self.last_prune >= PRUNE_EVERY:
            self.last_prune = ts
            try:
                prune(self.conn, ts, self.keep)
            except sqlite3.Error as exc:
                # the sample is written; retention runs again at the next pass
                log.warning("history: retention pass failed: %r", exc)

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
                                   _Seen("unleased" if p.unleased else "process", p.user, _shown(p)))
                s.gpus.add(g.uuid)
                s.mem += p.used_memory or 0
            for lease in g.leases:
                if lease.unleased:
                    # not a lease: a lock held without one
                    continue
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
                                          # GPU time outside gpusd, by user
                                          ("unleased", s.unleased, 0.0),
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

    def _jobs(self, seen: dict[str, _Seen], ts: float, dt: float) -> list[tuple[str, int]]:
        """Returns the lease records this sample closed, to remember once it is committed."""
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
        closed = []
        for ident in [i for i in self.open if i not in seen]:
            row = self.open.pop(ident).row
            self.conn.execute("UPDATE jobs SET ended=last WHERE id=?", (row,))
            if ident.startswith("l:"):
                closed.append((ident, row))
        for ident, j in seen.items():
            job = self.open.get(ident)
            if job is None and ident in self.told:
                # a lease that ended (we were told) in a sample taken before it did
                continue
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
        return closed

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
            # a sample showed it first
            return
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
        job = self.open.get(ident)
        row = job.row if job is not None else self.closed.get(ident)
        if row is not None:
            # what is known changes once it is written (a full disk: later)
            with transaction(self.conn):
                self.conn.execute(
                    "UPDATE jobs SET last=max(last, ?), ended=max(last, ?), "
                    "gpu_s=max(gpu_s, (max(last, ?) - start) * json_array_length(gpus)) WHERE id=?",
                    (ts, ts, ts, row))
        self.open.pop(ident, None)
        self.closed.pop(ident, None)
        _remember(self.told, ident, None)

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

    def mark_timed_out(self, lease_id: str, ts: float) -> None:
        """Flag a lease as ended by its job's time limit (``gpusd run --time``), whether open or just ended."""
        ident = f"l:{lease_id}"
        job = self.open.get(ident)
        row = job.row if job is not None else self.closed.get(ident)
        if row is None:
            return
        with transaction(self.conn):
            self.conn.execute("UPDATE jobs SET timed_out=coalesce(timed_out, ?) WHERE id=?", (ts, row))

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


def _shown(p: ProcessInfo) -> str | None:
    """The command the history records for ``p``: its container first (``[docker 0123456789ab]``),
    where it runs in one, so that the report names it (docs/history.md)."""
    if not p.container:
        return p.command
    owner = f" of {p.container_owner}" if p.container_owner else ""
    return f"[{p.container_runtime or 'container'} {p.container[:12]}{owner}] {p.command or ''}".rstrip()[:1024]


def _proc_ident(pid: int, user: str | None, command: str | None) -> str:
    return f"p:{pid}:{user or ''}:{zlib.crc32((command or '').encode()):08x}"


class Recorder:
    """An :class:`Accountant` on a writer thread.  ``submit`` never blocks; ``close`` drains and stops.

    What cannot be written for a while (a full disk: SQLITE_FULL, ENOSPC; an I/O error) is kept, in
    order, and written when there is room again: each new item (a sample every interval) and every
    :data:`RETRY_EVERY` seconds retry the oldest kept item once; once it is written, the rest follow,
    :data:`RETRY_BATCH` at a time.  Kept in memory, bounded: at most :data:`KEEP_SAMPLES` samples (the
    oldest go first, counted in ``lost``) and :data:`KEEP_EVENTS` lease starts and ends, idle marks and
    calls.  One line is logged when writing first fails and one when everything kept is written."""

    def __init__(self, path: Path, interval: float, keep: Retention | None = None, host: str | None = None,
                 queue_size: int = 600) -> None:
        self.path = path
        self.dropped = 0
        self.errors = 0
        # kept items dropped past the bound (their disk stayed full too long)
        self.lost = 0
        # not written yet, oldest first
        self._kept: deque[tuple[str, Any]] = deque()
        self._kept_samples = 0
        # set once their item is written or kept
        self._handled: list[threading.Event] = []
        # monotonic: when writing began to fail (None: it works)
        self._failing: float | None = None
        self._failed_on: str = ""
        self._lost_then = 0
        self._args = (interval, keep, host)
        self.acc: Accountant | None = None
        try:
            self.acc = self._open()
        except (sqlite3.Error, OSError) as exc:
            if not _full(exc):
                raise
            # a disk full as the daemon starts: opened (and everything kept meanwhile written) when it
            # has room, rather than a daemon without history until its next start
            log.warning("history: cannot open %s (%s): it is opened when the disk has room, and what "
                        "was kept meanwhile written", path, exc)
            self._failing, self._failed_on = time.monotonic(), str(exc)
        self._q: queue.Queue[tuple[str, Any] | None] = queue.Queue(queue_size)
        self._thread = threading.Thread(target=self._run, name="gpusd-history", daemon=True)
        self._thread.start()

    def submit(self, snap: HostSnapshot) -> None:
        self._put(("sample", snap))

    def mark_idle(self, lease_id: str, ts: float, released: bool = False) -> None:
        self._put(("idle", (lease_id, ts, released)))

    def mark_timed_out(self, lease_id: str, ts: float) -> None:
        self._put(("timed_out", (lease_id, ts)))

    def lease_started(self, lease_id: str, user: str | None, uid: int | None, command: str | None,
                      gpus: list[str], ts: float) -> bool:
        """:meth:`Accountant.lease_started` on the writer thread; returns once it is written or kept to
        be written when the disk has room (True), or after :data:`LEASE_WRITE_WAIT` seconds (False: the
        writer is behind, the record comes later)."""
        done = threading.Event()
        self._put(("started", (lease_id, user, uid, command, gpus, ts, done)), block=LEASE_WRITE_WAIT)
        return done.wait(LEASE_WRITE_WAIT)

    def lease_ended(self, lease_id: str, ts: float) -> None:
        self._put(("ended", (lease_id, ts)), block=LEASE_WRITE_WAIT)

    def call(self, fn: Callable[[sqlite3.Connection], Any]) -> None:
        """Run ``fn(connection)`` on the writer thread (tests, maintenance)."""
        self._put(("call", fn))

    @property
    def kept(self) -> int:
        """Items not written yet, kept until the disk has room."""
        return len(self._kept)

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
            if not self._kept:
                timeout: float | None = None
            else:
                timeout = RETRY_EVERY if self._failing is not None else 0.0
            try:
                item = self._q.get(timeout=timeout) if timeout != 0.0 else self._q.get_nowait()
            except queue.Empty:
                item = ("retry", None)
            if item is None:
                self._drain(deadline=time.monotonic() + CLOSE_WAIT)
                if self._kept:
                    log.warning("history: %d sample(s) or event(s) could not be written before the stop "
                                "(%s)", len(self._kept), self._failed_on)
                if self.acc is not None:
                    try:
                        self.acc.close_jobs()
                    except sqlite3.Error as exc:
                        log.warning("history: cannot close the open jobs: %r", exc)
                break
            if item[0] != "retry":
                self._keep(item)
            self._drain()
        if self.acc is not None:
            self.acc.conn.close()

    def _open(self) -> Accountant:
        conn = connect(self.path)
        try:
            return Accountant(conn, *self._args)
        except BaseException:
            conn.close()
            raise

    def _keep(self, item: tuple[str, Any]) -> None:
        """Append ``item`` to what is to be written (the bounds are kept by :meth:`_trim`)."""
        what, arg = item
        if what == "started":
            self._handled.append(arg[-1])
        elif what == "sample":
            self._kept_samples += 1
        self._kept.append(item)

    def _trim(self) -> None:
        """Drop the oldest kept samples past :data:`KEEP_SAMPLES`, the oldest other items past
        :data:`KEEP_EVENTS` (after a try that found no room: a free disk writes them instead)."""
        while self._kept_samples > KEEP_SAMPLES:
            self._drop_first(lambda w: w == "sample")
            self._kept_samples -= 1
        while len(self._kept) - self._kept_samples > KEEP_EVENTS:
            self._drop_first(lambda w: w != "sample")

    def _drop_first(self, which: Callable[[str], bool]) -> None:
        for i, (what, arg) in enumerate(self._kept):
            if which(what):
                del self._kept[i]
                if what == "started":
                    arg[-1].set()
                break
        self._lose()

    def _lose(self) -> None:
        self.lost += 1
        if self.lost == 1 or self.lost % 1000 == 0:
            log.warning("history: the disk stayed full: %d kept sample(s) or event(s) dropped, oldest first",
                        self.lost)

    def _drain(self, deadline: float | None = None) -> None:
        """Write what is kept, oldest first: at most :data:`RETRY_BATCH` items (or until ``deadline``),
        stopping at the first that fails for want of room (it stays first, for the next try)."""
        n = 0
        try:
            while self._kept and (n < RETRY_BATCH if deadline is None else time.monotonic() < deadline):
                item = self._kept[0]
                try:
                    self._write(item)
                except Exception as exc:
                    if _no_room(exc):
                        self._fail(exc)
                        if deadline is None:
                            self._trim()
                            return
                        time.sleep(min(RETRY_EVERY, max(0.0, deadline - time.monotonic())))
                        continue
                    # a damaged file, a bug: this item is never written; the next may be
                    self.errors += 1
                    if self.errors == 1 or self.errors % 1000 == 0:
                        log.warning("history: cannot record a sample: %r", exc)
                self._kept.popleft()
                if item[0] == "sample":
                    self._kept_samples -= 1
                n += 1
            if not self._kept and self._failing is not None:
                log.warning("history: writing %s again after %.0f s; everything kept meanwhile is recorded%s",
                            self.path, time.monotonic() - self._failing,
                            f" but {self.lost - self._lost_then} sample(s) or event(s) dropped"
                            if self.lost > self._lost_then else "")
                self._failing = None
        finally:
            # a grant waits for its record written, or kept to be
            for done in self._handled:
                done.set()
            self._handled.clear()

    def _fail(self, exc: Exception) -> None:
        if self._failing is None:
            self._failing = time.monotonic()
            self._failed_on = str(exc)
            self._lost_then = self.lost
            log.warning("history: cannot write %s (%s): keeping what is not written (at most %d samples, %d "
                        "events) to write when there is room", self.path, exc, KEEP_SAMPLES, KEEP_EVENTS)

    def _write(self, item: tuple[str, Any]) -> None:
        # not opened yet (a full disk as the daemon started)
        if self.acc is None:
            self.acc = self._open()
        acc, (what, arg) = self.acc, item
        if what == "sample":
            acc.add(arg)
        elif what == "started":
            acc.lease_started(*arg[:-1])
        elif what == "ended":
            acc.lease_ended(*arg)
        elif what == "idle":
            acc.mark_idle(*arg)
        elif what == "timed_out":
            acc.mark_timed_out(*arg)
        else:
            arg(acc.conn)

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


# SQLite's primary result codes (sqlite3.h) of a write that may work later: SQLITE_BUSY, SQLITE_LOCKED,
# SQLITE_IOERR, SQLITE_FULL, SQLITE_CANTOPEN
_NO_ROOM = (5, 6, 10, 13, 14)


def _full(exc: BaseException) -> bool:
    """Whether ``exc`` says the disk (or the user's quota) is full."""
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    code = getattr(exc, "sqlite_errorcode", None)
    return isinstance(exc, sqlite3.Error) and (code & 0xFF == 13 if code is not None else "full" in str(exc))


def _no_room(exc: BaseException) -> bool:
    """Whether ``exc`` says the disk has no room (or failed a write) for now: what is kept and written
    again, where another error (a damaged file, a bug) would fail again the same way."""
    if isinstance(exc, sqlite3.Error):
        code = getattr(exc, "sqlite_errorcode", None)
        if code is not None:
            # the primary code of an extended one (SQLITE_IOERR_WRITE)
            return code & 0xFF in _NO_ROOM
        # Python before 3.11 gives the message only
        return "full" in str(exc) or "disk I/O" in str(exc)
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EIO)
    return False
