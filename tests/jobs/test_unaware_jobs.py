"""Issue 18, item 1: a job that does not catch the notify signal is never sent it (SIGUSR1's default action
would end it): ``gpusd grow``/``shrink`` only rewrite its job file, and say so (docs/jobs.md, "Grow and shrink")."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from conftest import gpusd_cli
from fakenvml import make_gpus
from jobs_helpers import GPUSD, job_env, jobs_json
from waiting import wait_until_sync

# Plain Python, no gpusd import, no signal handler: it polls $GPUSD_JOB_FILE and logs each GPU set it sees.
POLLER = r'''
import json, os, sys, time
out, stop = sys.argv[1], sys.argv[2]
last = None
while not os.path.exists(stop):
    try:
        gpus = json.load(open(os.environ["GPUSD_JOB_FILE"]))["cuda_visible_devices"]
    except (OSError, ValueError):
        gpus = None
    if gpus is not None and gpus != last:
        with open(out, "a") as f:
            f.write(gpus + "\n")
        last = gpus
    time.sleep(0.05)
'''


def _kill(p: subprocess.Popen[str]) -> None:
    if p.poll() is None:
        p.kill()
        p.wait()


def _seen(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def test_a_plain_python_job_that_polls_the_job_file_survives_grow_and_shrink(fake_nvml, cli_env, tmp_path):
    fake_nvml.write(make_gpus(4))
    script, out, stop = tmp_path / "job.py", tmp_path / "seen", tmp_path / "stop"
    script.write_text(POLLER)
    env = job_env(cli_env)
    p = subprocess.Popen([*GPUSD, "run", "-n", "1", "--", "python3", str(script), str(out), str(stop)], env=env,
                         text=True, stderr=subprocess.PIPE)
    try:
        wait_until_sync(lambda: _seen(out) == ["0"], timeout=30, what="the job's first GPU set")
        job = str(jobs_json(env)[0]["job"])
        r = gpusd_cli(["grow", job, "+2"], env=env)
        assert r.returncode == 0, r.stderr
        assert "does not catch SIGUSR1" in r.stdout and "GPUSD_JOB_FILE" in r.stdout, r.stdout
        wait_until_sync(lambda: _seen(out)[-1:] == ["0,1,2"], timeout=30, what="the grow in the job file")
        r = gpusd_cli(["shrink", job, "-1"], env=env)
        assert r.returncode == 0, r.stderr
        assert "does not catch SIGUSR1" in r.stdout, r.stdout
        wait_until_sync(lambda: _seen(out)[-1:] == ["0,1"], timeout=30, what="the shrink in the job file")
        assert _seen(out) == ["0", "0,1,2", "0,1"]
        stop.touch()
        assert p.wait(timeout=30) == 0  # it ended by itself; SIGUSR1 would have made it 138
        assert jobs_json(env) == []
    finally:
        _kill(p)


def test_an_unaware_sleep_survives_grow_and_shrink(fake_nvml, cli_env, tmp_path):
    fake_nvml.write(make_gpus(3))
    env = job_env(cli_env)
    p = subprocess.Popen([*GPUSD, "run", "--", "sleep", "300"], env=env, text=True, stderr=subprocess.PIPE)
    try:
        rec = wait_until_sync(lambda: [j for j in jobs_json(env) if j.get("child")], timeout=30)[0]
        job = str(rec["job"])
        assert gpusd_cli(["grow", job], env=env).returncode == 0
        r = gpusd_cli(["shrink", job], env=env)
        assert r.returncode == 0 and "not signalled" in r.stdout, (r.stdout, r.stderr)
        [now] = jobs_json(env)
        assert now["state"] == "running" and now["indices"] == [0]
        # sleep is still there: the SIGTERM we send now is what ends it (143), not a SIGUSR1 sent
        # before (138; SIGUSR1 is delivered before SIGTERM when both are pending)
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        _kill(p)


def test_a_job_that_catches_the_notify_signal_is_sent_it(fake_nvml, cli_env, tmp_path):
    """A handler for the signal named by --notify-signal (here SIGUSR2) is seen in SigCgt: that job is
    signalled, and grow says so."""
    fake_nvml.write(make_gpus(2))
    got, ready = tmp_path / "got", tmp_path / "ready"
    script = (f"import signal, time, pathlib\n"
              f"signal.signal(signal.SIGUSR2, lambda *a: pathlib.Path({str(got)!r}).write_text('yes'))\n"
              f"pathlib.Path({str(ready)!r}).touch()\n"
              f"while not pathlib.Path({str(got)!r}).exists(): time.sleep(0.05)\n")
    env = job_env(cli_env)
    p = subprocess.Popen([*GPUSD, "run", "--notify-signal", "USR2", "--", sys.executable, "-c", script], env=env,
                         text=True)
    try:
        wait_until_sync(ready.exists, timeout=30)
        job = str(jobs_json(env)[0]["job"])
        r = gpusd_cli(["grow", job], env=env)
        assert r.returncode == 0 and "was sent SIGUSR2" in r.stdout, (r.stdout, r.stderr)
        assert p.wait(timeout=30) == 0 and got.read_text() == "yes"
    finally:
        _kill(p)


def test_catches_reads_the_kernels_mask(tmp_path):
    from gpusd.jobs.child import catches

    child = subprocess.Popen([sys.executable, "-c", "import signal, sys, time\n"
                              "signal.signal(signal.SIGUSR2, lambda *a: None)\nprint('ok', flush=True)\n"
                              "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "ok\n"
        assert catches(child.pid, signal.SIGUSR2) and not catches(child.pid, signal.SIGUSR1)
        assert catches(child.pid, signal.SIGINT)  # Python's own handler
    finally:
        child.kill()
        child.wait()
    assert not catches(child.pid, signal.SIGUSR2)  # gone: nothing to signal


def test_an_unaware_job_whose_lease_the_daemon_holds_survives_grow_and_shrink(fake_nvml_inprocess, cli_env,
                                                                              tmp_path):
    from authority_helpers import ServerThread

    fake_nvml_inprocess.write(make_gpus(2))
    server = ServerThread()
    env = job_env(cli_env)
    p = subprocess.Popen([*GPUSD, "run", "--", "sleep", "300"], env=env, text=True, stderr=subprocess.PIPE)
    try:
        rec = wait_until_sync(lambda: [j for j in jobs_json(env) if j.get("child")], timeout=30)[0]
        job = str(rec["job"])
        r = gpusd_cli(["grow", job], env=env)
        assert r.returncode == 0 and "does not catch SIGUSR1" in r.stdout, (r.stdout, r.stderr)
        assert gpusd_cli(["shrink", job], env=env).returncode == 0
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        _kill(p)
        server.stop()


def test_the_notify_signal_never_reaches_a_process_that_reused_the_commands_pid(tmp_path):
    """The main thread reaps the command while grow's thread decides to notify it: the pid it read may
    name another process by then (here: one that catches SIGUSR1 and is not the job). The signal goes
    through the command's pidfd, so that process is never sent it."""
    import os
    import types

    from gpusd.jobs.child import Child

    command = subprocess.Popen([sys.executable, "-c", "pass"])
    pidfd = os.pidfd_open(command.pid)
    command.wait()  # the job's command: exited and reaped
    got = tmp_path / "got"
    other = subprocess.Popen([sys.executable, "-c", "import signal, sys, time\n"
                              f"signal.signal(signal.SIGUSR1, lambda *a: open({str(got)!r}, 'w').write('hit'))\n"
                              "print('ok', flush=True)\ntime.sleep(3)"], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout is not None and other.stdout.readline() == "ok\n"
        # what grow's thread saw: a command not yet reaped (poll() None), whose pid is now the other's
        stale = types.SimpleNamespace(pid=other.pid, poll=lambda: None)
        child = Child("job j1")
        child.proc, child.pidfd = stale, pidfd  # type: ignore[assignment]
        assert child.notify(signal.SIGUSR1) == "the command had exited"
        assert other.wait(timeout=30) == 0 and not got.exists()
    finally:
        os.close(pidfd)
        _kill(other)


def test_stop_pause_and_forwarded_signals_never_reach_a_process_group_that_reused_the_commands_pid(tmp_path):
    """The command (its own process group, --preemptible/--pausable) was reaped meanwhile and its pid
    now leads another process group (here: one that catches SIGTERM, SIGCONT and SIGUSR2). A stop
    (SIGCONT, SIGTERM, SIGKILL after the grace period), a pause and a forwarded signal go through the
    command's pidfd and its group recorded at spawn: that group is never signalled."""
    import os
    import threading
    import time
    import types

    from gpusd.jobs.child import Child
    from gpusd.jobs.state import JobState, JobStates
    from gpusd.jobs.supervisor import Supervisor

    command = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    pidfd = os.pidfd_open(command.pid)
    command.wait()  # the job's command: exited and reaped
    got = tmp_path / "got"
    other = subprocess.Popen([sys.executable, "-c", "import os, signal, sys, time\n"
                              f"hit = lambda n, f: open({str(got)!r}, 'a').write(f'{{n}} ')\n"
                              "for s in (signal.SIGTERM, signal.SIGCONT, signal.SIGUSR2):\n"
                              "    signal.signal(s, hit)\n"
                              "print('ok', flush=True)\ntime.sleep(3)"],
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert other.stdout is not None and other.stdout.readline() == "ok\n"
        assert os.getpgid(other.pid) == other.pid  # it leads a group: the old getpgid test would killpg it

        def wait(timeout=None):  # the grace period runs out: the SIGKILL is due
            time.sleep(timeout or 0)
            raise subprocess.TimeoutExpired("cmd", timeout or 0)

        # what a control thread saw: a command not yet reaped (poll() None), whose pid is now the other's
        stale = types.SimpleNamespace(pid=other.pid, poll=lambda: None, wait=wait)
        child = Child("job j1")
        child.proc, child.pidfd, child.pgid = stale, pidfd, command.pid  # type: ignore[assignment]
        sup = types.SimpleNamespace(child=child, spec=types.SimpleNamespace(grace=0.2, pausable=True), job_id="j1",
                                    state=JobStates(JobState.RUNNING), lock=threading.RLock(),
                                    writer=types.SimpleNamespace(write=lambda **kw: None))
        Supervisor._stop_child(sup, JobState.MOVING)  # type: ignore[arg-type]
        assert Supervisor.pause(sup, True, "test")["ok"]  # type: ignore[arg-type]
        child.signal(signal.SIGUSR2)  # what the forwarding handler sends
        time.sleep(0.6)  # past the grace period: kill_later has run
        assert other.poll() is None  # no SIGKILL, no SIGSTOP left it stopped
        assert other.wait(timeout=30) == 0 and not got.exists()
    finally:
        os.close(pidfd)
        _kill(other)
