"""gpusd launch where every host of the placement is this machine (no SSH, no root needed): prefixed
output, the first failure's status, Ctrl-C stops every process group."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import tests_paths
from netns import read_lines

SRC = str(tests_paths.SRC)


def _placement(tmp_path: Path) -> Path:
    path = tmp_path / "placement.json"
    path.write_text(json.dumps({"job_id": "local-1", "hosts": [
        {"hostname": "a", "address": "127.0.0.1", "gpus": [1]},
        {"hostname": "b", "address": "127.0.0.1", "gpus": [0, 3]}]}))
    return path


def _argv(tmp_path: Path, *rest: str) -> list[str]:
    return [sys.executable, "-m", "gpusd", "launch", "--placement", str(_placement(tmp_path)), "--grace", "2", *rest]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": SRC}


def test_local_hosts_run_without_ssh(tmp_path: Path) -> None:
    r = subprocess.run(_argv(tmp_path, "command", "--", "sh", "-c",
                             'echo "$GPUSD_NODE_RANK $CUDA_VISIBLE_DEVICES ${SSH_CONNECTION:-no-ssh}"'),
                       capture_output=True, text=True, env={**_env(), "PATH": "/nonexistent-ssh:" + os.environ["PATH"]},
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.splitlines()) == ["[a#0] 0 1 no-ssh", "[b#1] 1 0,3 no-ssh"]


def test_first_failure_wins_and_stops_the_rest(tmp_path: Path) -> None:
    t = time.monotonic()
    r = subprocess.run(_argv(tmp_path, "command", "--", "sh", "-c",
                             '[ "$GPUSD_NODE_RANK" = 1 ] && exit 3; exec sleep 60'),
                       capture_output=True, text=True, env=_env(), timeout=60)
    assert r.returncode == 3 and "b#1 (b) exited with status 3" in r.stderr
    assert time.monotonic() - t < 45


def test_sigint_stops_every_local_process_group(tmp_path: Path) -> None:
    p = subprocess.Popen(_argv(tmp_path, "command", "--", "sh", "-c", 'sleep 300 & echo "pids $$ $!"; wait'),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
    assert p.stdout is not None
    lines = read_lines(p.stdout.fileno(), 2, 30)
    pids = [int(x) for line in lines if " pids " in line for x in line.split()[2:]]
    assert len(pids) == 4
    p.send_signal(signal.SIGINT)
    p.communicate(timeout=30)
    assert p.returncode == 130
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in pids if Path(f"/proc/{pid}").exists()] == []


def test_a_missing_program_is_reported(tmp_path: Path) -> None:
    r = subprocess.run(_argv(tmp_path, "command", "--", "/nonexistent/prog"), capture_output=True, text=True,
                       env=_env(), timeout=60)
    assert r.returncode == 127 and "cannot start" in r.stderr and "Traceback" not in r.stderr


def test_a_program_that_cannot_be_executed_is_126(tmp_path: Path) -> None:
    script = tmp_path / "train.sh"
    script.write_text("#!/bin/sh\necho ran\n")
    script.chmod(0o644)  # there but not executable: the shell's 126, as a user's script would say
    r = subprocess.run(_argv(tmp_path, "command", "--", str(script)), capture_output=True, text=True,
                       env=_env(), timeout=60)
    assert r.returncode == 126 and "cannot start" in r.stderr and "Traceback" not in r.stderr, r.stderr


# A rank as torchrun starts one: in a session of its own, and it ignores SIGTERM (a checkpoint being saved).
STUBBORN = ("import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); os.setsid(); "
            "print('rank', os.getpid(), flush=True); time.sleep(300)")


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def _kill(pids: list[int]) -> None:
    """What a failed test left running (the ranks it started, by pid)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _rank_pids(p: "subprocess.Popen[bytes]", n: int) -> list[int]:
    assert p.stdout is not None
    lines = read_lines(p.stdout.fileno(), n, 30)
    return [int(line.split()[2]) for line in lines if " rank " in line]


def test_ctrl_c_returns_only_once_a_rank_in_its_own_session_is_gone(tmp_path: Path) -> None:
    """Ctrl-C: the rank outside the command's process group, which ignores SIGTERM, is killed after
    --grace, and gpusd launch returns (and would release the leases) only once it is gone."""
    p = subprocess.Popen(_argv(tmp_path, "command", "--", sys.executable, "-c", STUBBORN),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
    pids: list[int] = []
    try:
        pids.extend(_rank_pids(p, 2))
        assert len(pids) == 2 and all(os.getsid(pid) == pid for pid in pids)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
        assert p.returncode == 130, err
        assert [pid for pid in pids if _alive(pid)] == []  # gone by the time gpusd returned
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
        _kill(pids)


def test_a_killed_launcher_leaves_no_rank_in_its_own_session(tmp_path: Path) -> None:
    """kill -9 of gpusd launch: each local guard sees its pipe close and stops the rank it started."""
    p = subprocess.Popen(_argv(tmp_path, "command", "--", sys.executable, "-c", STUBBORN),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
    pids = _rank_pids(p, 2)
    try:
        assert len(pids) == 2
        p.kill()
        p.communicate(timeout=30)
        deadline = time.monotonic() + 30
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [pid for pid in pids if _alive(pid)] == []
    finally:
        _kill(pids)


def test_what_a_finished_command_left_running_is_stopped(tmp_path: Path) -> None:
    """A host's command that ends and leaves a process behind (in a session of its own): that process
    ends with the job, and gpusd returns the command's status."""
    mark = tmp_path / "rank"  # each rank's pid, written once it runs (in a session of its own)
    rank = STUBBORN.replace("print('rank', os.getpid(), flush=True)",
                            "open(os.environ['MARK'] + '.tmp', 'w').write(str(os.getpid())); "
                            "os.replace(os.environ['MARK'] + '.tmp', os.environ['MARK'])")
    script = (f'MARK={mark}-$GPUSD_NODE_RANK; export MARK; {sys.executable} -c "{rank}" & '
              'while [ ! -e "$MARK" ]; do sleep 0.05; done; exit 4')
    r = subprocess.run(_argv(tmp_path, "command", "--", "sh", "-c", script), capture_output=True, text=True,
                       env=_env(), timeout=60)
    pids = [int((tmp_path / f"rank-{i}").read_text()) for i in (0, 1)]
    try:
        assert r.returncode == 4, r.stderr
        assert [pid for pid in pids if _alive(pid)] == []
    finally:
        _kill(pids)


def test_a_host_without_gpusd_runs_the_job_under_the_process_group_watchdog(tmp_path: Path) -> None:
    """The remote script on a host whose Python (the launching machine's path) has no gpusd: it says so,
    and the command still runs (under the sh watchdog, which stops its process group at the end of
    input) — not a traceback, not a failed job."""
    from gpusd.engines.generate import HostCommand
    from gpusd.engines.launch import LaunchOptions, remote_script
    from gpusd.engines.placement import HostSlot

    shadow = tmp_path / "shadow" / "gpusd"  # a gpusd without the guard, first on the path
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("")
    cmd = HostCommand(HostSlot("node-9", "198.18.0.9", "node-9", (0,)), 0, ["sh", "-c", 'echo "ran $X"'], {"X": "1"})
    script = remote_script(cmd, LaunchOptions(grace=1))

    def run(pythonpath: str) -> tuple[int, str, str]:
        # the channel stays open while the command runs (its end would stop the job), as gpusd keeps it
        p = subprocess.Popen(["sh", "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True,  # signals its group
                             env={**os.environ, "PYTHONPATH": pythonpath, "PATH": "/usr/bin:/bin"})
        assert p.stdout is not None and p.stderr is not None and p.stdin is not None
        out, err = p.stdout.read(), p.stderr.read()
        code = p.wait(60)
        p.stdin.close()
        return code, out, err

    code, out, err = run(str(shadow.parent))
    assert code == 0 and out == "ran 1\n", err
    assert "no Python with gpusd on this host" in err and "Traceback" not in err
    code, out, err = run(SRC)
    assert code == 0 and out == "ran 1\n" and err == "", err  # under the guard
