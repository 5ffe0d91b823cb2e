"""Issue 13: a local user cannot grow, shrink, preempt, move or pause another user's job.

The victim's job runs as root (the test); the attacker is a forked child that drops to another uid
(tests/test_local_trust.py's AsUser) and talks to the job's control socket directly, so the check
that counts is the supervisor's (SO_PEERCRED), not the CLI's.  Skipped when not run as root.
"""

from __future__ import annotations

import os
import subprocess
import sys

from fakenvml import make_gpus
from jobs_helpers import GPUSD, MALLORY, AsUser, as_user, job_env, job_script, jobs_json, log_events
from other_user import needs_root
from waiting import wait_until_sync


@needs_root
def test_another_user_cannot_change_or_preempt_a_job(fake_nvml, cli_env, tmp_path, shared_tmp, monkeypatch):
    fake_nvml.write(make_gpus(3))
    locks = shared_tmp / "locks"
    monkeypatch.setenv("GPUSD_LOCK_DIR", str(locks))
    log = tmp_path / "log"
    env = job_env(cli_env, GPUSD_LOCK_DIR=str(locks), JOBLOG=str(log), STOPFILE=str(tmp_path / "stop"))
    p = subprocess.Popen([*GPUSD, "run", "-n", "2", "--preemptible", "--pausable", "--priority", "low", "--",
                          sys.executable, str(job_script(tmp_path))], env=env, text=True)
    try:
        job = wait_until_sync(lambda: [j for j in jobs_json(env) if j["state"] == "running"], timeout=30)[0]
        job_id = str(job["job"])

        def attack(message: dict[str, object]) -> object:
            from gpusd.jobs.control import request

            return request(job_id, 0, message)

        for message in ({"op": "grow", "count": 1}, {"op": "shrink", "count": 1},
                        {"op": "preempt", "by": "0" * 12, "priority": 3}, {"op": "pause"},
                        {"op": "move", "avoid": [], "reason": "x"}):
            result = as_user(MALLORY, lambda m=message: attack(m))
            assert "'ok': False" in result and "belongs to another user" in result, result
        # The CLI says so too, before asking (run in the attacker's process: /root's python is not theirs).
        def cli_shrink() -> object:
            from gpusd.cli.jobs import _ask

            return _ask(job_id, {"op": "shrink", "count": 1})

        result = as_user(MALLORY, cli_shrink)
        assert result.startswith("error GpusdError") and "only its owner or root" in result, result
        # Nothing changed: the job kept its two GPUs and was never stopped or told of a change.
        now = [j for j in jobs_json(env) if j["job"] == job_id][0]
        assert now["indices"] == [0, 1] and now["state"] == "running" and now["restarts"] == 0
        assert [e["event"] for e in log_events(log)] == ["start"]
        (tmp_path / "stop").touch()
        assert p.wait(timeout=30) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def _hold(path, text: str) -> int:
    """Write a job record and keep its lock, as a live supervisor does."""
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    os.write(fd, text.encode())
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _record(job: str, **extra: object) -> str:
    import json

    d = {"job": job, "pid": os.getpid(), "user": "root", "command": "x", "devices": ["GPU-1"], "indices": [0],
         "priority": 3, "preemptible": False, "state": "running", "restarts": 0, "started": 1.0}
    d.update(extra)
    return json.dumps(d)


def test_hostile_job_records_are_skipped_and_never_followed(tmp_path, monkeypatch):
    """Records are other users' files: a symlink, a huge file, ill-typed fields, a dead holder's
    record — each skipped, no traceback; only a well-formed, locked record is listed."""
    from gpusd.alloc.leases import LeaseStore
    from gpusd.jobs.record import list_jobs

    store = LeaseStore()
    store.ensure()
    d = store.dir
    secret = tmp_path / "secret.json"
    secret.write_text(_record("a" * 12))
    os.symlink(secret, d / f"job-{'a' * 12}.json")
    fds = [_hold(d / f"job-{'b' * 12}.json", _record("b" * 12) + " " * 20000),  # too big
           _hold(d / f"job-{'c' * 12}.json", _record("c" * 12, priority="urgent")),  # ill-typed
           _hold(d / f"job-{'d' * 12}.json", _record("e" * 12)),  # names another job than its file
           _hold(d / f"job-{'f' * 12}.json", _record("f" * 12, devices=["x" * 500])),
           _hold(d / f"job-{'1' * 12}.json", _record("1" * 12))]  # the good one
    (d / f"job-{'2' * 12}.json").write_text(_record("2" * 12))  # nobody holds it: a dead supervisor's
    try:
        assert [r.job for r in list_jobs(store)] == ["1" * 12]
    finally:
        for fd in fds:
            os.close(fd)


@needs_root
def test_a_job_record_is_attributed_to_its_files_owner(shared_tmp, monkeypatch):
    """Mallory writes a record that claims to be root's urgent job: it is listed as Mallory's."""
    from gpusd.alloc.leases import LeaseStore
    from gpusd.jobs.record import list_jobs
    locks = shared_tmp / "locks"
    monkeypatch.setenv("GPUSD_LOCK_DIR", str(locks))
    store = LeaseStore()
    store.ensure()
    child = AsUser(MALLORY, lambda: _hold(locks / f"job-{'9' * 12}.json", _record("9" * 12)), stay=True)
    try:
        assert child.result.startswith("ok"), child.result
        [rec] = list_jobs(store)
        assert rec.uid == MALLORY and rec.user != "root"
    finally:
        child.stop()
