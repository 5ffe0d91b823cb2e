"""A GPU process in a container cgroup is named with its container (docs/inventory.md, "Containers"): in
``devices --json`` and ``devices``, ``top``, ``/metrics`` (``gpusd_gpu_process_info``), and with its owner where a
gpusd job started the container.  The cgroup is a real one (a cgroup v1 or v2 directory named as docker names
its containers), made here, so no runtime is needed; the process is listed on a GPU by the fake NVML."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from fakenvml import FakeProcess, make_gpus
from jobs_helpers import GPUSD, job_env

ROOTS = ("/sys/fs/cgroup/pids", "/sys/fs/cgroup/unified", "/sys/fs/cgroup")


def _cgroup_root() -> str | None:
    if os.geteuid() != 0:
        return None
    for root in ROOTS:
        if os.path.exists(f"{root}/cgroup.procs") and os.access(root, os.W_OK):
            return root
    return None


@pytest.fixture
def in_container() -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A process in a cgroup named /docker/<64 hex> (docker's cgroupfs driver)."""
    root = _cgroup_root()
    if root is None:
        pytest.skip("needs root and a writable cgroup hierarchy to make a container's cgroup")
    cid = secrets.token_hex(32)
    d = Path(root) / "docker" / cid
    made_parent = not d.parent.exists()
    d.mkdir(parents=True)
    p = subprocess.Popen(["sleep", "300"])
    try:
        (d / "cgroup.procs").write_text(str(p.pid))
        yield p, cid
    finally:
        p.kill()
        p.wait()
        for _ in range(50):  # the cgroup empties once the kernel has reaped it
            try:
                d.rmdir()
                break
            except OSError:
                time.sleep(0.02)
        if made_parent:
            try:
                d.parent.rmdir()
            except OSError:
                pass


def _gpus_with(pid: int) -> list[Any]:
    gpus = make_gpus(2)
    gpus[1].processes = [FakeProcess(pid, 3 << 30)]
    return gpus


def test_a_container_process_is_shown_with_its_container_id(fake_nvml, cli_env, in_container):
    p, cid = in_container
    fake_nvml.write(_gpus_with(p.pid))
    env = job_env(cli_env)
    r = subprocess.run([*GPUSD, "devices", "--json"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    [proc] = [q for g in json.loads(r.stdout)["gpus"] for q in g["processes"]]
    assert proc["pid"] == p.pid and proc["container"] == cid and proc["container_runtime"] == "docker"
    r = subprocess.run([*GPUSD, "devices"], env=env, capture_output=True, text=True, timeout=60)
    assert f"[docker {cid[:12]}]" in r.stdout, r.stdout


def test_top_and_metrics_name_the_container(fake_nvml_inprocess, in_container):
    from prometheus_client.parser import text_string_to_metric_families

    from gpusd.daemon.metrics import LeaseCollector, make_registry, render
    from gpusd.inventory.nvml import NvmlBackend
    from gpusd.views.top import _procs

    p, cid = in_container
    fake_nvml_inprocess.write(_gpus_with(p.pid))
    b = NvmlBackend()
    try:
        snap = b.snapshot()
    finally:
        b.close()
    g = snap.gpus[1]
    assert f"[docker {cid[:12]}]" in _procs(g)
    text = render(make_registry(lambda: [snap], process_metrics=False, extra=[LeaseCollector(lambda: [snap])]))
    fams = {f.name: f for f in text_string_to_metric_families(text.decode())}
    [sample] = fams["gpusd_gpu_process_info"].samples
    assert sample.labels["pid"] == str(p.pid) and sample.labels["container"] == cid
    assert sample.labels["container_runtime"] == "docker" and sample.labels["user"] == ""  # private


def test_the_gpusd_job_that_started_the_container_owns_it_and_its_lease_covers_it(in_container):
    from daemon_helpers import make_snapshot
    from gpusd.alloc.leases import mark_unleased
    from gpusd.jobs.containers import name_containers
    from gpusd.jobs.record import JobRecord
    from gpusd.model import LeaseInfo, ProcessInfo

    p, cid = in_container
    snap = make_snapshot(1, hostname="h")
    snap.gpus[0].processes = [ProcessInfo(pid=p.pid, user="root", container=cid, container_runtime="docker")]
    snap.gpus[0].leases = [LeaseInfo(lease_id="ab12cd34", pid=999999, user="alice", device=snap.gpus[0].uuid)]
    mark_unleased(snap)
    assert snap.gpus[0].processes[0].unleased  # root's process under dockerd: no descendant of alice's job
    job = JobRecord(job="j-0123456789ab", pid=999999, user="alice", container=cid, lease="ab12cd34")
    name_containers(snap, [job])
    [proc] = snap.gpus[0].processes
    assert proc.container_owner == "alice" and not proc.unleased
    # two records claiming one container: neither is believed
    proc.container_owner, proc.unleased = None, True
    name_containers(snap, [job, JobRecord(job="j-ba9876543210", pid=1, user="mallory", container=cid)])
    assert proc.container_owner is None and proc.unleased


def test_the_usage_report_names_the_container(tmp_path: Path) -> None:
    from daemon_helpers import make_snapshot
    from gpusd.alloc.leases import mark_unleased
    from gpusd.model import ProcessInfo
    from gpusd.usage import query
    from gpusd.usage.db import Retention, connect
    from gpusd.usage.recorder import Accountant
    from gpusd.usage.report import build

    cid = "ab" * 32
    conn = connect(tmp_path / "h.sqlite")
    acc = Accountant(conn, 10.0)
    t0 = time.time() - 3600
    for i in range(7):
        snap = make_snapshot(1, hostname="h")
        snap.gpus[0].processes = [ProcessInfo(pid=999998, user="root", command="python train.py", container=cid,
                                              container_runtime="docker")]
        mark_unleased(snap)
        snap.timestamp = t0 + 10 * i
        snap.gpus[0].utilization_gpu = 90.0
        acc.add(snap)
    answer = query.usage(conn, t0 - 60, t0 + 600, t0 + 600, Retention(), True, host="h", node_id="0")
    [job] = build([answer], by="user")["top_jobs"]
    assert job["command"] == f"[docker {cid[:12]}] python train.py"
