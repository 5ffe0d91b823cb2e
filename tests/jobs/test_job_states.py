"""The supervisor's state machine (gpusd.jobs.state): each transition of the table is allowed, every
other one is a bug that raises."""

from __future__ import annotations

import itertools

import pytest

from gpusd.jobs.state import RESTARTING, TRANSITIONS, IllegalTransition, JobState, JobStates

LEGAL = sorted(((a, b) for a, targets in TRANSITIONS.items() for b in targets), key=lambda t: (t[0].value, t[1].value))
ILLEGAL = sorted((pair for pair in itertools.product(JobState, JobState) if pair[1] not in TRANSITIONS[pair[0]]),
                 key=lambda t: (t[0].value, t[1].value))


def test_the_table_names_every_state():
    assert set(TRANSITIONS) == set(JobState)
    # every state but the end can end, and every state can be reached from where a job starts
    assert all(JobState.ENDED in TRANSITIONS[s] for s in JobState if s is not JobState.ENDED)
    reached, todo = {JobState.QUEUED}, [JobState.QUEUED]
    while todo:
        for nxt in TRANSITIONS[todo.pop()] - reached:
            reached.add(nxt)
            todo.append(nxt)
    assert reached == set(JobState)


@pytest.mark.parametrize(("old", "new"), LEGAL, ids=[f"{a.value}->{b.value}" for a, b in LEGAL])
def test_each_legal_transition_is_taken(old, new):
    states = JobStates(old)
    assert states.to(new) is old
    assert states.now is new
    assert states.restarting == (new in RESTARTING)


@pytest.mark.parametrize(("old", "new"), ILLEGAL, ids=[f"{a.value}->{b.value}" for a, b in ILLEGAL])
def test_each_illegal_transition_raises_and_changes_nothing(old, new):
    states = JobStates(old)
    with pytest.raises(IllegalTransition, match=f"from {old.value} to {new.value}"):
        states.to(new)
    assert states.now is old


def test_a_job_stopped_for_a_restart_cannot_be_stopped_again_before_it_runs():
    """What the supervisor's checks rely on: a second preemption, move or --on-change restart of a
    command already being stopped is refused by the table as well."""
    for why in RESTARTING:
        states = JobStates(JobState.RUNNING)
        states.to(why)
        for again in RESTARTING:
            with pytest.raises(IllegalTransition):
                states.to(again)
        states.to(JobState.RUNNING)



def test_a_signal_while_no_command_runs_sets_the_stop_event_and_raises_nothing():
    """The handler of the signals gpusd run forwards only notes them: the main thread ends the wait."""
    import signal

    from gpusd.alloc.select import Constraints
    from gpusd.jobs.supervisor import Stopped, Supervisor

    sup = Supervisor(Constraints(count=1), ["true"], command="true", simulate="1xA100-80GB")
    try:
        handler = sup._on_signal(interactive=False)
        handler(signal.SIGUSR1, None)  # no command to pass it to: ignored
        assert not sup.stopped.is_set() and not sup.user_stop
        handler(signal.SIGHUP, None)  # returns: nothing is raised into whatever the main thread does
        assert sup.stopped.is_set() and sup.user_stop and sup.stopped_by == signal.SIGHUP
        with pytest.raises(Stopped):  # the main thread, waiting for GPUs, stops there
            sup._until_stopped(lambda: pytest.fail("no lease is asked for once stopped"))  # type: ignore[arg-type]
        assert sup.state.now is JobState.QUEUED
    finally:
        sup.close()


def test_the_job_spec_is_built_once_at_the_cli_edge_and_passed_whole() -> None:
    """``gpusd run``'s options become one JobSpec in cli.options; the supervisor takes it as it is."""
    from gpusd.cli import build_parser
    from gpusd.cli.options import job_spec
    from gpusd.jobs.supervisor import JobSpec, Supervisor

    args = build_parser("run").parse_args(["run", "-n", "2", "--priority", "low", "--preemptible", "--grace", "5",
                                           "--simulate", "2xA100-80GB", "--", "train.py"])
    spec = job_spec(args, ["train.py"], "train.py")
    assert isinstance(spec, JobSpec) and spec.c.count == 2 and spec.preemptible and spec.grace == 5
    sup = Supervisor(spec)
    try:
        assert sup.spec is spec and sup.writer.record.preemptible
    finally:
        sup.close()
