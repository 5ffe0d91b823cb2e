"""The supervisor of a job: what ``gpusd run`` is (docs/jobs.md).

It leases the GPUs, writes the job's record (:mod:`gpusd.jobs.record`) and its GPU file (the
protocol: ``GPUSD_JOB_FILE``, rewritten atomically, and ``--notify-signal`` on every change), runs
the command in its own process group, and serves the job's control socket
(:mod:`gpusd.jobs.control`): grow, shrink, preempt, pause/resume, move.  The command is restarted,
keeping the lease, when it exits with :data:`RESTART_ME` (75); a preempted job is restarted when
GPUs qualify again; ``GPUSD_RESTART_COUNT`` tells the command how many times it was restarted.

Lease descriptors are handed to the command as plain ``gpusd run`` does, so its GPUs stay leased while
it lives, even if the supervisor is killed.  A ``--preemptible`` or ``--pausable`` command runs in
its own process group (so that SIGTERM, SIGSTOP and SIGCONT reach all of it); signals to
``gpusd run`` are forwarded to it.  GPUs added by ``grow`` are held by the supervisor until the next restart hands
them over too; a GPU given back by ``shrink`` that the running command inherited stays locked (and
recorded) until that command exits or restarts.  Where the daemon holds the job's lease (the lease
authority, :mod:`gpusd.alloc.authority`), grow and shrink are asked of it on the lease's connection:
it holds every descriptor, so a GPU given back is freed at once.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

from ..alloc.api import Selection, allocate, shared_backend
from ..alloc.authority import RemoteLease
from ..alloc.leases import MAX_LEASE_BYTES, Lease, LeaseStore, current_user
from ..alloc.lockdir import create_exclusive
from ..alloc.priority import PRIORITIES, priority_name
from ..alloc.select import Candidate, Constraints
from ..errors import GpusdError, NoGpuAvailable, to_wire
from ..ids import JobId
from . import control
from .record import JobRecord, RecordWriter, list_jobs

TYPE_CHECKING = False  # typing is not imported at run time: start-up time (issue 24)

if TYPE_CHECKING:
    from typing import Any, Callable, Sequence

    from .checkpoint import CudaCheckpoint

RESTART_ME = 75
FILE_FORMAT = 1
# --on-change (docs/jobs.md): after a grow or shrink rewrites the job file, send the notify signal
# ("signal"), restart the command like a move ("restart"), or nothing ("file": the command polls the file)
ON_CHANGE = ("signal", "restart", "file")
MAX_PREEMPTIONS_PER_HOUR = 3  # docs/jobs.md, "Fairness": then the job is not preemptible for that hour
PREEMPT_RETRY = 10.0  # seconds: a job blocked at the head of the queue asks for room again at most this often
from ..alloc.runner import FORWARDED  # noqa: E402  (one list of the signals a runner passes on)


class Stopped(BaseException):
    """A signal to stop arrived while no command was running (queued, or preempted and waiting)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def log(message: str) -> None:
    print(f"gpusd: {message}", file=sys.stderr, flush=True)


class Supervisor:
    def __init__(self, c: Constraints, cmd: Sequence[str], *, command: str, priority: int = PRIORITIES["normal"],
                 preemptible: bool = False, pausable: bool = False, notify_signal: int = signal.SIGUSR1,
                 grace: float = 30.0, wait: bool = False, timeout: float | None = None,
                 simulate: str | None = None, use_uuid: bool = False, cuda_checkpoint: "CudaCheckpoint | None" = None,
                 host: str | None = None, on_change: str = "signal", bind_cpus: bool = False) -> None:
        self.c, self.cmd, self.command = c, list(cmd), command
        self.on_change = on_change  # ON_CHANGE: how the command is told of a grow or shrink
        self.bind_cpus = bind_cpus  # run the command on its GPUs' local CPUs (alloc.cpus)
        self.priority, self.preemptible, self.pausable = priority, preemptible, pausable
        self.notify_signal, self.grace, self.wait, self.timeout = notify_signal, grace, wait, timeout
        self.simulate, self.use_uuid, self.cuda_checkpoint = simulate, use_uuid, cuda_checkpoint
        self.store = LeaseStore()
        self.lock = threading.RLock()
        self.job_id = JobId.new()
        self.devs: list[Candidate] = []
        self.dev_fds: dict[str, int] = {}
        self.inherited: set[str] = set()
        self.pending: dict[str, int] = {}  # given back, still held by the running command
        self.lease: Lease | Any = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.pgid: int | None = None  # the command's own process group (when it has one)
        self.pidfd: int | None = None  # the command's pidfd: signals that cannot reach a reused pid
        self.stopping: str | None = None  # "preempt", "move", "change" (--on-change restart), "user"
        self.generation = 0
        self.restarts = 0
        self.preemptions: list[float] = []
        self.asked: list[str] = []  # the jobs we last asked to make room, and when
        self.asked_at: float | None = None
        self.decided_at: float | None = None
        self.exited_at: float | None = None
        self.last_migration: float | None = None
        self.closing = False
        self.writer = RecordWriter(self.store, JobRecord(
            job=self.job_id, pid=os.getpid(), user=current_user(), command=command, priority=priority,
            preemptible=preemptible, pausable=pausable, state="queued", started=time.time(), host=host))
        self.private = Path(tempfile.mkdtemp(prefix=f"gpusd-job-{self.job_id}-"))
        self.job_file = self.private / "gpus.json"
        self.server = control.bind(self.store, self.job_id)

    # -- the protocol file ----------------------------------------------------------------------------
    def cuda_visible(self) -> str:
        """The job's devices as its vendor's variable lists them (``CUDA_VISIBLE_DEVICES`` on NVIDIA,
        ``ROCR_VISIBLE_DEVICES`` on AMD, ``ZE_AFFINITY_MASK`` on Intel)."""
        if all(d.gpu.vendor == "nvidia" for d in self.devs):
            if self.use_uuid or any(d.mig is not None for d in self.devs):
                return ",".join(d.uuid for d in self.devs)
            return ",".join(str(d.gpu.device_index) for d in self.devs)
        from ..inventory.vendors import DEVICE_VARIABLE

        env = self.visible_env()
        return ",".join(env[v] for v in DEVICE_VARIABLE.values() if env.get(v))

    def visible_env(self) -> dict[str, str]:
        from ..inventory.vendors import Visible, visible_env

        return visible_env([Visible.of(d.gpu, d.uuid, d.mig is not None) for d in self.devs], use_uuid=self.use_uuid)

    def write_job_file(self, state: str, reason: str | None = None) -> None:
        self.generation += 1
        d = {"format": FILE_FORMAT, "job": self.job_id, "generation": self.generation, "state": state,
             "reason": reason, "restarts": self.restarts, "cuda_visible_devices": self.cuda_visible(),
             "env": self.visible_env(),  # issue 21: the vendor's variables (additive)
             "devices": [{"index": x.gpu.index, "uuid": x.uuid, "label": x.label} for x in self.devs]}
        tmp = self.private / f".gpus.{self.generation}.tmp"
        tmp.write_text(json.dumps(d))
        os.replace(tmp, self.job_file)
        self.writer.write(devices=[x.uuid for x in self.devs], indices=[x.gpu.index for x in self.devs],
                          state=state if state != "stopping" else self.writer.record.state, reason=reason,
                          restarts=self.restarts)

    def notify(self) -> str:
        """Send the notify signal to the command, but only if it catches it (the kernel's ``SigCgt``):
        a program without a handler would be ended by it (SIGUSR1's default action).  Says how the
        command was told, for grow's and shrink's answer."""
        name = signal.Signals(self.notify_signal).name
        proc, pidfd = self.proc, self.pidfd
        if proc is None or proc.poll() is not None:
            return "no command runs now: it sees the job file when it starts"
        catching = catches(proc.pid, self.notify_signal)
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
                signal.pidfd_send_signal(pidfd, self.notify_signal)
            else:  # pragma: no cover - a kernel without pidfds (before Linux 5.3)
                os.kill(proc.pid, self.notify_signal)
        except ProcessLookupError:
            return "the command had exited"
        return f"the command was sent {name}"

    # -- leases -------------------------------------------------------------------------------------
    def _take(self, sel: Selection) -> None:
        self.lease = sel.lease
        self.devs = list(sel.devices)
        lease = sel.lease
        self.dev_fds = dict(zip(lease.devices, lease.fds[:-1])) if isinstance(lease, Lease) else {}
        self._rewrite_lease()
        self.writer.write(lease=lease.lease_id if lease is not None else None)

    def _allocate(self, c: Constraints, wait: bool, timeout: float | None, first: bool = False,
                  resume: bool = False, cancelled: Callable[[], bool] | None = None) -> Selection:
        """A job's first lease goes through the daemon where it is the lease authority, except for a
        ``--preemptible`` job, whose supervisor must hold the lock descriptors to move it; GPUs added
        later (grow, move) join a lock-directory lease, so they are taken there too.  A waiting job
        of priority above ``low`` preempts when it reaches the head of the queue and nothing qualifies."""
        local = not first or self.preemptible
        blocked = (lambda: self.preempt_when_blocked(c.count)) if first and self.priority > PRIORITIES["low"] else None
        return allocate(c, lease=True, wait=wait, timeout=timeout, simulate=self.simulate, command=self.command,
                        store=self.store if local else None, backend=shared_backend(self.simulate) if local else None,
                        priority=self.priority, resume=resume, when_blocked=blocked, job=self.job_id,
                        cancelled=cancelled)

    def acquire(self, wait: bool, timeout: float | None) -> None:
        """The job's GPUs: at once; with ``wait`` through the queue, where it asks lower-priority jobs
        to make room once it is at the head and nothing qualifies."""
        if wait and self.priority > PRIORITIES["low"] and not self.preemptible and self._through_daemon():
            # The daemon queues for us and cannot preempt our jobs: ask for room first when nothing
            # qualifies and nobody of our class or above is queued.
            from ..alloc import queue
            from ..alloc.priority import load_policy

            if not queue.ahead_of_newcomer(self.store, load_policy().believed(self.priority, os.geteuid())):
                try:  # would anything qualify now? (a choice only, no lease: the daemon's, its GPUs may be simulated)
                    allocate(self.c, lease=False)
                except NoGpuAvailable:
                    self.preempt_for(self.c.count)
        self._take(self._allocate(self.c, wait, timeout if wait else None, first=True))

    def _through_daemon(self) -> bool:
        """Whether the first lease would be asked of a daemon (the lease authority)."""
        from ..alloc import authority

        path = authority.socket_path()
        return (self.simulate is None and not os.environ.get("GPUSD_SIMULATE") and path is not None
                and path.exists())

    def preempt_when_blocked(self, count: int) -> None:
        """Called each time the job at the head of the queue finds nothing qualifying: preempt, then
        ask again only once the jobs asked have stopped (their records hold no GPUs any more) and at
        most every :data:`PREEMPT_RETRY` seconds, so that a victim still checkpointing within its grace
        period is not joined by more victims than needed."""
        now = time.monotonic()
        if self.asked_at is not None and now - self.asked_at < PREEMPT_RETRY:
            return
        if self.asked:
            live = {r.job: r for r in list_jobs(self.store)}
            if any(j in live and live[j].devices and live[j].state in ("preempted", "running") for j in self.asked):
                return  # still stopping (or refused to): their GPUs are not free yet
        self.asked_at = now
        self.asked = self.preempt_for(count)

    def preempt_for(self, count: int) -> list[str]:
        """Ask preemptible jobs of lower priority (our own user's, or anyone's when we are root) to
        stop until ``count`` GPUs are freed.  The victims decide too (docs/jobs.md)."""
        me = os.geteuid()
        victims = [r for r in list_jobs(self.store) if r.preemptible and r.priority < self.priority
                   and r.state == "running" and r.job != self.job_id and (me == 0 or r.uid == me)]
        victims.sort(key=lambda r: (r.priority, -(r.started or 0.0)))
        asked: list[str] = []
        freed = 0
        for v in victims:
            if freed >= count:
                break
            try:
                answer = control.request(v.job, v.uid, {"op": "preempt", "by": self.job_id,
                                                         "priority": self.priority}, store=self.store)
            except GpusdError as exc:
                log(f"job {self.job_id}: could not preempt job {v.job}: {exc}")
                continue
            if answer.get("ok"):
                freed += len(v.devices)
                asked.append(v.job)
                log(f"job {self.job_id} (priority {priority_name(self.priority)}) preempted job {v.job} "
                    f"(priority {priority_name(v.priority)}) for {count} GPU(s)")
        return asked

    def _rewrite_lease(self) -> None:
        """The lease record names the GPUs held now (ours and those still held by the command)."""
        lease = self.lease
        if not isinstance(lease, Lease) or lease.released:
            return
        raw = os.pread(lease.info_fd, MAX_LEASE_BYTES, 0)
        record = json.loads(raw)
        record["devices"] = [d.uuid for d in self.devs] + list(self.pending)
        record["job"] = self.job_id
        dfd = lease.dir_fd
        tmp = f".lease-{lease.lease_id}-{os.urandom(3).hex()}.tmp"
        import fcntl

        fd = create_exclusive(dfd, tmp, self.store.dir)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, json.dumps(record).encode())
        os.rename(tmp, lease.path.name, src_dir_fd=dfd, dst_dir_fd=dfd)
        old = lease.fds[-1]
        lease.fds = [self.dev_fds[d.uuid] for d in self.devs] + [fd]
        lease.devices = [d.uuid for d in self.devs]
        if old not in lease.fds:
            os.close(old)

    def grow(self, n: int, wait: bool, timeout: float | None,
             cancelled: Callable[[], bool] | None = None) -> dict[str, Any]:
        """``n`` more GPUs; ``cancelled`` says the asker went away (a wait then ends)."""
        if isinstance(self.lease, RemoteLease):
            return self._grow_remote(self.lease, n, wait, timeout)
        with self.lock:
            if not isinstance(self.lease, Lease) or self.lease.released or self.stopping == "preempt":
                return {"ok": False, "message": f"job {self.job_id} holds no lease now (it is preempted or "
                        "waiting): grow it once it runs"}
        c = replace(self.c, count=n)
        try:
            sel = self._allocate(c, wait, timeout, cancelled=cancelled)
        except GpusdError as exc:
            return _refusal(exc)
        extra = sel.lease
        assert isinstance(extra, Lease)
        with self.lock:
            if not isinstance(self.lease, Lease) or self.lease.released or self.stopping == "preempt":
                extra.release()  # preempted while we waited: the GPUs are not the job's to keep
                return {"ok": False, "message": f"job {self.job_id} was preempted meanwhile: not grown"}
            for uuid, fd in zip(extra.devices, extra.fds[:-1]):
                self.dev_fds[uuid] = fd
            self.devs.extend(sel.devices)
            extra.fds = extra.fds[-1:]  # the devices are ours now; its record goes
            self._rewrite_lease()
            extra.release()
            self.write_job_file("running", f"grown by {n} GPU(s)" + self._restart_note())
            told = self._tell()
        log(f"job {self.job_id}: grown to {self.cuda_visible()}" + self._restart_note())
        return {"ok": True, "devices": self.cuda_visible(), "message": told}

    def _grow_remote(self, lease: RemoteLease, n: int, wait: bool, timeout: float | None) -> dict[str, Any]:
        """Grow a lease the daemon holds: it takes the GPUs (same constraints, same queue) and names
        them in the job's lease record; it holds their descriptors, so nothing is handed to the command."""
        try:
            added = lease.grow(replace(self.c, count=n), wait=wait, timeout=timeout)
        except GpusdError as exc:
            return _refusal(exc)
        with self.lock:
            self.devs.extend(added)
            self.write_job_file("running", f"grown by {n} GPU(s)" + self._restart_note())
            told = self._tell()
        log(f"job {self.job_id}: grown to {self.cuda_visible()}" + self._restart_note())
        return {"ok": True, "devices": self.cuda_visible(), "message": told}

    def _to_drop(self, n: int | None, release: str | None) -> list[Candidate] | str:
        """The GPUs a shrink gives back (the last added, or the one named), or why none."""
        if release is not None:
            drop = [d for d in self.devs if release in (str(d.gpu.index), d.label) or d.uuid.startswith(release)]
            if not drop:
                return f"job {self.job_id} has no GPU {release}"
        else:
            k = n or 1
            drop = self.devs[-k:] if k < len(self.devs) else []
        if not drop or len(drop) >= len(self.devs):
            return f"a job keeps at least one GPU (it has {len(self.devs)})"
        return drop

    def _shrink_remote(self, lease: RemoteLease, n: int | None, release: str | None) -> dict[str, Any]:
        """Shrink a lease the daemon holds: the daemon frees each GPU at once (it holds the
        descriptors; the command holds only the connection)."""
        with self.lock:
            drop = self._to_drop(n, release)
        if isinstance(drop, str):
            return {"ok": False, "message": drop}
        done: list[Candidate] = []
        failed = None
        for d in drop:
            try:
                lease.drop(d.uuid)
            except GpusdError as exc:
                failed = str(exc)
                break
            done.append(d)
        if done:
            with self.lock:
                for d in done:
                    if d in self.devs:
                        self.devs.remove(d)
                self.write_job_file("running", f"shrunk by {len(done)} GPU(s)" + self._restart_note())
                told = self._tell()
        msg = f"job {self.job_id} now has {self.cuda_visible()}"
        log(msg + self._restart_note() if failed is None else f"{msg}; giving back the rest failed: {failed}")
        if done:
            msg = f"{msg}; {told}"
        if failed is not None:
            return {"ok": False, "devices": self.cuda_visible(), "message": f"{msg}; giving back the rest failed: "
                    f"{failed}"}
        return {"ok": True, "devices": self.cuda_visible(), "message": msg}

    def shrink(self, n: int | None, release: str | None) -> dict[str, Any]:
        if isinstance(self.lease, RemoteLease):
            return self._shrink_remote(self.lease, n, release)
        if not isinstance(self.lease, Lease):
            return {"ok": False, "message": f"job {self.job_id} holds no lease now"}
        with self.lock:
            drop = self._to_drop(n, release)
            if isinstance(drop, str):
                return {"ok": False, "message": drop}
            later = []
            for d in drop:
                self.devs.remove(d)
                fd = self.dev_fds.pop(d.uuid)
                if d.uuid in self.inherited:
                    self.pending[d.uuid] = fd
                    later.append(d.label)
                else:
                    _close(fd)
            self._rewrite_lease()
            self.write_job_file("running", f"shrunk by {len(drop)} GPU(s)" + self._restart_note())
            told = self._tell()
        msg = f"job {self.job_id} now has {self.cuda_visible()}"
        if later:
            msg += f"; GPU {','.join(later)} is freed when the running command exits or restarts"
        log(msg + self._restart_note())
        msg = f"{msg}; {told}"
        return {"ok": True, "devices": self.cuda_visible(), "message": msg}

    def _restart_note(self) -> str:
        return "; the command restarts (--on-change restart)" if self.on_change == "restart" else ""

    def _tell(self) -> str:
        """Tell the command its GPUs changed (grow, shrink), as ``--on-change`` says: the notify
        signal (only to a command that catches it); or a restart like a move's (SIGTERM to its group,
        --grace, SIGKILL; started again at once on the job's GPUs then, same lease); or nothing (it
        polls the job file).  Says how it was told."""
        if self.on_change == "signal":
            return self.notify()
        if self.on_change == "restart":
            if not self.stopping:  # a stop under way starts it on the GPUs now
                self._stop_child("change")
            return "the command restarts on its GPUs now (--on-change restart)"
        return "not signalled (--on-change file): the command sees the change in $GPUSD_JOB_FILE"

    def _stop_child(self, why: str) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        self.stopping = why
        self.stop_deadline = time.monotonic() + self.grace
        pgid = self.pgid
        self._signal(signal.SIGCONT)
        self._signal(signal.SIGTERM)
        # the thread's own descriptor of this command: self.pidfd is closed (and its number may be
        # reused) when the next command starts, before the grace period is over
        pidfd, had = _dup(self.pidfd), self.pidfd is not None

        def kill_later() -> None:
            try:
                proc.wait(self.grace)
            except subprocess.TimeoutExpired:
                log(f"job {self.job_id}: no exit within the {self.grace:g}s grace period: SIGKILL")
                if pidfd is not None or not had:  # no dup (out of descriptors): never by the bare pid
                    _signal_command(pidfd, pgid, proc.pid, signal.SIGKILL)
            finally:
                if pidfd is not None:
                    os.close(pidfd)

        threading.Thread(target=kill_later, daemon=True).start()

    def _signal(self, signum: int) -> None:
        """Signal the running command (its process group when it has one), never a process that
        reused its pid: see ``_signal_command``."""
        if self.proc is not None:
            _signal_command(self.pidfd, self.pgid, self.proc.pid, signum)

    def preempt(self, by: str, priority: int) -> dict[str, Any]:
        with self.lock:
            if not self.preemptible:
                return {"ok": False, "message": f"job {self.job_id} is not preemptible"}
            if priority <= self.priority:
                return {"ok": False, "message": "only a job of higher priority may preempt this one"}
            now = time.time()
            self.preemptions = [t for t in self.preemptions if now - t < 3600]
            if len(self.preemptions) >= MAX_PREEMPTIONS_PER_HOUR:
                return {"ok": False, "message": f"job {self.job_id} was preempted {len(self.preemptions)} times in "
                        "the last hour: not again before it has run (docs/jobs.md, fairness)"}
            if self.stopping or self.proc is None or self.proc.poll() is not None:
                return {"ok": False, "message": f"job {self.job_id} is not running"}
            self.preemptions.append(now)
            self.write_job_file("preempted", f"preempted by job {by} (priority {priority_name(priority)})")
            self._stop_child("preempt")
        log(f"job {self.job_id}: preempted by job {by}; SIGTERM, {self.grace:g}s to checkpoint")
        return {"ok": True, "message": f"job {self.job_id} stops within {self.grace:g}s"}

    def move(self, avoid: Sequence[str], reason: str) -> dict[str, Any]:
        if not isinstance(self.lease, Lease):
            return {"ok": False, "message": "this job's lease is held by the daemon"}
        with self.lock:
            if not self.preemptible:
                return {"ok": False, "message": f"job {self.job_id} is not preemptible: it is not moved"}
            hot = [d for d in self.devs if d.uuid in avoid]
            if not hot or self.stopping or self.proc is None or self.proc.poll() is not None:
                return {"ok": False, "message": "nothing to move"}
        self.decided_at = decided = time.monotonic()
        c = replace(self.c, count=len(hot), exclude=[*(self.c.exclude or []), *avoid])
        try:
            sel = self._allocate(c, False, None)
        except GpusdError as exc:
            return {"ok": False, "message": str(exc)}
        extra = sel.lease
        assert isinstance(extra, Lease)
        with self.lock:
            new = dict(zip((d.uuid for d in hot), sel.devices))
            note = self._migrate_cuda({u: new[u].uuid if u in new else u for u in sorted(self.inherited)}, list(new))
            for d in hot:  # in place: the process's CUDA device k is the job file's device k
                self.devs[self.devs.index(d)] = new[d.uuid]
                fd = self.dev_fds.pop(d.uuid)
                if note is None:  # the command runs on the new GPU now: the old one is free
                    _unlock(fd)
                    self.inherited.discard(d.uuid)
                    self.inherited.add(new[d.uuid].uuid)  # in use by the command: a shrink keeps it locked
                else:
                    self.pending[d.uuid] = fd
            for uuid, fd in zip(extra.devices, extra.fds[:-1]):
                self.dev_fds[uuid] = fd
            extra.fds = extra.fds[-1:]
            self._rewrite_lease()
            extra.release()
            if note is None:
                self.last_migration, self.decided_at = time.monotonic() - decided, None
                msg = f"moved to GPU {self.cuda_visible()} by cuda-checkpoint, without a restart"
                self.write_job_file("running", f"{reason}; {msg}")
                self.notify()
            else:
                msg = f"moving to GPU {self.cuda_visible()} with the job protocol (SIGTERM, restart)"
                msg += f": {note}" if self.cuda_checkpoint is not None else ""
                self.write_job_file("moving", f"{reason}; {msg}")
                self._stop_child("move")
        log(f"job {self.job_id}: {msg}: {reason}")
        return {"ok": True, "devices": self.cuda_visible(), "message": msg}

    def _migrate_cuda(self, mapping: dict[str, str], hot: list[str]) -> str | None:
        """Move the command's CUDA state with cuda-checkpoint (``--cuda-checkpoint``, docs/jobs.md):
        ``mapping`` names each GPU the command started with (old UUID -> new UUID).  None when done,
        else why not (the caller then uses the job protocol)."""
        if self.cuda_checkpoint is None:
            return "no cuda-checkpoint (gpusd run --cuda-checkpoint)"
        if self.proc is None or self.proc.poll() is not None:
            return "the command is not running"
        if not set(hot) <= set(mapping):
            return "cuda-checkpoint not used: the command was not started on the GPU moved"
        from .checkpoint import CheckpointFailed

        try:
            pids = self.cuda_checkpoint.migrate(self.proc.pid, mapping)
        except CheckpointFailed as exc:
            return f"cuda-checkpoint failed: {exc}"
        log(f"job {self.job_id}: cuda-checkpoint moved the CUDA state of process(es) {pids}")
        return None

    def pause(self, on: bool, reason: str) -> dict[str, Any]:
        with self.lock:
            if not self.pausable:
                return {"ok": False, "message": f"job {self.job_id} is not pausable"}
            if self.proc is None or self.proc.poll() is not None:
                return {"ok": False, "message": "not running"}
            self._signal(signal.SIGSTOP if on else signal.SIGCONT)
            self.writer.write(state="paused" if on else "running", reason=reason)
        log(f"job {self.job_id}: {'paused' if on else 'resumed'}: {reason}")
        return {"ok": True}

    # -- the control socket ------------------------------------------------------------------------
    def serve(self) -> None:
        while not self.closing:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(10)
            uid = control.peer_uid(conn)
            req = control.read_line(conn, within=10)  # read first: the refusal is an answer, not a broken pipe
            if uid not in (0, os.geteuid()):
                answer: dict[str, Any] = {"ok": False, "message": f"job {self.job_id} belongs to another user: only "
                                          "its owner or root may change it"}
                log(f"job {self.job_id}: refused a request of uid {uid}")
            else:
                answer = self.dispatch(req, uid, cancelled=lambda: _hung_up(conn))
            conn.sendall(control.encode(answer))
        except Exception as exc:  # a bad request never stops the job
            try:
                conn.sendall(control.encode({"ok": False, "message": f"bad request: {exc}"[:300]}))
            except OSError:
                pass
        finally:
            conn.close()

    def dispatch(self, req: dict[str, Any], uid: int | None = None,
                 cancelled: Callable[[], bool] | None = None) -> dict[str, Any]:
        op = req.get("op")
        count = req.get("count")
        if count is not None and (type(count) is not int or not 0 < count <= 64):
            return {"ok": False, "message": "count must be a number of GPUs from 1 to 64"}
        if op == "status":
            return {"ok": True, "record": self.writer.record.to_dict(), "migration_s": self.last_migration}
        if op == "grow":
            timeout = req.get("timeout")
            if timeout is not None and (type(timeout) not in (int, float) or not 0 <= timeout < 1e6):
                return {"ok": False, "message": "bad timeout"}
            return self.grow(count or 1, req.get("wait") is True, timeout, cancelled)
        if op == "shrink":
            release = req.get("release")
            return self.shrink(count, release[:128] if isinstance(release, str) else None)
        if op == "preempt":
            prio = req.get("priority")
            by = req.get("by")
            if type(prio) is not int:
                return {"ok": False, "message": "no priority"}
            from ..alloc.priority import load_policy

            prio = load_policy().believed(prio, os.geteuid() if uid is None else uid)  # the policy's bound
            return self.preempt(str(by)[:32] if by else "?", prio)
        if op == "move":
            avoid = req.get("avoid")
            if not isinstance(avoid, list) or not all(isinstance(a, str) for a in avoid):
                return {"ok": False, "message": "avoid: a list of GPU UUIDs"}
            return self.move(avoid[:64], str(req.get("reason") or "asked")[:200])
        if op in ("pause", "resume"):
            return self.pause(op == "pause", str(req.get("reason") or "asked")[:200])
        return {"ok": False, "message": f"unknown op {str(op)[:32]!r}"}

    # -- the run --------------------------------------------------------------------------------------
    def start_child(self) -> subprocess.Popen[bytes]:
        from ..inventory.vendors import Visible, job_environ

        env = job_environ(os.environ, [Visible.of(d.gpu, d.uuid, d.mig is not None) for d in self.devs],
                          use_uuid=self.use_uuid)
        env.update({"GPUSD_JOB_ID": self.job_id, "GPUSD_JOB_FILE": str(self.job_file),
                    "GPUSD_NOTIFY_SIGNAL": signal.Signals(self.notify_signal).name,
                    "GPUSD_RESTART_COUNT": str(self.restarts), "GPUSD_RESTART_STATUS": str(RESTART_ME),
                    "GPUSD_GPU_COUNT": str(len(self.devs))})
        if self.lease is not None:
            env["GPUSD_LEASE"] = self.lease.lease_id
        fds = list(self.lease.fds) if self.lease is not None else []
        own_group = self.preemptible or self.pausable or self.on_change == "restart"
        cpus = None
        if self.bind_cpus:  # at every start: a grow, shrink or move changes the GPUs
            from ..alloc.cpus import binding

            cpus, said = binding([d.gpu for d in self.devs])
            log(said)
        from ..alloc.cpus import preexec

        proc = subprocess.Popen(self.cmd, env=env, pass_fds=fds, preexec_fn=preexec(cpus, own_group))
        self.pgid = proc.pid if own_group else None
        if self.pidfd is not None:  # the previous command's (reaped before a new one starts)
            os.close(self.pidfd)
        try:  # before anyone can reap it: the pidfd names this command for good
            self.pidfd = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):  # pragma: no cover - a kernel without pidfds
            self.pidfd = None
        self.inherited = set(self.dev_fds)
        self.writer.write(child=proc.pid)
        return proc

    def run(self) -> int:
        threading.Thread(target=self.serve, daemon=True).start()
        stop = {"user": False}

        from ..alloc.runner import _interactive

        interactive = _interactive() and not (self.preemptible or self.pausable or self.on_change == "restart")

        def forward(signum: int, _frame: object) -> None:
            if signum in (signal.SIGINT, signal.SIGQUIT) and interactive:
                stop["user"] = True
                return  # the terminal sent it to the whole foreground group, the command included
            if signum != signal.SIGUSR1:
                stop["user"] = True
            proc = self.proc
            if proc is not None and proc.poll() is None:
                self._signal(signum)
            elif signum != signal.SIGUSR1:  # queued or preempted, no command running: stop waiting
                raise Stopped(signum)

        previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
        rc = 0
        try:
            self.acquire(self.wait, self.timeout)
            while True:
                with self.lock:
                    for fd in self.pending.values():
                        _close(fd)
                    self.pending.clear()
                    self._rewrite_lease()
                    self.stopping = None
                    self.write_job_file("running", self.writer.record.reason)
                    try:
                        self.proc = self.start_child()
                    except FileNotFoundError:
                        log(f"command not found: {self.cmd[0]}")
                        return 127
                    except PermissionError:
                        log(f"permission denied: {self.cmd[0]}")
                        return 126
                    if self.exited_at is not None and self.decided_at is not None:
                        self.last_migration = time.monotonic() - self.exited_at
                        self.writer.write(reason=f"{self.writer.record.reason} (restarted in "
                                          f"{self.last_migration * 1000:.0f} ms)")
                        log(f"job {self.job_id}: running on GPU {self.cuda_visible()} (restarted in "
                            f"{self.last_migration * 1000:.0f} ms after the command exited)")
                    self.decided_at = self.exited_at = None
                rc = self.proc.wait()
                with self.lock:
                    why = self.stopping
                if self.pgid is not None and (why or rc == RESTART_ME):
                    # the leader is gone; what is left of its group (children that ignore SIGTERM)
                    # gets the rest of the grace, then SIGKILL, before its GPUs are reused
                    _end_group(self.pgid, getattr(self, "stop_deadline", time.monotonic()) if why else
                               time.monotonic() + self.grace)
                self.exited_at = time.monotonic()
                if stop["user"]:
                    break
                if why == "preempt":
                    with self.lock:  # against a grow or shrink on the control socket meanwhile
                        assert self.lease is not None
                        self.lease.release()
                        self.dev_fds.clear()
                        for fd in self.pending.values():  # given back while it ran: free them too
                            _close(fd)
                        self.pending.clear()
                        self.devs = []
                        self.restarts += 1
                        self.writer.write(state="preempted", devices=[], indices=[], restarts=self.restarts)
                    self._take(self._allocate(self.c, True, None, first=True, resume=True))
                    continue
                if why in ("move", "change") or rc == RESTART_ME:
                    self.restarts += 1
                    continue
                break
        except Stopped as exc:
            log(f"job {self.job_id}: stopped by {signal.Signals(exc.signum).name} while waiting for GPUs")
            rc = -exc.signum
        finally:
            self.closing = True
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.close()
        return rc if rc >= 0 else 128 - rc

    def close(self) -> None:
        try:
            self.server.close()
            os.unlink(self.store.dir / control.socket_name(self.job_id))
        except OSError:
            pass
        if self.lease is not None:
            self.lease.release()
        for fd in self.pending.values():
            _close(fd)
        self.writer.close()
        import shutil

        shutil.rmtree(self.private, ignore_errors=True)


def _hung_up(conn: socket.socket) -> bool:
    """Whether the asker on the control socket went away (``gpusd grow --wait`` stopped with Ctrl-C)."""
    import select

    try:
        readable, _, _ = select.select([conn], [], [], 0)
        return bool(readable) and conn.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def _refusal(exc: GpusdError) -> dict[str, Any]:
    """The control socket's answer to a grow that got no GPUs (docs/errors.md)."""
    return to_wire(exc)


def _close(fd: int) -> None:
    try:
        os.utime(fd)
    except OSError:
        pass
    try:
        os.close(fd)
    except OSError:
        pass


def _unlock(fd: int) -> None:
    """Free a GPU whose lock descriptor the command inherited too: the flock belongs to the open
    file, shared with the command's copy, so unlocking it here frees the GPU for everyone."""
    import fcntl

    try:
        os.utime(fd)  # when the GPU's lease ended (LeaseStore.release_times), before anyone can take it
    except OSError:
        pass
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    except OSError:
        pass
    _close(fd)


def _end_group(pgid: int, deadline: float) -> None:
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
            deadline = time.monotonic() + 1.0  # SIGKILL is delivered at once; the reaping may lag a little
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


def _signal_command(pidfd: int | None, pgid: int | None, pid: int, signum: int) -> None:
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
        signal.pidfd_send_signal(pidfd, 0)  # raises once the command was reaped
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _dup(fd: int | None) -> int | None:
    try:
        return None if fd is None else os.dup(fd)
    except OSError:  # pragma: no cover - out of descriptors: the SIGKILL then goes nowhere
        return None
