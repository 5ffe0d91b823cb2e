"""Issue 13: jobs, the protocol, grow and shrink, preemption (docs/jobs.md)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from conftest import gpusd_cli
from fakenvml import make_gpus
from jobs_helpers import GPUSD, job_env, job_script, jobs_json, leases_json, log_events
from waiting import wait_until_sync


def _kill(p: subprocess.Popen[str]) -> None:
    if p.poll() is None:
        p.kill()
        p.wait()


def test_a_run_is_a_job_listed_with_its_gpus_and_lease(fake_nvml, cli_env, tmp_path):
    fake_nvml.write(make_gpus(2))
    env = job_env(cli_env, JOBLOG=str(tmp_path / "log"), STOPFILE=str(tmp_path / "stop"))
    p = subprocess.Popen([*GPUSD, "run", "--priority", "high", "--", sys.executable, str(job_script(tmp_path))],
                         env=env, text=True)
    try:
        jobs = wait_until_sync(lambda: [j for j in jobs_json(env) if j["state"] == "running"], timeout=30)
        job = jobs[0]
        assert job["priority_name"] == "high" and job["indices"] == [0] and job["restarts"] == 0
        assert job["pid"] == p.pid and "job.py" in job["command"] and job["uid"] == os.geteuid()
        held = leases_json(env)["leases"]
        assert [le["job"] for le in held] == [job["job"]]
        table = gpusd_cli(["jobs"], env=env)
        assert job["job"] in table.stdout and "running" in table.stdout
        (tmp_path / "stop").touch()
        assert p.wait(timeout=30) == 0
        assert jobs_json(env) == []
    finally:
        _kill(p)


def test_grow_from_one_to_three_then_shrink_to_two(fake_nvml, cli_env, tmp_path):
    """The job sees each change through the protocol; no other job gets its GPUs in between."""
    fake_nvml.write(make_gpus(4))
    log = tmp_path / "log"
    env = job_env(cli_env, JOBLOG=str(log), STOPFILE=str(tmp_path / "stop"))
    p = subprocess.Popen([*GPUSD, "run", "--", sys.executable, str(job_script(tmp_path))], env=env, text=True)
    others: list[subprocess.Popen[str]] = []
    try:
        wait_until_sync(lambda: any(e["event"] == "start" for e in log_events(log)), timeout=30)
        job = jobs_json(env)[0]["job"]
        r = gpusd_cli(["grow", str(job)[:6], "+2"], env=env)
        assert r.returncode == 0, r.stderr
        assert f"job {job} now holds GPUs 0,1,2" in r.stdout + r.stderr  # the GPUs, named as such
        seen = wait_until_sync(lambda: [e for e in log_events(log) if e["event"] == "change"], timeout=30)
        assert seen[-1]["gpus"] == "0,1,2"
        # Meanwhile other jobs queue for GPUs: they must get GPU 3 only, never the job's.
        out = tmp_path / "other"
        others = [subprocess.Popen([*GPUSD, "run", "--wait", "--timeout", "120", "--", "sh", "-c",
                                    f'echo "$CUDA_VISIBLE_DEVICES" >> {out}; sleep 0.5'], env=env, text=True)
                  for _ in range(3)]
        wait_until_sync(lambda: out.exists() and out.read_text().strip(), timeout=60)
        r = gpusd_cli(["shrink", str(job), "-1"], env=env)
        assert r.returncode == 0, r.stderr
        assert f"job {job} now holds GPUs 0,1" in r.stdout + r.stderr
        changes = wait_until_sync(lambda: [e for e in log_events(log) if e["event"] == "change"][1:], timeout=30)
        assert changes[-1]["gpus"] == "0,1"
        held = {le["device"] for le in leases_json(env)["leases"] if le.get("job") == job}
        assert len(held) == 2
        for o in others:
            assert o.wait(timeout=120) == 0
        got = out.read_text().split()
        assert len(got) == 3 and set(got[:1]) == {"3"}  # the first ran while the job had 0,1,2
        assert all(g in ("2", "3") for g in got)  # GPU 2 only after the shrink gave it back
        (tmp_path / "stop").touch()
        assert p.wait(timeout=30) == 0
        done = [e for e in log_events(log) if e["event"] == "done"][0]
        assert done["gpus"] == "0,1"
    finally:
        for o in [p, *others]:
            _kill(o)


def test_grow_and_shrink_refuse_bad_requests(fake_nvml, cli_env, tmp_path):
    fake_nvml.write(make_gpus(1))
    env = job_env(cli_env, JOBLOG=str(tmp_path / "log"), STOPFILE=str(tmp_path / "stop"))
    p = subprocess.Popen([*GPUSD, "run", "--", sys.executable, str(job_script(tmp_path))], env=env, text=True)
    try:
        job = wait_until_sync(lambda: jobs_json(env), timeout=30)[0]["job"]
        r = gpusd_cli(["grow", str(job), "+1"], env=env)  # only one GPU on the machine
        assert r.returncode == 4 and "Traceback" not in r.stderr, r.stderr
        r = gpusd_cli(["shrink", str(job), "-1"], env=env)
        assert r.returncode != 0 and "at least one GPU" in r.stderr
        r = gpusd_cli(["grow", "ffffffffff"], env=env)
        assert r.returncode != 0 and "no running job" in r.stderr
        r = gpusd_cli(["grow", str(job), "-1"], env=env)
        assert r.returncode == 2 and "expected +N" in r.stderr
        (tmp_path / "stop").touch()
        assert p.wait(timeout=30) == 0
    finally:
        _kill(p)


def test_restart_me_restarts_on_the_same_lease_with_a_count(fake_nvml, cli_env, tmp_path):
    fake_nvml.write(make_gpus(2))
    out = tmp_path / "out"
    script = ('echo "$GPUSD_RESTART_COUNT $CUDA_VISIBLE_DEVICES $GPUSD_LEASE" >> ' + str(out) +
              '; [ "$GPUSD_RESTART_COUNT" -ge 2 ] || exit 75')
    r = gpusd_cli(["run", "--", "sh", "-c", script], env=cli_env)
    assert r.returncode == 0, r.stderr
    lines = [line.split() for line in out.read_text().splitlines()]
    assert [x[0] for x in lines] == ["0", "1", "2"]
    assert len({x[1] for x in lines}) == 1 and len({x[2] for x in lines}) == 1  # same GPU, same lease


def test_a_high_priority_job_preempts_a_preemptible_one_which_resumes_from_its_checkpoint(fake_nvml, cli_env,
                                                                                          tmp_path):
    fake_nvml.write(make_gpus(2))
    log, ckpt, result = tmp_path / "log", tmp_path / "ckpt", tmp_path / "result"
    env = job_env(cli_env, JOBLOG=str(log), CKPT=str(ckpt), RESULT=str(result), STEPS="150")
    low = subprocess.Popen([*GPUSD, "run", "-n", "2", "--preemptible", "--priority", "low", "--grace", "20", "--",
                            sys.executable, str(job_script(tmp_path))], env=env, text=True, stderr=subprocess.PIPE)
    try:
        wait_until_sync(lambda: any(e["event"] == "start" for e in log_events(log)), timeout=30)
        out = tmp_path / "high"
        high = subprocess.run([*GPUSD, "run", "-n", "2", "--priority", "high", "--wait", "--timeout", "120", "--",
                               "sh", "-c", f'echo "$CUDA_VISIBLE_DEVICES" > {out}'], env=env, text=True,
                              capture_output=True, timeout=180)
        assert high.returncode == 0, high.stderr
        assert out.read_text().strip() == "0,1"  # it ran on the GPUs the preempted job held
        assert "preempted job" in high.stderr
        assert low.wait(timeout=120) == 0
        events = log_events(log)
        starts = [e for e in events if e["event"] == "start"]
        stopped = [e for e in events if e["event"] == "stopped"]
        assert len(starts) == 2 and len(stopped) == 1
        assert starts[1]["restarts"] == "1" and starts[1]["step"] == stopped[0]["step"] > 0  # from its checkpoint
        assert result.read_text() == "150"  # and the right result
        assert "preempted by job" in low.stderr.read()
    finally:
        _kill(low)


def test_a_preempted_job_goes_back_at_the_head_of_its_class(fake_nvml, cli_env, tmp_path):
    """One GPU: a preemptible low job runs, another low job queues, a high job arrives and preempts the
    first.  When the high job is done, the preempted job runs again before the low job that queued
    before it was preempted (docs/jobs.md, "Fairness")."""
    fake_nvml.write(make_gpus(1))
    log, ckpt, result = tmp_path / "log", tmp_path / "ckpt", tmp_path / "result"
    env = job_env(cli_env, JOBLOG=str(log), CKPT=str(ckpt), RESULT=str(result), STEPS="500")
    mark = 'import json, os; open(os.environ["JOBLOG"], "a").write(json.dumps({"event": "%s"}) + "\\n")'
    low = subprocess.Popen([*GPUSD, "run", "--preemptible", "--priority", "low", "--grace", "20", "--",
                            sys.executable, str(job_script(tmp_path))], env=env, text=True, stderr=subprocess.PIPE)
    other = high = None
    try:
        wait_until_sync(lambda: any(e["event"] == "start" for e in log_events(log)), timeout=30)
        other = subprocess.Popen([*GPUSD, "run", "--priority", "low", "--wait", "--timeout", "120", "--",
                                  sys.executable, "-c", mark % "other"], env=env, text=True)
        wait_until_sync(lambda: len(leases_json(env)["waiting"]) == 1, timeout=30)  # type: ignore[arg-type]
        high = subprocess.run([*GPUSD, "run", "--priority", "high", "--wait", "--timeout", "120", "--",
                               sys.executable, "-c", mark % "high"], env=env, text=True, capture_output=True,
                              timeout=180)
        assert high.returncode == 0, high.stderr
        assert low.wait(timeout=120) == 0 and other.wait(timeout=120) == 0
        events = [e["event"] for e in log_events(log)]
        assert events == ["start", "stopped", "high", "start", "done", "other"], events
        assert result.read_text() == "500"
    finally:
        _kill(low)
        if other is not None:
            _kill(other)


def test_a_job_that_is_not_preemptible_is_never_stopped(fake_nvml, cli_env, tmp_path):
    fake_nvml.write(make_gpus(1))
    log = tmp_path / "log"
    env = job_env(cli_env, JOBLOG=str(log), STOPFILE=str(tmp_path / "stop"))
    held = subprocess.Popen([*GPUSD, "run", "--priority", "low", "--", sys.executable, str(job_script(tmp_path))],
                            env=env, text=True)
    try:
        wait_until_sync(lambda: any(e["event"] == "start" for e in log_events(log)), timeout=30)
        r = gpusd_cli(["run", "--priority", "urgent", "--", "true"], env=env)
        assert r.returncode == 4  # nothing qualifies, nothing preempted
        assert [e["event"] for e in log_events(log)] == ["start"]
        (tmp_path / "stop").touch()
        assert held.wait(timeout=30) == 0
    finally:
        _kill(held)


def test_preemptions_per_hour_are_bounded(fake_nvml, cli_env, tmp_path):
    """Fairness: a job preempted MAX_PREEMPTIONS_PER_HOUR times is left alone for the rest of the hour."""
    from gpusd.jobs.control import request
    from gpusd.jobs.supervisor import MAX_PREEMPTIONS_PER_HOUR

    fake_nvml.write(make_gpus(1))
    env = job_env(cli_env)
    script = 'sleep 30 & wait'
    low = subprocess.Popen([*GPUSD, "run", "--preemptible", "--priority", "low", "--grace", "5", "--", "sh", "-c",
                            f'trap "exit 0" TERM; {script}'], env=env, text=True)
    answers = []
    try:
        for _ in range(MAX_PREEMPTIONS_PER_HOUR + 1):
            job = wait_until_sync(lambda: [j for j in jobs_json(env) if j["state"] == "running"], timeout=60)[0]
            answers.append(request(str(job["job"]), os.geteuid(), {"op": "preempt", "by": "0" * 12, "priority": 2}))
            if answers[-1]["ok"]:
                wait_until_sync(lambda: [j for j in jobs_json(env) if j["restarts"] == len(answers)
                                         and j["state"] == "running"], timeout=60)
        assert [a["ok"] for a in answers] == [True] * MAX_PREEMPTIONS_PER_HOUR + [False]
        assert "times in the last hour" in str(answers[-1]["message"])
        low_prio = request(str(job["job"]), os.geteuid(), {"op": "preempt", "by": "0" * 12, "priority": 0})
        assert not low_prio["ok"] and "higher priority" in str(low_prio["message"])
    finally:
        low.send_signal(signal.SIGTERM)
        low.wait(timeout=30)
        _kill(low)


def test_cuda_checkpoint_is_detected_on_path_and_otherwise_the_protocol_is_used(fake_nvml, cli_env, tmp_path):
    """Detection and fallback (the moves themselves: test_jobs_rebalance.py, test_cuda_checkpoint.py); the real
    tool is verified only on a GPU machine (docs/jobs.md)."""
    from gpusd.jobs.checkpoint import find_cuda_checkpoint

    fake_nvml.write(make_gpus(1))
    empty = tmp_path / "empty"
    empty.mkdir()
    env = dict(cli_env, PATH=f"{empty}:/usr/bin:/bin")
    r = gpusd_cli(["run", "--cuda-checkpoint", "--", "true"], env=env)
    assert r.returncode == 0 and "cuda-checkpoint is not on PATH; the job protocol is used" in r.stderr
    tool = empty / "cuda-checkpoint"
    tool.write_text("#!/bin/sh\nexit 0\n")
    tool.chmod(0o755)
    r = gpusd_cli(["run", "--cuda-checkpoint", "--", "true"], env=env)  # a tool that knows no --action
    assert r.returncode == 0 and "not on PATH" not in r.stderr
    assert "cuda-checkpoint has no --action (driver r570 or later is needed); the job protocol is used" in r.stderr
    old = os.environ["PATH"]
    try:
        os.environ["PATH"] = str(empty)
        assert find_cuda_checkpoint() == str(tool)
        tool.chmod(0o644)
        assert find_cuda_checkpoint() is None  # not executable: not used
    finally:
        os.environ["PATH"] = old


def test_leases_and_top_show_the_job_beside_the_lease(fake_nvml, cli_env, tmp_path):
    from gpusd.model import GpuInfo, LeaseInfo
    from gpusd.views.top import _leases

    fake_nvml.write(make_gpus(1))
    env = job_env(cli_env, JOBLOG=str(tmp_path / "log"), STOPFILE=str(tmp_path / "stop"))
    p = subprocess.Popen([*GPUSD, "run", "--", sys.executable, str(job_script(tmp_path))], env=env, text=True)
    try:
        job = wait_until_sync(lambda: jobs_json(env), timeout=30)[0]["job"]
        table = gpusd_cli(["leases"], env=env).stdout
        assert "JOB" in table and str(job) in table
        g = GpuInfo(index=0, uuid="GPU-x", leases=[LeaseInfo(lease_id="l", pid=1, user="alice", job=str(job))])
        assert _leases(g) == f"alice job {job}"
        (tmp_path / "stop").touch()
        assert p.wait(timeout=30) == 0
    finally:
        _kill(p)


def _job_beside_a_holder(cli_env, tmp_path, log):
    """Two GPUs: the protocol job on one (it stops when STOPFILE appears), `sleep` leased on the other."""
    env = job_env(cli_env, JOBLOG=str(log), STOPFILE=str(tmp_path / "stop"))
    p = subprocess.Popen([*GPUSD, "run", "--", sys.executable, str(job_script(tmp_path))], env=env, text=True)
    holder = subprocess.Popen([*GPUSD, "run", "--", "sleep", "120"], env=env, text=True)
    try:
        wait_until_sync(lambda: len([j for j in jobs_json(env) if j["state"] == "running"]) == 2, timeout=30)
    except BaseException:
        _kill(p)
        _kill(holder)
        raise
    return env, p, holder


def _the_job(env):
    return [j for j in jobs_json(env) if "job.py" in str(j["command"])][0]["job"]


def test_a_waiting_job_stops_on_sigterm_and_grow_waits_if_asked(fake_nvml, cli_env, tmp_path):
    fake_nvml.write(make_gpus(2))
    log = tmp_path / "log"
    env, p, holder = _job_beside_a_holder(cli_env, tmp_path, log)
    waiting = None
    try:
        job = _the_job(env)
        # A job queued for GPUs stops on SIGTERM (exit 143), leaving nothing behind.
        waiting = subprocess.Popen([*GPUSD, "run", "--wait", "--", "true"], env=env, text=True,
                                   stderr=subprocess.PIPE)
        wait_until_sync(lambda: leases_json(env)["queued"], timeout=30)
        waiting.send_signal(signal.SIGTERM)
        assert waiting.wait(timeout=30) == 128 + 15
        assert "while waiting for GPUs" in waiting.stderr.read()
        assert leases_json(env)["queued"] == [] and len(jobs_json(env)) == 2
        # grow --wait: queued until the other job's GPU is free, then the job gets it.
        grow = subprocess.Popen([*GPUSD, "grow", str(job), "+1", "--wait", "--timeout", "60"], env=env, text=True)
        wait_until_sync(lambda: leases_json(env)["queued"], timeout=30)
        holder.send_signal(signal.SIGTERM)
        assert grow.wait(timeout=60) == 0
        changes = wait_until_sync(lambda: [e for e in log_events(log) if e["event"] == "change"], timeout=30)
        assert changes[-1]["gpus"] in ("0,1", "1,0")
        (tmp_path / "stop").touch()
        assert p.wait(timeout=30) == 0
    finally:
        for proc in (p, holder, waiting):
            if proc is not None:
                _kill(proc)


def test_an_abandoned_grow_wait_leaves_the_queue_and_grows_nothing(fake_nvml, cli_env, tmp_path):
    """Ctrl-C on `gpusd grow --wait`: the supervisor's place in the queue goes with it, and the job is
    not grown later, unasked, when a GPU frees."""
    fake_nvml.write(make_gpus(2))
    log = tmp_path / "log"
    env, p, holder = _job_beside_a_holder(cli_env, tmp_path, log)
    grow = None
    try:
        job = _the_job(env)
        grow = subprocess.Popen([*GPUSD, "grow", str(job), "+1", "--wait"], env=env, text=True)
        wait_until_sync(lambda: leases_json(env)["queued"], timeout=30)
        grow.send_signal(signal.SIGINT)
        grow.wait(timeout=30)
        wait_until_sync(lambda: leases_json(env)["queued"] == [], timeout=30)  # the wait ended with its asker
        holder.send_signal(signal.SIGTERM)
        holder.wait(timeout=30)
        r = gpusd_cli(["run", "--", "true"], env=env)  # the freed GPU is free for anyone, not grown into
        assert r.returncode == 0, r.stderr
        assert [len(j["indices"]) for j in jobs_json(env) if j["job"] == job] == [1]  # still one GPU
        assert not [e for e in log_events(log) if e["event"] == "change"]
        (tmp_path / "stop").touch()
        assert p.wait(timeout=30) == 0
    finally:
        for proc in (p, holder, grow):
            if proc is not None:
                _kill(proc)


def test_a_blocked_head_asks_for_room_again_only_once_the_jobs_asked_have_stopped(monkeypatch):
    """The queue calls its head's preemption each time it finds nothing qualifying: the supervisor
    asks again only when the jobs it asked have let go of their GPUs, and not more often than every
    PREEMPT_RETRY seconds, so that one checkpoint in progress does not cost more victims."""
    from gpusd.alloc.select import Constraints
    from gpusd.jobs import supervisor as sv
    from gpusd.jobs.record import JobRecord

    sup = sv.Supervisor(Constraints(count=1), ["true"], command="true", priority=2, simulate="1xA100-80GB")
    try:
        calls: list[int] = []
        monkeypatch.setattr(sup, "preempt_for", lambda n: calls.append(n) or ["aaaaaaaaaaaa"])
        stopping = [JobRecord(job="aaaaaaaaaaaa", pid=1, state="preempted", devices=["GPU-0"])]
        monkeypatch.setattr(sv, "list_jobs", lambda store=None: stopping)
        for _ in range(50):
            sup.preempt_when_blocked(1)
        assert calls == [1]  # once, however often the head looked
        monkeypatch.setattr(sv, "PREEMPT_RETRY", 0.0)
        sup.preempt_when_blocked(1)
        assert calls == [1]  # the job asked still holds its GPU (checkpointing within its grace)
        stopping[0] = JobRecord(job="aaaaaaaaaaaa", pid=1, state="queued", devices=[])
        sup.preempt_when_blocked(1)
        assert calls == [1, 1]  # it let go, and the head is still blocked: ask again
    finally:
        sup.close()


def test_a_killed_supervisor_leaves_no_job_behind(fake_nvml, cli_env, tmp_path):
    from gpusd.alloc.leases import lock_dir

    fake_nvml.write(make_gpus(1))
    p = subprocess.Popen([*GPUSD, "run", "--", "sleep", "120"], env=cli_env, start_new_session=True)
    try:
        job = wait_until_sync(lambda: jobs_json(cli_env), timeout=30)[0]["job"]
        assert (lock_dir() / f"job-{job}.sock").exists()
        os.killpg(p.pid, signal.SIGKILL)  # supervisor and command, no clean-up
        p.wait()
        assert jobs_json(cli_env) == []  # the record's lock went with it (and `jobs` cleans up)
        assert not (lock_dir() / f"job-{job}.json").exists() and not (lock_dir() / f"job-{job}.sock").exists()
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
