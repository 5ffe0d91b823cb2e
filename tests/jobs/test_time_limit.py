"""gpusd run --time: the job is stopped when its time runs out (docs/jobs.md, "Time limits")."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from authority_helpers import ServerThread
from conftest import gpusd_cli
from fakenvml import make_gpus
from jobs_helpers import GPUSD, job_env, jobs_json, leases_json
from waiting import wait_until_sync


def _kill(p: subprocess.Popen[str]) -> None:
    if p.poll() is None:
        p.kill()
        p.wait()


def test_time_runs_out_the_job_is_stopped_with_status_124_and_its_lease_freed(fake_nvml, cli_env, tmp_path):
    from gpusd.cli.exits import EXIT_TIME_LIMIT
    from gpusd.jobs.supervisor import TIMED_OUT

    assert EXIT_TIME_LIMIT == TIMED_OUT == 124  # the CLI's documented status is the supervisor's
    fake_nvml.write(make_gpus(1))
    env = job_env(cli_env)
    p = subprocess.Popen([*GPUSD, "run", "--time", "3s", "--grace", "1", "--", "sleep", "60"], env=env, text=True,
                         stderr=subprocess.PIPE)
    try:
        _, err = p.communicate(timeout=40)  # well before sleep's 60 s
        assert p.returncode == 124, err
        assert "time limit (3s) ran out" in err
        assert leases_json(env)["leases"] == [] and jobs_json(env) == []
        # the GPU is free again: a run without --time gets it at once
        assert gpusd_cli(["run", "--", "true"], env=env).returncode == 0
    finally:
        _kill(p)


def test_a_command_that_ignores_sigterm_is_killed_after_the_grace(fake_nvml, cli_env, tmp_path):
    fake_nvml.write(make_gpus(1))
    env = job_env(cli_env)
    marker = tmp_path / "child.pid"
    # the shell ignores SIGTERM and so does the child it leaves behind in the job's process group
    script = f"trap '' TERM; sleep 60 & echo $! > {marker}; wait; wait"
    p = subprocess.Popen([*GPUSD, "run", "--time", "1s", "--grace", "1", "--", "sh", "-c", script], env=env,
                         text=True, stderr=subprocess.PIPE)
    try:
        _, err = p.communicate(timeout=40)
        assert p.returncode == 124, err
        pid = int(marker.read_text())
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
        assert leases_json(env)["leases"] == []
    finally:
        _kill(p)


def test_gpusd_jobs_shows_the_time_left(fake_nvml, cli_env, tmp_path):
    fake_nvml.write(make_gpus(1))
    env = job_env(cli_env)
    p = subprocess.Popen([*GPUSD, "run", "--time", "2h", "--", "sleep", "60"], env=env, text=True)
    try:
        [job] = wait_until_sync(lambda: [j for j in jobs_json(env) if j["state"] == "running"], timeout=30)
        assert job["time_limit"] == 7200 and 7000 < job["ends"] - time.time() <= 7200
        table = gpusd_cli(["jobs"], env=env).stdout
        assert "LEFT" in table.splitlines()[0]
        assert "1h59m" in table or "2h" in table.split("LEFT")[1]
    finally:
        p.terminate()
        p.wait(timeout=30)


def _policy(tmp_path: Path, body: dict[str, object]) -> str:
    p = tmp_path / "policy.json"
    p.write_text(json.dumps(body))
    p.chmod(0o644)
    return str(p)


def test_the_policy_sets_a_default_and_a_maximum_per_priority_class(fake_nvml, cli_env, tmp_path):
    if __import__("os").geteuid() != 0:
        pytest.skip("a policy file is believed only when root owns it")
    fake_nvml.write(make_gpus(1))
    env = job_env(cli_env, GPUSD_POLICY=_policy(tmp_path, {"time_limits": {
        "normal": {"default_minutes": 1 / 60, "max_minutes": 60}}}))
    r = gpusd_cli(["run", "--time", "2h", "--", "true"], env=env)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "allows normal jobs at most 1h" in r.stderr
    assert leases_json(env)["leases"] == []  # nothing was taken
    r = subprocess.run([*GPUSD, "run", "--grace", "0", "--", "sleep", "60"], env=env, text=True,
                       capture_output=True, timeout=60)
    assert r.returncode == 124, r.stderr  # the class's default (1 s) applied


def test_a_daemon_held_job_is_marked_timed_out_in_the_history(fake_nvml_inprocess, cli_env):
    fake_nvml_inprocess.write(make_gpus(1))
    told: list[tuple[str, str]] = []

    class History:
        def lease_started(self, lease_id, user, uid, command, gpus):
            told.append(("started", lease_id))

        def lease_ended(self, lease_id):
            told.append(("ended", lease_id))

        def lease_timed_out(self, lease_id):
            told.append(("timed_out", lease_id))

    server = ServerThread()
    server.server.history = History()
    try:
        env = job_env(cli_env)
        r = subprocess.run([*GPUSD, "run", "--time", "1s", "--grace", "1", "--", "sleep", "60"], env=env, text=True,
                           capture_output=True, timeout=60)
        assert r.returncode == 124, r.stderr
        wait_until_sync(lambda: any(k == "ended" for k, _ in told), timeout=30)
        assert len({lid for _, lid in told}) == 1  # one lease
        assert [k for k, _ in told] == ["started", "timed_out", "ended"]
    finally:
        server.stop()


def test_the_history_records_a_timed_out_lease(tmp_path):
    from gpusd.usage.db import connect
    from gpusd.usage.recorder import Accountant

    conn = connect(tmp_path / "h.db")
    acc = Accountant(conn, 1.0)
    acc.lease_started("lease1", "alice", 1000, "sleep 60", ["GPU-a"], 100.0)
    acc.mark_timed_out("lease1", 103.0)
    acc.lease_ended("lease1", 104.0)
    acc.lease_started("lease2", "alice", 1000, "true", ["GPU-a"], 105.0)
    acc.lease_ended("lease2", 106.0)
    rows = conn.execute("SELECT key, timed_out FROM jobs ORDER BY start").fetchall()
    assert [t for _, t in rows] == [103.0, None]
