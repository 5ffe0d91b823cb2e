"""Issue 13 where a daemon is the lease authority: a job's lease is the daemon's (its record names the
job), and grows and shrinks there (docs/jobs.md, docs/allocation.md "lease protocol 2")."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from authority_helpers import ServerThread
from conftest import gpusd_cli
from fakenvml import make_gpus
from jobs_helpers import GPUSD, MALLORY, as_user, job_env, job_script, jobs_json, leases_json, log_events
from other_user import needs_root
from waiting import wait_until_sync


@pytest.fixture
def authority(fake_nvml_inprocess):
    server = ServerThread()
    yield server
    server.stop()


def _kill(p: subprocess.Popen[str]) -> None:
    if p.poll() is None:
        p.kill()
        p.wait()


def _changes(log):
    return [e for e in log_events(log) if e["event"] == "change"]


def _lease_of(env, job):
    """(lease id, devices) of the job's lease, from `gpusd leases --json`."""
    held = [le for le in leases_json(env)["leases"] if le.get("job") == job]
    ids = {le["lease_id"] for le in held}
    assert len(ids) == 1, held  # one lease, one record, whatever was added to it
    return ids.pop(), sorted(le["device"] for le in held)


def test_a_daemon_held_job_grows_from_one_to_three_and_shrinks_to_two(fake_nvml_inprocess, authority, cli_env,
                                                                       tmp_path):
    from gpusd.alloc.leases import LeaseStore
    from gpusd.alloc.lockdir import flock_table, lock_key

    fake_nvml_inprocess.write(make_gpus(4))
    log = tmp_path / "log"
    env = job_env(cli_env, JOBLOG=str(log), STOPFILE=str(tmp_path / "stop"))
    flock_only = dict(env, GPUSD_LEASE_SOCKET="off")
    p = subprocess.Popen([*GPUSD, "run", "--", sys.executable, str(job_script(tmp_path))], env=env, text=True)
    others: list[subprocess.Popen[str]] = []
    try:
        wait_until_sync(lambda: any(e["event"] == "start" for e in log_events(log)), timeout=30)
        [job] = jobs_json(env)
        job_id = str(job["job"])
        [held] = leases_json(env)["leases"]
        assert held["job"] == job_id and held["pid"] == p.pid  # the daemon's record names the job
        lease_id = held["lease_id"]
        assert job["lease"] == lease_id
        lock = os.stat(LeaseStore.authority().dir / f"gpu-{held['device']}.lock")
        assert [pid for pid, _ in flock_table()[lock_key(lock)]] == [os.getpid()]  # held by the daemon

        r = gpusd_cli(["grow", job_id[:6], "+2"], env=env)
        assert r.returncode == 0, r.stderr
        seen = wait_until_sync(lambda: _changes(log), timeout=30)
        assert seen[-1]["gpus"] == "0,1,2"
        grown_id, devices = _lease_of(env, job_id)
        assert grown_id == lease_id and len(devices) == 3  # the same lease, its record names all three
        assert [j["indices"] for j in jobs_json(env)] == [[0, 1, 2]]

        # Meanwhile other jobs queue for GPUs (through the daemon): GPU 3 only, never the job's.
        out = tmp_path / "other"
        others = [subprocess.Popen([*GPUSD, "run", "--wait", "--timeout", "120", "--", "sh", "-c",
                                    f'echo "$CUDA_VISIBLE_DEVICES" >> {out}; sleep 0.5'], env=env, text=True)
                  for _ in range(3)]
        wait_until_sync(lambda: out.exists() and out.read_text().strip(), timeout=60)
        r = gpusd_cli(["shrink", job_id, "-1"], env=env)
        assert r.returncode == 0, r.stderr
        assert "exits or restarts" not in r.stdout + r.stderr  # freed now, not later
        changes = wait_until_sync(lambda: _changes(log)[1:], timeout=30)
        assert changes[-1]["gpus"] == "0,1" and changes[-1]["gen"] > seen[-1]["gen"]
        same, now = _lease_of(env, job_id)
        assert same == lease_id and len(now) == 2 and set(now) < set(devices)
        assert [sorted(j["devices"]) for j in jobs_json(env) if j["job"] == job_id] == [now]  # they agree
        for o in others:
            assert o.wait(timeout=120) == 0
        got = out.read_text().split()
        assert len(got) == 3 and got[0] == "3"  # the first ran while the job had 0,1,2
        assert all(g in ("2", "3") for g in got)  # GPU 2 only after the shrink gave it back

        # A GPU the command inherited at its start is freed at once too: the daemon holds its descriptor.
        r = gpusd_cli(["shrink", job_id, "--release", "0"], env=env)
        assert r.returncode == 0, r.stderr
        assert wait_until_sync(lambda: _changes(log)[2:], timeout=30)[-1]["gpus"] == "1"
        r = gpusd_cli(["run", "--include", "0", "--", "sh", "-c", 'echo "$CUDA_VISIBLE_DEVICES"'], env=flock_only)
        assert r.returncode == 0 and r.stdout.strip() == "0", r.stderr
        assert p.poll() is None  # while the job still runs
        (tmp_path / "stop").touch()
        assert p.wait(timeout=30) == 0
        done = [e for e in log_events(log) if e["event"] == "done"][0]
        assert done["gpus"] == "1"
        assert leases_json(env)["leases"] == []
    finally:
        for o in [p, *others]:
            _kill(o)


def test_a_daemon_held_job_refuses_what_it_cannot_do(fake_nvml_inprocess, authority, cli_env, tmp_path):
    fake_nvml_inprocess.write(make_gpus(1))
    log = tmp_path / "log"
    env = job_env(cli_env, JOBLOG=str(log), STOPFILE=str(tmp_path / "stop"))
    p = subprocess.Popen([*GPUSD, "run", "--", sys.executable, str(job_script(tmp_path))], env=env, text=True)
    try:
        job_id = str(wait_until_sync(lambda: jobs_json(env), timeout=30)[0]["job"])
        lease_id, devices = _lease_of(env, job_id)
        r = gpusd_cli(["grow", job_id, "+1"], env=env)  # only one GPU on the machine
        assert r.returncode == 4 and "Traceback" not in r.stderr, r.stderr
        r = gpusd_cli(["shrink", job_id, "-1"], env=env)
        assert r.returncode != 0 and "at least one GPU" in r.stderr
        assert _lease_of(env, job_id) == (lease_id, devices) and _changes(log) == []
        (tmp_path / "stop").touch()
        assert p.wait(timeout=30) == 0
    finally:
        _kill(p)


@needs_root
def test_another_user_cannot_grow_or_shrink_a_daemon_held_job(fake_nvml_inprocess, cli_env, tmp_path, shared_tmp,
                                                              monkeypatch):
    fake_nvml_inprocess.write(make_gpus(3))
    locks, run = shared_tmp / "locks", shared_tmp / "run"
    run.mkdir(mode=0o755)
    monkeypatch.setenv("GPUSD_LOCK_DIR", str(locks))
    monkeypatch.setenv("GPUSD_LEASE_SOCKET", str(run / "lease.sock"))
    server = ServerThread()
    log = tmp_path / "log"
    env = job_env(cli_env, GPUSD_LOCK_DIR=str(locks), GPUSD_LEASE_SOCKET=str(run / "lease.sock"), JOBLOG=str(log),
                  STOPFILE=str(tmp_path / "stop"))
    p = subprocess.Popen([*GPUSD, "run", "-n", "2", "--", sys.executable, str(job_script(tmp_path))], env=env,
                         text=True)
    try:
        job_id = str(wait_until_sync(lambda: [j for j in jobs_json(env) if j["state"] == "running"],
                                     timeout=30)[0]["job"])
        lease_id, devices = _lease_of(env, job_id)
        assert len(devices) == 2

        def attack(message: dict[str, object]) -> object:
            from gpusd.jobs.control import request

            return request(job_id, 0, message)

        for message in ({"op": "grow", "count": 1}, {"op": "shrink", "count": 1},
                        {"op": "shrink", "release": devices[0]}):
            result = as_user(MALLORY, lambda m=message: attack(m))
            assert "'ok': False" in result and "belongs to another user" in result, result
        # Through the daemon: a lease request naming the job is Mallory's own lease; it cannot reach the job's.
        def claim() -> object:
            import json
            import socket

            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(30)
            s.connect(str(run / "lease.sock"))
            f = s.makefile("rb")
            s.sendall(json.dumps({"op": "lease", "v": 2, "count": 1, "job": job_id}).encode() + b"\n")
            mine = json.loads(f.readline())
            s.sendall(json.dumps({"op": "release", "id": 1, "device": devices[0]}).encode() + b"\n")
            answer = json.loads(f.readline())
            return f"{mine['ok']} {answer['ok']} {answer['message']}"

        result = as_user(MALLORY, claim)
        assert result.startswith("ok True False") and "does not hold" in result, result
        held = [le for le in leases_json(env)["leases"] if le["lease_id"] == lease_id]
        assert sorted(le["device"] for le in held) == devices  # nothing changed
        assert [j["indices"] for j in jobs_json(env) if j["job"] == job_id] == [[0, 1]]
        assert _changes(log) == []
        (tmp_path / "stop").touch()
        assert p.wait(timeout=30) == 0
    finally:
        _kill(p)
        server.stop()


def test_a_job_queued_at_the_daemon_stops_on_sigterm(fake_nvml_inprocess, authority, cli_env):
    """The wait for GPUs is the daemon's (a blocking read on the lease socket): the signal only sets the
    supervisor's stop event, and the main thread ends the wait (exit 128 + 15), leaving nothing queued."""
    import signal

    fake_nvml_inprocess.write(make_gpus(1))
    holder = subprocess.Popen([*GPUSD, "run", "--", "sleep", "60"], env=cli_env, text=True)
    waiting = None
    try:
        wait_until_sync(lambda: len(leases_json(cli_env)["leases"]) == 1, timeout=30)
        waiting = subprocess.Popen([*GPUSD, "run", "--wait", "--", "true"], env=cli_env, text=True,
                                   stderr=subprocess.PIPE)
        wait_until_sync(lambda: leases_json(cli_env)["queued"], timeout=30, what="the job queued at the daemon")
        waiting.send_signal(signal.SIGTERM)
        assert waiting.wait(timeout=30) == 128 + 15
        assert waiting.stderr is not None and "stopped by SIGTERM while waiting for GPUs" in waiting.stderr.read()
        wait_until_sync(lambda: leases_json(cli_env)["queued"] == [], timeout=30, what="the daemon's queue empty")
        assert [j["state"] for j in jobs_json(cli_env)] == ["running"]  # only the holder's job is left
    finally:
        for p in (holder, waiting):
            if p is not None:
                _kill(p)
