"""What a job waiting for GPUs has imported: only what waiting needs (the queue, the GPUs' readings, the
job's record and control socket), not what only starting and running the command needs (subprocess,
logging, the checkpoint tool) -- every queued job pays for its imports before it runs, on every core the
queue shares (docs/jobs.md, "What a queued job costs")."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from fakenvml import make_gpus
from jobs_helpers import GPUSD, job_env, leases_json
from waiting import wait_until_sync

# Runs gpusd's CLI; when the trigger file appears, writes the names of the modules imported so far.
PROBE = r"""
import os, sys, threading, time
def dump():
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.02)
    with open(sys.argv[2] + ".tmp", "w") as f:
        f.write("\n".join(sorted(sys.modules)))
    os.replace(sys.argv[2] + ".tmp", sys.argv[2])
threading.Thread(target=dump, daemon=True).start()
from gpusd.cli import main
sys.exit(main(sys.argv[3:]))
"""

# gpusd's modules a waiting job has imported, and no more: a new one here is a cost every queued job pays
# (add it only where waiting needs it; what only a running job needs is imported when the command starts)
WAITING = {
    "gpusd", "gpusd._version", "gpusd.alloc", "gpusd.alloc.api", "gpusd.alloc.authority", "gpusd.alloc.env",
    "gpusd.alloc.candidate",  # alloc.select's Candidate, kept below it and alloc.placement
    # a waiting job must not take a GPU booked for someone else
    "gpusd.sanitize", "gpusd.alloc.backend", "gpusd.alloc.bookings",
    "gpusd.jobs.containers",  # the command is read once: a container run is rewritten for its GPUs
    "gpusd.alloc.handle", "gpusd.alloc.inotify", "gpusd.alloc.leases", "gpusd.alloc.leaseview",
    "gpusd.alloc.lockdir", "gpusd.alloc.placement", "gpusd.alloc.policy", "gpusd.alloc.priority",
    "gpusd.alloc.queue", "gpusd.alloc.runner", "gpusd.alloc.select", "gpusd.alloc.startgate", "gpusd.cli",
    "gpusd.cli.alloc", "gpusd.cli.exits", "gpusd.cli.jobs", "gpusd.cli.options", "gpusd.cli.trust", "gpusd.errors",
    "gpusd.identity", "gpusd.ids", "gpusd.inventory", "gpusd.inventory.base", "gpusd.inventory.combined",
    "gpusd.inventory.lost", "gpusd.inventory.nvml", "gpusd.inventory.nvmlfast", "gpusd.inventory.processes",
    "gpusd.inventory.vendors", "gpusd.inventory.window", "gpusd.jobs", "gpusd.jobs.child", "gpusd.jobs.control",
    "gpusd.jobs.record", "gpusd.jobs.state", "gpusd.jobs.supervisor", "gpusd.model", "gpusd.record",
    "gpusd.topology", "gpusd.wire", "gpusd.wire.aio",
}
# what only starting, running or stopping the command needs, or no job at all
NEVER_WHILE_WAITING = {"subprocess", "logging", "asyncio", "concurrent.futures", "aiohttp", "zeroconf", "ssl",
                       "gpusd.jobs.checkpoint", "gpusd.alloc.cpus", "gpusd.daemon", "gpusd.discovery"}


def _kill(p: subprocess.Popen[str] | None) -> None:
    if p is not None and p.poll() is None:
        p.kill()
        p.wait()


def test_a_job_waiting_for_gpus_imports_only_what_waiting_needs(fake_nvml, cli_env, tmp_path: Path) -> None:
    fake_nvml.write(make_gpus(1))
    env = job_env(cli_env)
    holder = subprocess.Popen([*GPUSD, "run", "--", "sleep", "120"], env=env, text=True)
    waiting = None
    try:
        wait_until_sync(lambda: leases_json(env)["leases"], timeout=30)
        trigger, out = tmp_path / "now", tmp_path / "modules"
        waiting = subprocess.Popen([sys.executable, "-c", PROBE, str(trigger), str(out), "run", "--wait", "--",
                                    "true"], env=env, text=True)
        wait_until_sync(lambda: leases_json(env)["queued"], timeout=30)  # it is in the queue, waiting
        trigger.touch()
        wait_until_sync(out.exists, timeout=30)
        modules = set(out.read_text().split())
    finally:
        _kill(waiting)
        _kill(holder)
    assert "gpusd.jobs.supervisor" in modules  # it is a job's supervisor, queued
    assert not modules & NEVER_WHILE_WAITING, sorted(modules & NEVER_WHILE_WAITING)
    ours = {m for m in modules if m == "gpusd" or m.startswith("gpusd.")}
    assert ours == WAITING, f"more: {sorted(ours - WAITING)}, fewer: {sorted(WAITING - ours)}"
