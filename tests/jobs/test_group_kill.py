"""Review: --on-change restart must stop the command's whole process group, not only its
leader: a child that outlives the leader keeps running on GPUs the job no longer holds."""
from __future__ import annotations

import subprocess
from pathlib import Path

from conftest import gpusd_cli
from fakenvml import make_gpus
from jobs_helpers import GPUSD, job_env, jobs_json
from waiting import wait_until_sync


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace_even_when_the_leader_exited(fake_nvml, cli_env,
                                                                                             tmp_path):
    fake_nvml.write(make_gpus(3))
    out, kids, stop = tmp_path / "out", tmp_path / "kids", tmp_path / "stop"
    script = (f'echo "$GPUSD_RESTART_COUNT" >> {out}; (trap "" TERM; exec sleep 300) & echo $! >> {kids}; '
              f'while [ ! -e {stop} ]; do sleep 0.1; done')
    env = job_env(cli_env)
    p = subprocess.Popen([*GPUSD, "run", "--on-change", "restart", "--grace", "1", "--", "sh", "-c", script],
                         env=env, text=True, stderr=subprocess.PIPE)
    try:
        wait_until_sync(lambda: out.exists() and kids.exists(), timeout=30)
        job = jobs_json(env)[0]["job"]
        r = gpusd_cli(["grow", str(job), "+1"], env=env)
        assert r.returncode == 0, r.stderr
        wait_until_sync(lambda: len(out.read_text().split()) == 2, timeout=30, what="the restart")
        old = int(kids.read_text().split()[0])
        # grace is 1 s: the old group's last member must be gone well within 20 s
        wait_until_sync(lambda: not _alive(old), timeout=20, what="the old start's SIGTERM-proof child killed")
    finally:
        stop.touch()
        for k in kids.read_text().split() if kids.exists() else []:
            try:
                import os
                os.kill(int(k), 9)
            except OSError:
                pass
        if p.poll() is None:
            p.kill()
            p.wait()
