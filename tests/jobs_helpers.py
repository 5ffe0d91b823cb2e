"""Helpers for the job tests: a job script that uses the protocol (gpusd.job), and readers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO

GPUSD = [sys.executable, "-m", "gpusd"]

# A job: logs every GPU set it is told of, counts work in steps with a checkpoint file, stops when
# asked (SIGTERM: saves its checkpoint and exits RESTART_ME), finishes after STEPS steps.
JOB = r'''
import json, os, sys, time
from gpusd.job import Job, RESTART_ME
log = open(os.environ["JOBLOG"], "a")
def seen(j):
    log.write(json.dumps({"event": "change", "gpus": j.cuda_visible_devices, "gen": j.generation}) + "\n"); log.flush()
job = Job(on_change=seen)
ck = os.environ.get("CKPT")
step = int(open(ck).read()) if ck and os.path.exists(ck) else 0
log.write(json.dumps({"event": "start", "gpus": os.environ["CUDA_VISIBLE_DEVICES"], "step": step,
                      "restarts": os.environ.get("GPUSD_RESTART_COUNT")}) + "\n"); log.flush()
steps = int(os.environ.get("STEPS", "0"))
stopfile = os.environ.get("STOPFILE")
while True:
    if job.should_stop:
        if ck:
            open(ck, "w").write(str(step))
        log.write(json.dumps({"event": "stopped", "step": step}) + "\n"); log.flush()
        job.restart()
    if stopfile and os.path.exists(stopfile):
        break
    if steps and step >= steps:
        break
    time.sleep(0.02)
    step += 1
    if steps and ck and step % 10 == 0:
        pass
log.write(json.dumps({"event": "done", "step": step, "gpus": job.cuda_visible_devices}) + "\n"); log.flush()
if os.environ.get("RESULT"):
    open(os.environ["RESULT"], "w").write(str(step))
'''


def job_script(tmp: Path) -> Path:
    p = tmp / "job.py"
    p.write_text(JOB)
    os.chmod(p, 0o755)
    return p


def job_env(base: dict[str, str], **extra: str) -> dict[str, str]:
    env = dict(base)
    env["PYTHONPATH"] = str(REPO / "src")
    env.update(extra)
    return env


def log_events(path: Path) -> list[dict[str, object]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def jobs_json(env: dict[str, str]) -> list[dict[str, object]]:
    r = subprocess.run([*GPUSD, "jobs", "--all", "--json"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return list(json.loads(r.stdout)["jobs"])


def leases_json(env: dict[str, str]) -> dict[str, object]:
    r = subprocess.run([*GPUSD, "leases", "--json"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return dict(json.loads(r.stdout))


# -- a second user (as tests/alloc/test_local_trust.py does it), for the job trust tests -----------------
from other_user import MALLORY, AsUser, as_user  # noqa: E402,F401  (re-exported for the job tests)


def shared_dir() -> Path:
    """A directory like /tmp that every uid can use (pytest's tmp_path is private to root)."""
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="gpusd-jobs-trust-", dir="/tmp"))
    os.chmod(d, 0o1777)
    return d
