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

Its parts: the command (:class:`gpusd.jobs.child.Child`), the control socket
(:class:`gpusd.jobs.control.ControlServer`), the job's state (:class:`gpusd.jobs.state.JobStates`:
every change along one table), and the lease (:class:`gpusd.alloc.handle.LeaseHandle`: its record is
rewritten through the handle, under the store's selection mutex, never here).  A signal to
``gpusd run`` only forwards it and sets an event (:attr:`Supervisor.stopped`); the main thread
acts on it.
"""

# Imports inside functions: start-up (quick commands import this module).
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from ..alloc import startgate as gate
from ..alloc.api import LeaseRequest, Selection, allocate, shared_backend
from ..alloc.authority import RemoteLease
from ..alloc.handle import Holder, LeaseHandle
from ..alloc.leases import Lease, LeaseStore, current_user
from ..alloc.priority import PRIORITIES, PRIORITY_PATH, priority_name
from ..alloc.runner import FORWARDED
from ..alloc.select import Candidate, Constraints
from ..errors import EXIT_TIME_LIMIT, ConfigError, GpusdError, NoGpuAvailable, exec_failure, to_wire
from ..ids import JobId
from ..record import record, replace
from . import control
from .child import GROUP_AT_SPAWN, Child, private_dir, remove_private_dir
from .record import JobRecord, RecordWriter, list_jobs
from .state import JobState, JobStates

# typing is not imported at run time: start-up time
TYPE_CHECKING = False

if TYPE_CHECKING:
    from typing import Any, Callable, Sequence

    from .checkpoint import CudaCheckpoint
    from .containers import ContainerRun

RESTART_ME = 75
# the status of a job whose --time ran out (as timeout(1) exits; gpusd.errors owns the number)
TIMED_OUT = EXIT_TIME_LIMIT
FILE_FORMAT = 1
# --on-change (docs/jobs.md): after a grow or shrink rewrites the job file, send the notify signal
# ("signal"), restart the command like a move ("restart"), or nothing ("file": the command polls the file)
ON_CHANGE = ("signal", "restart", "file")
# docs/jobs.md, "Fairness": then the job is not preemptible for that hour
MAX_PREEMPTIONS_PER_HOUR = 3
# seconds: a job blocked at the head of the queue asks for room again at most this often
PREEMPT_RETRY = 10.0
# seconds: the main thread looks at the stop event at least this often while GPUs are taken for it
STOP_POLL = 5.0


class Stopped(BaseException):
    """A signal to stop arrived while no command was running (queued, or preempted and waiting)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def log(message: str) -> None:
    print(f"gpusd: {message}", file=sys.stderr, flush=True)


def run_job(spec: JobSpec, cuda_checkpoint: bool = False) -> int:
    """``gpusd run`` on this host (docs/jobs.md): the priority policy's check of ``spec.priority``,
    NVIDIA's cuda-checkpoint for moves where asked (``cuda_checkpoint``) and usable, then the job's
    supervisor until its command has ended; its exit status."""
    from ..alloc.policy import load_priority_policy

    policy = load_priority_policy()
    allowed = policy.max_for(os.geteuid())
    if spec.priority > allowed:
        source = policy.source or "the defaults"
        raise ConfigError(f"--priority {priority_name(spec.priority)}: the priority policy ({source}) allows you "
                          f"at most {priority_name(allowed)}; an administrator names who may use more in "
                          f"{PRIORITY_PATH} (docs/jobs.md)")
    from ..alloc.policy import load as load_fair_use

    # --time, else the class's default in the fair-use policy; more than its maximum is refused
    try:
        limit = load_fair_use().time_limit(spec.priority, spec.time_limit)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if limit != spec.time_limit:
        spec = replace(spec, time_limit=limit)
    # its module only where asked: start-up time
    if cuda_checkpoint:
        from .checkpoint import CudaCheckpoint as Tool
        from .checkpoint import find_cuda_checkpoint

        path = find_cuda_checkpoint()
        found = Tool(path) if path is not None else None
        if found is None:
            log("--cuda-checkpoint: cuda-checkpoint is not on PATH; the job protocol is used instead")
        elif (why := found.unsupported()) is not None:
            log(f"--cuda-checkpoint: {why}; the job protocol is used instead")
        else:
            spec = replace(spec, cuda_checkpoint=found)
            log(f"--cuda-checkpoint: {path}: a move restores the job's CUDA state on the new GPU"
                + ("" if spec.preemptible else " (only --preemptible jobs are moved)"))
    sup = Supervisor(spec)
    try:
        return sup.run()
    except BaseException:
        sup.close()
        raise


@record(frozen=True)
class JobSpec:
    """What ``gpusd run`` was asked (docs/jobs.md): the constraints of the job's GPUs, the command
    (``cmd``; ``command``: as the records show it), its priority, whether it may be preempted
    (``preemptible``) or paused, the signal that tells it of a change (``notify_signal``) and what a
    change does (``on_change``: :data:`ON_CHANGE`), the seconds between SIGTERM and SIGKILL
    (``grace``), whether and how long to wait for GPUs, simulated GPUs, ``CUDA_VISIBLE_DEVICES`` as
    UUIDs, cuda-checkpoint for moves, and binding to the GPUs' CPUs."""

    c: Constraints
    cmd: tuple[str, ...]
    command: str
    priority: int = PRIORITIES["normal"]
    preemptible: bool = False
    pausable: bool = False
    notify_signal: int = signal.SIGUSR1
    grace: float = 30.0
    wait: bool = False
    timeout: float | None = None
    simulate: str | None = None
    use_uuid: bool = False
    cuda_checkpoint: CudaCheckpoint | None = None
    # ON_CHANGE: how the command is told of a grow or shrink
    on_change: str = "signal"
    # run the command on its GPUs' local CPUs (alloc.cpus)
    bind_cpus: bool = False
    # a container run, rewritten for the GPUs at every start
    container: ContainerRun | None = None
    # --time: seconds the command may run from its first start (monotonic)
    time_limit: float | None = None

    @property
    def own_group(self) -> bool:
        """Whether the command runs in its own process group (so that SIGTERM, SIGSTOP and SIGCONT
        reach all of it)."""
        return self.preemptible or self.pausable or self.on_change == "restart" or self.time_limit is not None


def _nudge(fd: int) -> None:
    """One byte into the main thread's wake-up pipe (``fd``; -1 once closed): a full pipe already holds
    a wake-up, so a failed write loses nothing."""
    if fd >= 0:
        try:
            os.write(fd, b"!")
        except OSError:
            pass


class Supervisor:
    """One job: its :class:`JobSpec`, its state (:attr:`state`), its command (:attr:`child`), its lease
    (:attr:`lease`, a :class:`LeaseHandle`) and the GPUs it has now (:attr:`devs`), its record
    (:attr:`writer`) and job file, and its control socket (:attr:`server`).  :meth:`run` is the main
    thread's loop; the control socket's threads change the job under :attr:`lock`."""

    def __init__(self, spec: JobSpec | Constraints, cmd: Sequence[str] | None = None, *, host: str | None = None,
                 **options: Any) -> None:
        # ``spec`` arrives whole from the command line's edge; the constraints, command and keywords of
        # JobSpec are the older form, still read for callers of the library
        spec = spec if isinstance(spec, JobSpec) else JobSpec(spec, tuple(cmd or ()), **options)
        # its GPUs are needed that long at most, its grace included (backfill)
        if spec.time_limit is not None:
            spec = replace(spec, c=replace(spec.c, time_limit=spec.time_limit + spec.grace))
        self.spec = spec
        command = self.spec.command
        # a container's `<runtime> wait`, holding the lease (gpusd.jobs.containers)
        self.holder_proc: Any = None
        self.holder_out = ""
        self.cid_watch: threading.Thread | None = None
        self.store = LeaseStore()
        # the job's GPUs, lease and state, against the control socket's threads
        self.lock = threading.RLock()
        self.job_id = JobId.new()
        self.holder = Holder(command=command, job=self.job_id)
        self.state = JobStates()
        self.child = Child(f"job {self.job_id}")
        self.devs: list[Candidate] = []
        # the GPUs whose lock descriptors the running command inherited
        self.inherited: set[str] = set()
        self.lease: LeaseHandle | None = None
        self.restarts = 0
        self.generation = 0
        self.preemptions: list[float] = []
        # the jobs we last asked to make room, and when
        self.asked: list[str] = []
        self.asked_at: float | None = None
        self.decided_at: float | None = None
        self.exited_at: float | None = None
        self.last_migration: float | None = None
        # a signal said to stop while no command ran: set by the handler
        self.stopped = threading.Event()
        # wakes the main thread while GPUs are taken for it
        self._wake = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        # the lease's thread against close(); never taken by the handler
        self._wake_lock = threading.Lock()
        self.stopped_by: int = signal.SIGTERM
        # a signal said to stop: once the command exits, the job ends
        self.user_stop = False
        # --time ran out: the command was stopped, the job ends with TIMED_OUT
        self.timed_out = False
        self._limit_timer: threading.Timer | None = None
        self.writer = RecordWriter(self.store, JobRecord(
            job=self.job_id, pid=os.getpid(), user=current_user(), command=command,
            priority=self.spec.priority, preemptible=self.spec.preemptible, pausable=self.spec.pausable,
            state="queued", started=time.time(), host=host, time_limit=self.spec.time_limit))
        self.private = Path(private_dir(self.job_id))
        self.job_file = self.private / "gpus.json"
        self.server = control.ControlServer(self.store, self.job_id, self.dispatch)

    # -- the protocol file ----------------------------------------------------------------------------
    def _holding(self) -> str:
        """What the job holds, as a person reads it: ``GPU 3``, ``GPUs 0,3``, ``no GPU``."""
        shown = self.cuda_visible()
        if not shown:
            return "no GPU"
        return f"GPU{'s' if len(self.devs) > 1 else ''} {shown}"

    def cuda_visible(self) -> str:
        """The job's devices as its vendor's variable lists them (``CUDA_VISIBLE_DEVICES`` on NVIDIA,
        ``ROCR_VISIBLE_DEVICES`` on AMD, ``ZE_AFFINITY_MASK`` on Intel)."""
        from ..inventory.vendors import DEVICE_VARIABLE, counts_cuda_visible

        if all(counts_cuda_visible(d.gpu.vendor) for d in self.devs):
            if self.spec.use_uuid or any(d.mig is not None for d in self.devs):
                return ",".join(d.uuid for d in self.devs)
            return ",".join(str(d.gpu.device_index) for d in self.devs)
        env = self.visible_env()
        return ",".join(env[v] for v in DEVICE_VARIABLE.values() if env.get(v))

    def visible_env(self) -> dict[str, str]:
        from ..inventory.vendors import Visible, visible_env

        return visible_env([Visible.of(d.gpu, d.uuid, d.mig is not None) for d in self.devs],
                           use_uuid=self.spec.use_uuid)

    def write_job_file(self, state: str, reason: str | None = None, record: bool = True) -> None:
        """Rewrite the job file (the protocol), then the job's record with the same state (``record``
        False: the record's fields only, written by the next write: the command's start)."""
        self.generation += 1
        epochs = self.lease.epochs() if self.lease is not None else {}
        d = {"format": FILE_FORMAT, "job": self.job_id, "generation": self.generation, "state": state,
             "reason": reason, "restarts": self.restarts, "cuda_visible_devices": self.cuda_visible(),
             # the vendor's variables (additive)
             "env": self.visible_env(),
             "devices": [{"index": x.gpu.index, "uuid": x.uuid, "label": x.label,
                          **({"epoch": epochs[x.uuid]} if x.uuid in epochs else {})} for x in self.devs]}
        # 0.4, additive: the fencing tokens (gpusd.alloc.epoch); the job's is the largest
        if epochs:
            d["epoch"] = max(epochs.values())
        from ..alloc.lockdir import replace_file

        replace_file(self.job_file, self.private / f".gpus.{self.generation}.tmp", json.dumps(d).encode())
        (self.writer.write if record else self.writer.update)(
            devices=[x.uuid for x in self.devs], indices=[x.gpu.index for x in self.devs],
            state=state if state != "stopping" else self.writer.record.state, reason=reason, restarts=self.restarts)

    def notify(self) -> str:
        """Send the notify signal to the command, but only if it catches it (:meth:`Child.notify`)."""
        return self.child.notify(self.spec.notify_signal)

    # -- leases -------------------------------------------------------------------------------------
    def _take(self, sel: Selection) -> None:
        """The lease is the job's; its record says so when the command starts (one write at the
        hand-over, not three: each wakes every process watching the lock directory)."""
        # (if the queue never asked: a job never runs holding a start slot)
        gate.leave()
        self.lease = sel.lease
        self.devs = list(sel.devices)
        self.writer.update(lease=sel.lease.lease_id if sel.lease is not None else None)
        self._start_limit()

    # -- the time limit (--time) ----------------------------------------------------------------------
    def _start_limit(self) -> None:
        """The limit runs from the job's first GPUs on, on the monotonic clock (a wall-clock step neither
        shortens nor lengthens it); a restart or a preemption does not reset it."""
        limit = self.spec.time_limit
        if limit is None or self._limit_timer is not None:
            return
        # for display only (gpusd jobs: the time left)
        self.writer.update(ends=time.time() + limit)
        timer = threading.Timer(limit, self._time_up)
        timer.daemon = True
        timer.name = f"gpusd-job-{self.job_id}-time"
        self._limit_timer = timer
        timer.start()

    def _time_up(self) -> None:
        """``--time`` ran out: SIGTERM to the command's group, SIGKILL after ``--grace``; the job then
        ends (no restart) with :data:`TIMED_OUT`.  A job waiting for GPUs again stops waiting."""
        with self.lock:
            if self.state.now is JobState.ENDED:
                return
            self.timed_out = True
            self.user_stop = True
            limit = self.spec.time_limit or 0.0
            from ..units import format_duration

            self.writer.write(reason=f"time limit reached (--time {format_duration(limit)})")
            running = self.child.stop(self.spec.grace)
            if not running:
                self.stopped_by = signal.SIGTERM
                self.stopped.set()
                self._poke()
        log(f"job {self.job_id}: its time limit ({limit:g}s) ran out: SIGTERM, {self.spec.grace:g}s, then SIGKILL")

    def _allocate(self, c: Constraints, wait: bool, timeout: float | None, first: bool = False,
                  resume: bool = False, cancelled: Callable[[], bool] | None = None,
                  queued: Callable[[], object] | None = None) -> Selection:
        """A job's first lease goes through the daemon where it is the lease authority, except for a
        ``--preemptible`` job, whose supervisor must hold the lock descriptors to move it; GPUs added
        later (grow, move) join a lock-directory lease, so they are taken there too.  A waiting job
        of priority above ``low`` preempts when it reaches the head of the queue and nothing qualifies."""
        local = not first or self.spec.preemptible
        preempts = first and self.spec.priority > PRIORITIES["low"]
        blocked = (lambda: self.preempt_when_blocked(c.count)) if preempts else None
        then = queued
        # the start slot (gpusd.alloc.startgate) goes back once we are queued
        if gate.held():
            if not local and self._through_daemon():
                # the daemon queues us: nothing of the start-up is left here
                gate.leave()
            else:
                # our ticket is in the queue
                def then() -> None:
                    gate.leave()
                    if queued is not None:
                        queued()
        req = LeaseRequest(c, wait=wait, timeout=timeout, simulate=self.spec.simulate, holder=self.holder,
                           priority=self.spec.priority, resume=resume, when_blocked=blocked, cancelled=cancelled,
                           queued=then)
        return allocate(req, store=self.store if local else None,
                        backend=shared_backend(self.spec.simulate) if local else None)

    def acquire(self, wait: bool, timeout: float | None) -> None:
        """The job's GPUs: at once; with ``wait`` through the queue, where it asks lower-priority jobs
        to make room once it is at the head and nothing qualifies."""
        if wait and self.spec.priority > PRIORITIES["low"] and not self.spec.preemptible and self._through_daemon():
            # The daemon queues for us and cannot preempt our jobs: ask for room first when nothing
            # qualifies and nobody of our class or above is queued.
            # nothing of the start-up is left here (asking victims may take long)
            gate.leave()
            from ..alloc import queue
            from ..alloc.policy import load_priority_policy

            believed = load_priority_policy().believed(self.spec.priority, os.geteuid())
            if not queue.ahead_of_newcomer(self.store, believed):
                # would anything qualify now? (a choice only, no lease: the daemon's, its GPUs may be simulated)
                try:
                    allocate(LeaseRequest(self.spec.c, lease=False))
                except NoGpuAvailable:
                    self.preempt_for(self.spec.c.count)
        self._take(self._until_stopped(lambda: self._allocate(self.spec.c, wait, timeout if wait else None, first=True,
                                                              cancelled=self.stopped.is_set)))

    def _until_stopped(self, take: Callable[[], Selection]) -> Selection:
        """``take()`` in a thread of its own, so that a signal ends the wait for GPUs (the handler sets
        :attr:`stopped`; :class:`Stopped` then).  A lease that comes after we stopped waiting is
        released; a wait in the lock directory sees ``stopped`` itself and ends."""
        if self.stopped.is_set():
            raise Stopped(self.stopped_by)
        done = threading.Event()
        box: dict[str, Any] = {}
        gate = threading.Lock()

        def work() -> None:
            try:
                sel = take()
            except BaseException as exc:
                box["error"] = exc
            else:
                with gate:
                    if box.get("abandoned"):
                        sel.release()
                    else:
                        box["selection"] = sel
            finally:
                done.set()
                self._poke()

        threading.Thread(target=work, daemon=True, name=f"gpusd-job-{self.job_id}-lease").start()
        # Asleep until the lease comes or a signal says stop (both write to the wake pipe): a queued job
        # costs no CPU while it waits.  The kernel may hand a signal to any thread, and then the main
        # thread's sleep is not interrupted: the wake pipe is also the interpreter's wakeup fd, which
        # its C handler writes to whichever thread runs it (STOP_POLL: in case a wake-up is missed).
        try:
            previous: int | None = signal.set_wakeup_fd(self._wake[1], warn_on_full_buffer=False)
        except ValueError:
            # not the main thread (a test): the handler's own write still wakes us
            previous = None
        try:
            while not done.is_set():
                self._sleep(STOP_POLL)
                if self.stopped.is_set():
                    with gate:
                        if "selection" not in box:
                            box["abandoned"] = True
                            raise Stopped(self.stopped_by)
        finally:
            if previous is not None:
                signal.set_wakeup_fd(previous)
        if "error" in box:
            if self.stopped.is_set():
                # the wait ended because we stopped it
                raise Stopped(self.stopped_by)
            raise box["error"]
        selection: Selection = box["selection"]
        return selection

    def _requeue(self) -> None:
        """A preempted job's wait for GPUs again.  Its GPUs go back once its ticket is in the queue, not
        before: the job that preempted it takes them, and it is next in its class, ahead of the jobs
        that queued while it ran (docs/jobs.md, "Fairness"); with the GPUs given back first, a job
        queued behind it could take them before its ticket is in."""
        # against a grow or shrink on the control socket meanwhile
        with self.lock:
            assert self.lease is not None
            held = self.lease
            self.devs = []
            self.restarts += 1
            self.writer.write(state="preempted", devices=[], indices=[], restarts=self.restarts)

        def give_back() -> None:
            with self.lock:
                # the GPUs given back while it ran too (a second call: nothing)
                held.release()

        try:
            sel = self._until_stopped(lambda: self._allocate(
                self.spec.c, True, None, first=True, resume=True, cancelled=self.stopped.is_set, queued=give_back))
        finally:
            # where the queue never took our ticket (an error, a stop)
            give_back()
        self._take(sel)

    def _poke(self) -> None:
        """Wake the main thread from :meth:`_sleep` (the lease's thread, when its wait ended; the signal
        handler writes to the pipe itself, without the lock, which the main thread may hold)."""
        with self._wake_lock:
            _nudge(self._wake[1])

    def _sleep(self, timeout: float) -> None:
        """Until :meth:`_poke` (or ``timeout``); the pending wake-ups are read."""
        import select

        fd = self._wake[0]
        if fd < 0:
            time.sleep(timeout)
            return
        if select.select([fd], [], [], timeout)[0]:
            try:
                os.read(fd, 512)
            except OSError:
                pass

    def _through_daemon(self) -> bool:
        """Whether the first lease would be asked of a daemon (the lease authority)."""
        from ..alloc import authority

        path = authority.socket_path()
        return (self.spec.simulate is None and not os.environ.get("GPUSD_SIMULATE") and path is not None
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
                # still stopping (or refused to): their GPUs are not free yet
                return
        self.asked_at = now
        self.asked = self.preempt_for(count)

    def preempt_for(self, count: int) -> list[str]:
        """Ask preemptible jobs of lower priority (our own user's, or anyone's when we are root) to
        stop until ``count`` GPUs are freed.  The victims decide too (docs/jobs.md)."""
        me = os.geteuid()
        victims = [r for r in list_jobs(self.store) if r.preemptible and r.priority < self.spec.priority
                   and r.state == "running" and r.job != self.job_id and (me == 0 or r.uid == me)]
        victims.sort(key=lambda r: (r.priority, -(r.started or 0.0)))
        asked: list[str] = []
        freed = 0
        for v in victims:
            if freed >= count:
                break
            try:
                answer = control.request(v.job, v.uid, {"op": "preempt", "by": self.job_id,
                                                         "priority": self.spec.priority}, store=self.store)
            except GpusdError as exc:
                log(f"job {self.job_id}: could not preempt job {v.job}: {exc}")
                continue
            if answer.get("ok"):
                freed += len(v.devices)
                asked.append(v.job)
                log(f"job {self.job_id} (priority {priority_name(self.spec.priority)}) preempted job {v.job} "
                    f"(priority {priority_name(v.priority)}) for {count} GPU(s)")
        return asked

    def _preempted(self) -> bool:
        """Whether the job is preempted (stopping for it, or waiting for GPUs again after it)."""
        return self.state.now is JobState.PREEMPTED

    def _local(self) -> Lease | None:
        """The job's lease when it is held here (in the lock directory) and still is."""
        lease = self.lease
        return lease if isinstance(lease, Lease) and not lease.released else None

    def grow(self, n: int, wait: bool, timeout: float | None,
             cancelled: Callable[[], bool] | None = None) -> dict[str, Any]:
        """``n`` more GPUs; ``cancelled`` says the asker went away (a wait then ends)."""
        if isinstance(self.lease, RemoteLease):
            return self._grow_remote(self.lease, n, wait, timeout)
        with self.lock:
            if self._local() is None or self._preempted():
                return {"ok": False, "message": f"job {self.job_id} holds no lease now (it is preempted or "
                        "waiting): grow it once it runs"}
        c = replace(self.spec.c, count=n)
        try:
            sel = self._allocate(c, wait, timeout, cancelled=cancelled)
        except GpusdError as exc:
            return _refusal(exc)
        extra = sel.lease
        assert isinstance(extra, Lease)
        with self.lock:
            lease = self._local()
            if lease is None or self._preempted():
                # preempted while we waited: the GPUs are not the job's to keep
                extra.release()
                return {"ok": False, "message": f"job {self.job_id} was preempted meanwhile: not grown"}
            try:
                # the devices are ours now; its record goes
                lease.join(extra)
            except GpusdError as exc:
                extra.release()
                return {"ok": False, "message": str(exc)}
            self.devs.extend(sel.devices)
            self.write_job_file("running", f"grown by {n} GPU(s)" + self._restart_note())
            told = self._tell()
        log(f"job {self.job_id}: grown to {self.cuda_visible()}" + self._restart_note())
        return {"ok": True, "devices": self.cuda_visible(), "message": told}

    def _grow_remote(self, lease: RemoteLease, n: int, wait: bool, timeout: float | None) -> dict[str, Any]:
        """Grow a lease the daemon holds: it takes the GPUs (same constraints, same queue) and names
        them in the job's lease record; it holds their descriptors (and passes us copies, kept by the
        lease), so nothing is handed to the running command."""
        try:
            added = lease.grow(replace(self.spec.c, count=n), wait=wait, timeout=timeout)
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
        """Shrink a lease the daemon holds: the daemon frees each GPU at once (it unlocks the open
        file that its descriptor and every copy of it share, the command's included)."""
        with self.lock:
            drop = self._to_drop(n, release)
        if isinstance(drop, str):
            return {"ok": False, "message": drop}
        done: list[Candidate] = []
        failed = None
        for d in drop:
            try:
                lease.give_back(d.uuid)
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
        msg = f"job {self.job_id} now holds {self._holding()}"
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
            lease = self.lease
            later = []
            for d in drop:
                # a GPU the running command inherited stays locked by its copy: recorded until it exits
                linger = d.uuid in self.inherited
                lease.give_back(d.uuid, linger=linger)
                self.devs.remove(d)
                if linger:
                    later.append(d.label)
            self.write_job_file("running", f"shrunk by {len(drop)} GPU(s)" + self._restart_note())
            told = self._tell()
        msg = f"job {self.job_id} now holds {self._holding()}"
        if later:
            msg += f"; GPU {','.join(later)} is freed when the running command exits or restarts"
        log(msg + self._restart_note())
        msg = f"{msg}; {told}"
        return {"ok": True, "devices": self.cuda_visible(), "message": msg}

    def _restart_note(self) -> str:
        return "; the command restarts (--on-change restart)" if self.spec.on_change == "restart" else ""

    def _tell(self) -> str:
        """Tell the command its GPUs changed (grow, shrink), as ``--on-change`` says: the notify
        signal (only to a command that catches it); or a restart like a move's (SIGTERM to its group,
        --grace, SIGKILL; started again at once on the job's GPUs then, same lease); or nothing (it
        polls the job file).  Says how it was told."""
        if self.spec.on_change == "signal":
            return self.notify()
        if self.spec.on_change == "restart":
            # a stop under way starts it on the GPUs now
            if not self.state.restarting:
                self._stop_child(JobState.STOPPING)
            return "the command restarts on its GPUs now (--on-change restart)"
        return "not signalled (--on-change file): the command sees the change in $GPUSD_JOB_FILE"

    def _stop_child(self, why: JobState) -> None:
        """Stop the running command to start it again (``why``: preempted, moving, stopping)."""
        with self.lock:
            if self.child.running:
                self.state.to(why)
                self.child.stop(self.spec.grace)

    def preempt(self, by: str, priority: int) -> dict[str, Any]:
        with self.lock:
            if not self.spec.preemptible:
                return {"ok": False, "message": f"job {self.job_id} is not preemptible"}
            if priority <= self.spec.priority:
                return {"ok": False, "message": "only a job of higher priority may preempt this one"}
            now = time.time()
            self.preemptions = [t for t in self.preemptions if now - t < 3600]
            if len(self.preemptions) >= MAX_PREEMPTIONS_PER_HOUR:
                return {"ok": False, "message": f"job {self.job_id} was preempted {len(self.preemptions)} times in "
                        "the last hour: not again before it has run (docs/jobs.md, fairness)"}
            if self.state.restarting or not self.child.running:
                return {"ok": False, "message": f"job {self.job_id} is not running"}
            self.preemptions.append(now)
            self.write_job_file("preempted", f"preempted by job {by} (priority {priority_name(priority)})")
            self._stop_child(JobState.PREEMPTED)
        log(f"job {self.job_id}: preempted by job {by}; SIGTERM, {self.spec.grace:g}s to checkpoint")
        return {"ok": True, "message": f"job {self.job_id} stops within {self.spec.grace:g}s"}

    def move(self, avoid: Sequence[str], reason: str) -> dict[str, Any]:
        if not isinstance(self.lease, Lease):
            return {"ok": False, "message": "this job's lease is held by the daemon"}
        with self.lock:
            if not self.spec.preemptible:
                return {"ok": False, "message": f"job {self.job_id} is not preemptible: it is not moved"}
            hot = [d for d in self.devs if d.uuid in avoid]
            if not hot or self.state.restarting or not self.child.running:
                return {"ok": False, "message": "nothing to move"}
        self.decided_at = decided = time.monotonic()
        c = replace(self.spec.c, count=len(hot), exclude=[*(self.spec.c.exclude or []), *avoid])
        try:
            sel = self._allocate(c, False, None)
        except GpusdError as exc:
            return {"ok": False, "message": str(exc)}
        extra = sel.lease
        assert isinstance(extra, Lease)
        with self.lock:
            lease = self._local()
            if lease is None:
                extra.release()
                return {"ok": False, "message": f"job {self.job_id} holds no lease now"}
            new = dict(zip((d.uuid for d in hot), sel.devices))
            note = self._migrate_cuda({u: new[u].uuid if u in new else u for u in sorted(self.inherited)}, list(new))
            try:
                lease.join(extra)
            except GpusdError as exc:
                extra.release()
                return {"ok": False, "message": str(exc)}
            # in place: the process's CUDA device k is the job file's device k
            for d in hot:
                self.devs[self.devs.index(d)] = new[d.uuid]
                # the command runs on the new GPU now: the old one is free
                if note is None:
                    lease.give_back(d.uuid, unlock=True)
                    self.inherited.discard(d.uuid)
                    # in use by the command: a shrink keeps it locked
                    self.inherited.add(new[d.uuid].uuid)
                else:
                    # the command still holds it until it restarts
                    lease.give_back(d.uuid, linger=True)
            if note is None:
                self.last_migration, self.decided_at = time.monotonic() - decided, None
                msg = f"moved to GPU {self.cuda_visible()} by cuda-checkpoint, without a restart"
                self.write_job_file("running", f"{reason}; {msg}")
                self.notify()
            else:
                msg = f"moving to GPU {self.cuda_visible()} with the job protocol (SIGTERM, restart)"
                msg += f": {note}" if self.spec.cuda_checkpoint is not None else ""
                self.write_job_file("moving", f"{reason}; {msg}")
                self._stop_child(JobState.MOVING)
        log(f"job {self.job_id}: {msg}: {reason}")
        return {"ok": True, "devices": self.cuda_visible(), "message": msg}

    def _migrate_cuda(self, mapping: dict[str, str], hot: list[str]) -> str | None:
        """Move the command's CUDA state with cuda-checkpoint (``--cuda-checkpoint``, docs/jobs.md):
        ``mapping`` names each GPU the command started with (old UUID -> new UUID).  None when done,
        else why not (the caller then uses the job protocol)."""
        if self.spec.cuda_checkpoint is None:
            return "no cuda-checkpoint (gpusd run --cuda-checkpoint)"
        proc = self.child.proc
        if proc is None or proc.poll() is not None:
            return "the command is not running"
        if not set(hot) <= set(mapping):
            return "cuda-checkpoint not used: the command was not started on the GPU moved"
        from .checkpoint import CheckpointFailed

        try:
            pids = self.spec.cuda_checkpoint.migrate(proc.pid, mapping)
        except CheckpointFailed as exc:
            return f"cuda-checkpoint failed: {exc}"
        log(f"job {self.job_id}: cuda-checkpoint moved the CUDA state of process(es) {pids}")
        return None

    def pause(self, on: bool, reason: str) -> dict[str, Any]:
        with self.lock:
            if not self.spec.pausable:
                return {"ok": False, "message": f"job {self.job_id} is not pausable"}
            if not self.child.running:
                return {"ok": False, "message": "not running"}
            self.child.signal(signal.SIGSTOP if on else signal.SIGCONT)
            # not while it is being stopped
            if self.state.now in (JobState.RUNNING, JobState.PAUSED):
                self.state.to(JobState.PAUSED if on else JobState.RUNNING)
            self.writer.write(state="paused" if on else "running", reason=reason)
        log(f"job {self.job_id}: {'paused' if on else 'resumed'}: {reason}")
        return {"ok": True}

    # -- the control socket's requests ----------------------------------------------------------------
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
            from ..alloc.policy import load_priority_policy

            prio = load_priority_policy().believed(prio, os.geteuid() if uid is None else uid)  # the policy's bound
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
    def start_child(self) -> None:
        from ..alloc.cpus import preexec
        from ..inventory.vendors import Visible, job_environ

        env = job_environ(os.environ, [Visible.of(d.gpu, d.uuid, d.mig is not None) for d in self.devs],
                          use_uuid=self.spec.use_uuid)
        env.update({"GPUSD_JOB_ID": self.job_id, "GPUSD_JOB_FILE": str(self.job_file),
                    "GPUSD_NOTIFY_SIGNAL": signal.Signals(self.spec.notify_signal).name,
                    "GPUSD_RESTART_COUNT": str(self.restarts), "GPUSD_RESTART_STATUS": str(RESTART_ME),
                    "GPUSD_GPU_COUNT": str(len(self.devs))})
        # never an outer job's token
        env.pop("GPUSD_LEASE_EPOCH", None)
        if self.lease is not None:
            env["GPUSD_LEASE"] = self.lease.lease_id
            if self.lease.epoch is not None:
                env["GPUSD_LEASE_EPOCH"] = str(self.lease.epoch)
        fds = list(self.lease.fds) if self.lease is not None else []
        own_group = self.spec.own_group
        cpus = None
        # at every start: a grow, shrink or move changes the GPUs
        if self.spec.bind_cpus:
            from ..alloc.cpus import binding

            cpus, said = binding([d.gpu for d in self.devs])
            log(said)
        cmd = list(self.spec.cmd)
        if self.spec.container is not None:
            cmd, extra = self._container_command()
            env.update(extra)
        proc = self.child.start(cmd, env, fds, own_group, preexec(cpus, own_group and not GROUP_AT_SPAWN))
        if self.spec.container is not None and self.spec.container.daemon:
            self.cid_watch = threading.Thread(target=self._watch_cid, args=(proc,), daemon=True,
                                              name=f"{self.job_id} container id")
            self.cid_watch.start()
        lease = self._local()
        self.inherited = set(lease.devices) if lease is not None else set()
        self.writer.write(child=proc.pid)

    # -- containers (gpusd.jobs.containers) -------------------------------------------------------------
    def _cidfile(self) -> str:
        return str(self.private / f"cid.{self.restarts}.{self.generation}")

    def _container_command(self) -> tuple[list[str], dict[str, str]]:
        from .containers import Leased

        run = self.spec.container
        assert run is not None
        leased = [Leased(d.gpu.vendor, d.gpu.device_index, d.uuid, d.gpu.pci_bus_id, d.mig is not None)
                  for d in self.devs]
        labels = {"gpusd.job": self.job_id, **({"gpusd.lease": self.lease.lease_id} if self.lease else {})}
        return run.command(leased, self._cidfile(), labels)

    def _watch_cid(self, proc: Any) -> None:
        """Wait (while the runtime's client runs, and once after) for the container's id, then start its
        holder (:func:`gpusd.jobs.containers.start_holder`) and record the id."""
        from .containers import read_cid, start_holder

        run = self.spec.container
        assert run is not None
        path = run.user_cidfile or self._cidfile()
        # the id comes within moments of the start, or (a runtime that never writes it) not at all
        delay = 0.02
        while True:
            done = proc.poll() is not None
            cid = read_cid(path)
            if cid is not None or done:
                break
            time.sleep(delay)
            delay = min(1.0, delay * 1.5)
        if cid is None:
            return
        with self.lock:
            fds = list(self.lease.fds) if self.lease is not None else []
            self.holder_out = str(self.private / f"wait.{cid[:12]}")
            try:
                self.holder_proc = start_holder(run, cid, fds, self.holder_out)
            except OSError as exc:
                log(f"job {self.job_id}: cannot start {run.runtime} wait {cid[:12]}: {exc}; the lease ends with "
                    f"the client, not with the container")
            self.writer.write(container=cid)

    def _follow_container(self, rc: int) -> int:
        """After the runtime's client exited: wait for the container (its holder), stopping it when a
        signal asked ``gpusd run`` to stop; the container's exit status for a followed ``-d`` run."""
        run = self.spec.container
        if run is None or not run.daemon:
            return rc
        if self.cid_watch is not None:
            self.cid_watch.join()
        holder, self.holder_proc = self.holder_proc, None
        if holder is None:
            return rc
        # here: a job waiting for GPUs needs none (tests/jobs/test_waiting_imports.py)
        import subprocess

        from .containers import exit_status

        cid = self.writer.record.container or ""
        asked = False
        while True:
            try:
                holder.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                pass
            # a stop, a preemption or a move: the container goes too (the client's end does not end it)
            if (self.user_stop or self.stopped.is_set() or self.state.restarting) and not asked:
                asked = True
                log(f"job {self.job_id}: stopping container {cid[:12]}")
                try:
                    subprocess.run(run.stop_command(cid, self.spec.grace), stdin=subprocess.DEVNULL,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   timeout=self.spec.grace + 30)
                except (OSError, subprocess.TimeoutExpired) as exc:
                    log(f"job {self.job_id}: {run.runtime} stop {cid[:12]}: {exc}")
        if self.stopped.is_set():
            self.stopped.clear()
            self.user_stop = True
        status = exit_status(self.holder_out)
        return status if run.detached and status is not None and rc == 0 else rc

    def _on_signal(self, interactive: bool) -> Callable[[int, object], None]:
        """The handler of the signals ``gpusd run`` forwards: it passes them on to the command and
        notes a stop (:attr:`user_stop`; :attr:`stopped` when no command runs to end), nothing more."""
        def forward(signum: int, _frame: object) -> None:
            if signum in (signal.SIGINT, signal.SIGQUIT) and interactive:
                self.user_stop = True
                # the terminal sent it to the whole foreground group, the command included
                return
            if signum != signal.SIGUSR1:
                self.user_stop = True
            if self.child.running:
                self.child.signal(signum)
            elif signum != signal.SIGUSR1:
                # queued or preempted, no command running: stop waiting
                self.stopped_by = signum
                self.stopped.set()
                # not _poke: the handler must never wait for a lock (the main thread's own)
                _nudge(self._wake[1])

        return forward

    def run(self) -> int:
        self.server.start()
        from ..alloc.runner import _interactive

        interactive = _interactive() and not self.spec.own_group
        handler = self._on_signal(interactive)
        previous = {sig: signal.signal(sig, handler) for sig in FORWARDED}
        rc = 0
        try:
            self.acquire(self.spec.wait, self.spec.timeout)
            while True:
                with self.lock:
                    # a signal while no command ran (between two starts)
                    if self.stopped.is_set():
                        raise Stopped(self.stopped_by)
                    lease = self._local()
                    if lease is not None:
                        # the GPUs given back while the last command ran are freed now
                        lease.settle()
                    self.state.to(JobState.RUNNING)
                    # start_child writes it
                    self.write_job_file("running", self.writer.record.reason, record=False)
                    try:
                        self.start_child()
                    except (FileNotFoundError, PermissionError) as exc:
                        failed, told = exec_failure(exc, self.spec.cmd[0])
                        log(told)
                        return failed
                    if self.exited_at is not None and self.decided_at is not None:
                        self.last_migration = time.monotonic() - self.exited_at
                        self.writer.write(reason=f"{self.writer.record.reason} (restarted in "
                                          f"{self.last_migration * 1000:.0f} ms)")
                        log(f"job {self.job_id}: running on GPU {self.cuda_visible()} (restarted in "
                            f"{self.last_migration * 1000:.0f} ms after the command exited)")
                    self.decided_at = self.exited_at = None
                rc = self._follow_container(self.child.wait())
                with self.lock:
                    why = self.state.now if self.state.restarting else None
                if why is not None or rc == RESTART_ME or self.timed_out:
                    # the leader is gone; what is left of its group (children that ignore SIGTERM)
                    # gets the rest of the grace, then SIGKILL, before its GPUs are reused
                    deadline = self.child.stop_deadline if why is not None or self.timed_out else None
                    self.child.end_group(deadline if deadline is not None else time.monotonic() + self.spec.grace)
                self.exited_at = time.monotonic()
                # the signal came after the command had exited
                if self.stopped.is_set():
                    raise Stopped(self.stopped_by)
                if self.user_stop:
                    break
                if why is JobState.PREEMPTED:
                    self._requeue()
                    continue
                if why is not None or rc == RESTART_ME:
                    self.restarts += 1
                    continue
                break
        except Stopped as exc:
            if not self.timed_out:
                log(f"job {self.job_id}: stopped by {signal.Signals(exc.signum).name} while waiting for GPUs")
            rc = -exc.signum
        finally:
            # against the time limit's thread
            with self.lock:
                if self.state.now is not JobState.ENDED:
                    self.state.to(JobState.ENDED)
            if self.timed_out:
                self._tell_timed_out()
            for sig, old in previous.items():
                signal.signal(sig, old)
            self.close()
        if self.timed_out:
            return TIMED_OUT
        return rc if rc >= 0 else 128 - rc

    def _tell_timed_out(self) -> None:
        """The history (the daemon's, where it holds the lease) records the job as timed out."""
        lease = self.lease
        if isinstance(lease, RemoteLease):
            try:
                lease.mark("timed_out")
            except GpusdError as exc:
                log(f"job {self.job_id}: the daemon could not record the time-out: {exc}")

    def close(self) -> None:
        timer = self._limit_timer
        if timer is not None:
            timer.cancel()
        with self._wake_lock:
            wake, self._wake = self._wake, (-1, -1)
        for fd in wake:
            if fd >= 0:
                os.close(fd)
        self.server.close()
        if self.lease is not None:
            self.lease.release()
        self.child.close()
        self.writer.close()
        remove_private_dir(self.private)


def _refusal(exc: GpusdError) -> dict[str, Any]:
    """The control socket's answer to a grow that got no GPUs (docs/errors.md)."""
    return to_wire(exc)
