"""The states of a job's supervisor and the transitions between them (docs/jobs.md, "States").

One table (:data:`TRANSITIONS`) says which state may follow which; :meth:`JobStates.to` refuses any
other change with :class:`IllegalTransition`, a bug in the supervisor, never a user's error.  The
values are the record's ``state`` (:mod:`gpusd.jobs.record`) where one is written; ``stopping`` (a
restart on new GPUs or after ``--on-change restart``) and ``ended`` are the supervisor's alone.
"""

from __future__ import annotations

import enum
import threading


class JobState(enum.Enum):
    # no GPUs yet: waiting for them (or taking them)
    QUEUED = "queued"
    # the command runs on the job's GPUs
    RUNNING = "running"
    # the command is stopped (SIGSTOP), keeping its GPUs
    PAUSED = "paused"
    # the command is asked to stop to start again on the job's GPUs (--on-change restart)
    STOPPING = "stopping"
    # the command is asked to stop to start again on other GPUs (a move)
    MOVING = "moving"
    # asked to stop for a job of higher priority; then waiting for GPUs again
    PREEMPTED = "preempted"
    # the supervisor is done (the command exited, or it stopped while waiting)
    ENDED = "ended"


S = JobState
# state -> the states that may follow it (each one a reason: see docs/jobs.md)
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    S.QUEUED: frozenset({S.RUNNING, S.ENDED}),
    # RUNNING -> RUNNING: the command asked to be restarted (exit status 75), or moved without a restart
    S.RUNNING: frozenset({S.RUNNING, S.PAUSED, S.STOPPING, S.MOVING, S.PREEMPTED, S.ENDED}),
    S.PAUSED: frozenset({S.PAUSED, S.RUNNING, S.STOPPING, S.MOVING, S.PREEMPTED, S.ENDED}),
    # started again (or a user's stop came meanwhile)
    S.STOPPING: frozenset({S.RUNNING, S.ENDED}),
    S.MOVING: frozenset({S.RUNNING, S.ENDED}),
    # GPUs again (waiting in the queue), or stopped waiting
    S.PREEMPTED: frozenset({S.RUNNING, S.ENDED}),
    S.ENDED: frozenset(),
}
# the states in which the command is being stopped by the supervisor (it is started again after)
RESTARTING = frozenset({S.STOPPING, S.MOVING, S.PREEMPTED})


class IllegalTransition(RuntimeError):
    """A change of state the table does not allow: a bug in the supervisor."""


class JobStates:
    """The current state of one job, changed only along :data:`TRANSITIONS` (thread-safe)."""

    def __init__(self, start: JobState = JobState.QUEUED) -> None:
        self._now = start
        self._lock = threading.Lock()

    @property
    def now(self) -> JobState:
        return self._now

    def to(self, new: JobState) -> JobState:
        """Change to ``new``; the state before.  :class:`IllegalTransition` when the table forbids it."""
        with self._lock:
            old = self._now
            if new not in TRANSITIONS[old]:
                raise IllegalTransition(f"a job cannot go from {old.value} to {new.value}")
            self._now = new
            return old

    @property
    def restarting(self) -> bool:
        """Whether the supervisor is stopping the command to start it again."""
        return self._now in RESTARTING
