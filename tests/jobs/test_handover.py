"""A job's hand-over and its wait (issue 24, the makespan): what the supervisor does between its lease
and its command, and while it waits for GPUs.  Mechanisms only: the speed is bench_alloc's."""

from __future__ import annotations

import os
import signal
import sys
import threading

import pytest

from gpusd.alloc.select import Constraints


def _supervisor(**kw: object):
    from gpusd.jobs.supervisor import Supervisor

    return Supervisor(Constraints(count=1), kw.pop("cmd", ["true"]), command="true",  # type: ignore[arg-type]
                      simulate="1xA100-80GB", **kw)  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_a_stop_signal_ends_the_wait_for_gpus_at_once_without_polling(monkeypatch):
    """The main thread sleeps until the lease comes or a signal says stop (the handler wakes it):
    however long its safety poll, a SIGTERM while queued ends the wait."""
    from gpusd.jobs import supervisor as sv

    monkeypatch.setattr(sv, "STOP_POLL", 3600.0)  # no poll would notice in time: only the wake-up can
    sup = _supervisor()
    asked = threading.Event()

    def never() -> object:
        asked.set()
        threading.Event().wait()  # the lease never comes (a daemon thread, left behind)
        raise AssertionError

    def send() -> None:
        asked.wait(30)
        os.kill(os.getpid(), signal.SIGTERM)

    old = signal.signal(signal.SIGTERM, sup._on_signal(interactive=False))
    try:
        threading.Thread(target=send, daemon=True).start()
        with pytest.raises(sv.Stopped) as stopped:
            sup._until_stopped(never)  # type: ignore[arg-type]
        assert stopped.value.signum == signal.SIGTERM and asked.is_set()
    finally:
        signal.signal(signal.SIGTERM, old)
        sup.close()


def test_the_record_says_running_with_its_lease_and_command_in_one_write(monkeypatch):
    """At the hand-over the job's record goes from queued to running in one write that names the lease,
    the GPUs and the command's pid (each write wakes whoever watches the lock directory): a reader never
    sees a running job without its command."""
    sup = _supervisor()
    written: list[dict[str, object]] = []
    real = sup.writer.write

    def write(**changes: object) -> None:
        real(**changes)
        written.append(dict(sup.writer.record.to_dict()))

    monkeypatch.setattr(sup.writer, "write", write)
    try:
        assert sup.run() == 0
    finally:
        sup.close()
    running = [r for r in written if r["state"] == "running"]
    assert running, written
    first = running[0]
    assert first["lease"] and first["devices"] and first["indices"] == [0] and isinstance(first["child"], int)
    assert [r["state"] for r in written] == ["running"]  # queued -> running: one write, nothing before it


def test_a_command_in_its_own_group_leads_it():
    """A --preemptible/--pausable command leads a process group of its own (its pid), not the
    supervisor's; from Python 3.11 Popen makes it (process_group=0), so that no preexec_fn makes
    subprocess fork the whole supervisor instead of vfork()ing it, as the supervisor asks."""
    from gpusd.alloc.cpus import preexec
    from gpusd.jobs.child import GROUP_AT_SPAWN, Child

    fn = preexec(None, not GROUP_AT_SPAWN)  # what the supervisor passes for a command without --bind-cpus
    assert (fn is None) == GROUP_AT_SPAWN == (sys.version_info >= (3, 11))
    child = Child()
    r, w = os.pipe()
    proc = child.start([sys.executable, "-c", f"import os; os.write({w}, str(os.getpgid(0)).encode())"],
                       dict(os.environ), [w], True, fn)
    os.close(w)
    try:
        assert proc.wait(timeout=30) == 0
        assert int(os.read(r, 64)) == proc.pid != os.getpgid(0)
    finally:
        os.close(r)
        child.close()
