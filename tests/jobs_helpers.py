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

# -- a fake NVIDIA cuda-checkpoint (docs/jobs.md): records its argv, keeps each pid's CUDA state ---------
# State per pid in DIR/state-PID (running -> locked -> checkpointed -> locked -> running, as the real tool's
# lock/checkpoint/restore/unlock); a wrong transition is an error, as it is for the tool.  DIR/fail-ACTION
# makes that action fail ("exit": exit 1 with the tool's message; "hang": no answer) — for restore only
# when it is asked to map devices; DIR/no-device-map makes --help read like r570 (no GPU migration).
FAKE_CUDA_CHECKPOINT = r'''#!PYTHON
import json, os, sys, time
d = os.environ["FAKE_CKPT_DIR"]
args = sys.argv[1:]
with open(os.path.join(d, "calls"), "a") as f:
    f.write(json.dumps(args) + "\n")
if args in (["--help"], ["-h"]):
    text = "--get-state --pid <pid>\n--action lock | checkpoint | restore | unlock --pid <pid> [--timeout <ms>]"
    if not os.path.exists(os.path.join(d, "no-device-map")):
        text += " [--device-map <uuids>]"
    print(text)
    sys.exit(0)
opt = {a: b for a, b in zip(args, args[1:]) if a.startswith("--")}
pid = opt.get("--pid", "")
if not pid.isdigit() or not os.path.exists(f"/proc/{pid}"):
    print(f"Invalid pid {pid!r}", file=sys.stderr)
    sys.exit(1)
path = os.path.join(d, f"state-{pid}")
state = open(path).read() if os.path.exists(path) else "running"
if "--get-state" in args:
    print(state)
    sys.exit(0)
action = opt.get("--action", "")
fail = os.path.join(d, f"fail-{action}")
if os.path.exists(fail) and (action != "restore" or "--device-map" in opt):
    if open(fail).read() == "hang":
        time.sleep(120)
    print(f'Could not {action} on process ID {pid}: "invalid argument"', file=sys.stderr)
    sys.exit(1)
steps = {"lock": ("running", "locked"), "checkpoint": ("locked", "checkpointed"),
         "restore": ("checkpointed", "locked"), "unlock": ("locked", "running")}
if action not in steps or state != steps[action][0]:
    print(f"Could not {action} on process ID {pid}: \"invalid state\" ({state})", file=sys.stderr)
    sys.exit(1)
open(path, "w").write(steps[action][1])
'''


def fake_cuda_checkpoint(tmp: Path) -> tuple[Path, Path]:
    """(a directory holding the fake ``cuda-checkpoint``, for PATH; the directory of its records)."""
    bindir, state = tmp / "fakebin", tmp / "fake-ckpt"
    bindir.mkdir()
    state.mkdir()
    tool = bindir / "cuda-checkpoint"
    tool.write_text(FAKE_CUDA_CHECKPOINT.replace("PYTHON", sys.executable, 1))
    tool.chmod(0o755)
    return bindir, state


def fake_calls(state: Path) -> list[list[str]]:
    """Every argv the fake tool was called with, in order."""
    calls = state / "calls"
    return [json.loads(x) for x in calls.read_text().splitlines()] if calls.exists() else []


def fake_state(state: Path, pid: int) -> str:
    p = state / f"state-{pid}"
    return p.read_text() if p.exists() else "running"
