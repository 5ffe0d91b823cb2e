"""``gpusd run --on-change restart|file`` and ``GPUSD_GPU_COUNT`` (docs/jobs.md, "Grow and shrink"): a
command that does not speak the protocol follows a grow or shrink by being restarted on its new GPUs,
keeping the lease; ``python -m gpusd.job`` reads the job file for launchers and discovery scripts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import gpusd_cli
from fakenvml import make_gpus
from gpusd import job as gjob
from jobs_helpers import GPUSD, job_env, jobs_json, leases_json
from waiting import wait_until_sync


def _kill(p: subprocess.Popen[str]) -> None:
    if p.poll() is None:
        p.kill()
        p.wait()


def _lines(path: Path) -> list[list[str]]:
    return [x.split() for x in path.read_text().splitlines()] if path.exists() else []


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_on_change_restart_follows_grow_and_shrink_keeping_the_lease(fake_nvml, cli_env, tmp_path):
    """A shell that knows nothing of the protocol (no SIGUSR1 handler) and leaves a child behind is
    stopped as a whole (its process group) and started again on the job's GPUs now, with the count
    in GPUSD_GPU_COUNT, the same lease and GPUSD_RESTART_COUNT one higher; a GPU given back is free
    once it restarted."""
    fake_nvml.write(make_gpus(3))
    out, kids, stop = tmp_path / "out", tmp_path / "kids", tmp_path / "stop"
    script = (f'echo "$GPUSD_RESTART_COUNT $CUDA_VISIBLE_DEVICES $GPUSD_GPU_COUNT $GPUSD_LEASE" >> {out}; '
              f'sleep 300 & echo $! >> {kids}; while [ ! -e {stop} ]; do sleep 0.1; done; kill $!')
    env = job_env(cli_env)
    p = subprocess.Popen([*GPUSD, "run", "--on-change", "restart", "--grace", "20", "--", "sh", "-c", script],
                         env=env, text=True, stderr=subprocess.PIPE)
    try:
        wait_until_sync(lambda: len(_lines(out)) == 1 and kids.exists(), timeout=30)
        job = jobs_json(env)[0]["job"]
        r = gpusd_cli(["grow", str(job), "+1"], env=env)
        assert r.returncode == 0, r.stderr
        wait_until_sync(lambda: len(_lines(out)) == 2, timeout=30, what="the restart after the grow")
        first, second = _lines(out)
        assert first[:3] == ["0", "0", "1"] and second[:3] == ["1", "0,1", "2"]
        assert first[3] == second[3]  # the same lease
        old = int(kids.read_text().split()[0])
        wait_until_sync(lambda: not _alive(old), timeout=30, what="the first start's child gone with its group")
        rec = jobs_json(env)[0]
        assert rec["restarts"] == 1 and rec["indices"] == [0, 1] and "--on-change restart" in rec["reason"]

        r = gpusd_cli(["shrink", str(job), "-1"], env=env)
        assert r.returncode == 0, r.stderr
        wait_until_sync(lambda: len(_lines(out)) == 3, timeout=30, what="the restart after the shrink")
        assert _lines(out)[2][:3] == ["2", "0", "1"] and _lines(out)[2][3] == first[3]
        held = wait_until_sync(lambda: {le["device"] for le in leases_json(env)["leases"] if le.get("job") == job},
                               timeout=30)
        assert len(held) == 1  # GPU 1 is given back once the command that inherited it restarted
        free = gpusd_cli(["run", "-n", "2", "--", "sh", "-c", "echo $CUDA_VISIBLE_DEVICES"], env=env)
        assert free.returncode == 0 and free.stdout.strip() == "1,2", free.stderr
        stop.touch()
        assert p.wait(timeout=30) == 0
        assert p.stderr is not None and "grown to 0,1; the command restarts" in p.stderr.read()
        assert all(not _alive(int(k)) for k in kids.read_text().split())
    finally:
        _kill(p)


def test_on_change_restart_of_a_job_whose_lease_the_daemon_holds(fake_nvml_inprocess, cli_env, tmp_path):
    """Where a daemon is the lease authority the restart keeps the daemon's lease too (its id in
    GPUSD_LEASE, the GPUs named in its record)."""
    from authority_helpers import ServerThread
    from gpusd.alloc.leases import LeaseStore
    from gpusd.alloc.lockdir import flock_table, lock_key

    fake_nvml_inprocess.write(make_gpus(2))
    server = ServerThread()
    out, stop = tmp_path / "out", tmp_path / "stop"
    script = (f'echo "$GPUSD_RESTART_COUNT $CUDA_VISIBLE_DEVICES $GPUSD_GPU_COUNT $GPUSD_LEASE" >> {out}; '
              f'while [ ! -e {stop} ]; do sleep 0.1; done')
    env = job_env(cli_env)
    p = subprocess.Popen([*GPUSD, "run", "--on-change", "restart", "--", "sh", "-c", script], env=env, text=True)
    try:
        wait_until_sync(lambda: _lines(out), timeout=30)
        [held] = leases_json(env)["leases"]
        job = str(held["job"])
        assert held["pid"] == p.pid and _lines(out)[0] == ["0", "0", "1", held["lease_id"]]
        assert gpusd_cli(["grow", job], env=env).returncode == 0
        wait_until_sync(lambda: len(_lines(out)) == 2, timeout=30, what="the restart after the grow")
        assert _lines(out)[1] == ["1", "0,1", "2", held["lease_id"]]
        assert len({le["device"] for le in leases_json(env)["leases"] if le["lease_id"] == held["lease_id"]}) == 2
        lock = os.stat(LeaseStore.authority().dir / f"gpu-{held['device']}.lock")
        assert [pid for pid, _ in flock_table()[lock_key(lock)]] == [os.getpid()]  # held by the daemon (here)
        assert gpusd_cli(["shrink", job], env=env).returncode == 0
        wait_until_sync(lambda: len(_lines(out)) == 3, timeout=30, what="the restart after the shrink")
        assert _lines(out)[2] == ["2", "0", "1", held["lease_id"]]
        stop.touch()
        assert p.wait(timeout=30) == 0
    finally:
        _kill(p)
        server.stop()


def test_on_change_restart_kills_a_command_that_ignores_sigterm_after_the_grace(fake_nvml, cli_env, tmp_path):
    fake_nvml.write(make_gpus(2))
    out, stop = tmp_path / "out", tmp_path / "stop"
    script = (f"trap '' TERM; echo \"$GPUSD_RESTART_COUNT $CUDA_VISIBLE_DEVICES\" >> {out}; "
              f"while [ ! -e {stop} ]; do sleep 0.1; done")
    env = job_env(cli_env)
    p = subprocess.Popen([*GPUSD, "run", "--on-change", "restart", "--grace", "1", "--", "sh", "-c", script],
                         env=env, text=True, stderr=subprocess.PIPE)
    try:
        wait_until_sync(lambda: _lines(out), timeout=30)
        job = jobs_json(env)[0]["job"]
        assert gpusd_cli(["grow", str(job)], env=env).returncode == 0
        wait_until_sync(lambda: len(_lines(out)) == 2, timeout=30, what="the restart after SIGKILL")
        assert _lines(out)[1] == ["1", "0,1"]
        stop.touch()
        assert p.wait(timeout=30) == 0
        assert p.stderr is not None and "SIGKILL" in p.stderr.read()
    finally:
        _kill(p)


def test_on_change_file_sends_no_signal_and_the_count_follows_the_file(fake_nvml, cli_env, tmp_path):
    """With ``--on-change file`` a command without a SIGUSR1 handler (which the default would kill)
    keeps running and reads the new count with ``python -m gpusd.job --count``."""
    fake_nvml.write(make_gpus(2))
    out, stop = tmp_path / "out", tmp_path / "stop"
    script = (f'while [ ! -e {stop} ]; do python3 -m gpusd.job --count >> {out} || exit 9; sleep 0.3; done')
    env = job_env(cli_env, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    p = subprocess.Popen([*GPUSD, "run", "--on-change", "file", "--", "sh", "-c", script], env=env, text=True,
                         stderr=subprocess.PIPE)
    try:
        wait_until_sync(lambda: _lines(out), timeout=30)
        job = jobs_json(env)[0]["job"]
        assert gpusd_cli(["grow", str(job)], env=env).returncode == 0
        wait_until_sync(lambda: ["2"] in _lines(out), timeout=30)
        assert gpusd_cli(["shrink", str(job)], env=env).returncode == 0
        wait_until_sync(lambda: _lines(out)[-1] == ["1"], timeout=30)
        assert p.poll() is None and jobs_json(env)[0]["restarts"] == 0  # never signalled nor restarted
        stop.touch()
        assert p.wait(timeout=30) == 0
    finally:
        _kill(p)


def test_on_change_is_validated(fake_nvml, cli_env):
    fake_nvml.write(make_gpus(1))
    r = gpusd_cli(["run", "--on-change", "sometimes", "--", "true"], env=cli_env)
    assert r.returncode == 2 and "--on-change" in r.stderr and "invalid choice" in r.stderr
    r = gpusd_cli(["run", "--no-lease", "--on-change", "restart", "--", "true"], env=cli_env)
    assert r.returncode == 2 and "--on-change is for local jobs" in r.stderr and "Traceback" not in r.stderr
    r = gpusd_cli(["run", "--fleet", "--on-change", "file", "--", "true"], env=cli_env)
    assert r.returncode == 2 and "not with --fleet" in r.stderr and "Traceback" not in r.stderr
    r = gpusd_cli(["run", "--", "sh", "-c", 'test "$GPUSD_GPU_COUNT" = 1'], env=cli_env)
    assert r.returncode == 0, r.stderr


def test_python_m_gpusd_job_prints_the_count_and_horovod_discovery_lines(tmp_path, capsys, monkeypatch):
    f = tmp_path / "gpus.json"
    f.write_text('{"format": 1, "devices": [{"index": 0}, {"index": 3}]}')
    monkeypatch.setenv("GPUSD_JOB_FILE", str(f))
    assert gjob.main(["--count"]) == 0 and capsys.readouterr().out == "2\n"
    assert gjob.main(["--horovod-discovery", "--host", "node-1"]) == 0
    assert capsys.readouterr().out == "node-1:2\n"
    assert gjob.main(["--horovod-discovery"]) == 0 and capsys.readouterr().out.endswith(":2\n")
    # a host name that would add lines or fields of its own to Horovod's parse is refused
    assert gjob.main(["--horovod-discovery", "--host", "evil:9\nother"]) == 2
    assert "not a host name" in capsys.readouterr().err
    f.write_text('{"devices": "0,1"}')  # not a list: no count rather than a wrong one
    assert gjob.main(["--count"]) == 1 and "cannot read" in capsys.readouterr().err
    monkeypatch.delenv("GPUSD_JOB_FILE")
    assert gjob.main(["--count"]) == 1 and "not in a gpusd job" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gjob.main([])
