"""GPU processes no gpusd lease covers are marked **unleased** (issue 20, docs/allocation.md "Unleased
processes"): in the snapshot every view reads (devices, top, the dashboard) and in the usage history."""

from __future__ import annotations

import os
import time
from pathlib import Path

from daemon_helpers import make_snapshot
from gpusd.model import LeaseInfo, ProcessInfo


def snapshot_with(processes: list[ProcessInfo], leases: list[LeaseInfo]) -> object:
    snap = make_snapshot(1, hostname="h")
    snap.gpus[0].processes = processes
    snap.gpus[0].leases = leases
    return snap


def test_a_process_without_a_lease_is_marked_and_shown_as_unleased() -> None:
    from gpusd.alloc.leases import mark_unleased
    from gpusd.cli.table import render_host
    from gpusd.views.top import _procs

    me = os.getpid()
    lease = LeaseInfo(lease_id="ab12cd34", pid=os.getppid(), user="alice", device="GPU-h-0")  # our parent holds it
    snap = snapshot_with([ProcessInfo(pid=me, user="carol"),  # a descendant of the lease holder: covered
                          ProcessInfo(pid=999999, user="alice"),  # the lease's user (a remote reservation's job)
                          ProcessInfo(pid=999998, user="mallory")],  # nobody's lease
                         [lease])
    mark_unleased(snap)  # type: ignore[arg-type]
    assert [p.unleased for p in snap.gpus[0].processes] == [False, False, True]  # type: ignore[attr-defined]
    assert "unleased" in render_host(snap)  # type: ignore[arg-type]
    snap.gpus[0].processes = snap.gpus[0].processes[2:]  # type: ignore[attr-defined]
    assert "mallory" in _procs(snap.gpus[0]) and "unleased" in _procs(snap.gpus[0])  # type: ignore[attr-defined]
    # no lease at all on the GPU: every process there is unleased; the JSON carries the flag
    bare = snapshot_with([ProcessInfo(pid=999997, user="bob")], [])
    mark_unleased(bare)  # type: ignore[arg-type]
    assert bare.to_dict()["gpus"][0]["processes"][0]["unleased"] is True  # type: ignore[attr-defined]


def test_the_history_charges_unleased_gpu_time_to_its_user(tmp_path: Path) -> None:
    from gpusd.alloc.leases import mark_unleased
    from gpusd.usage import query
    from gpusd.usage.db import Retention, connect
    from gpusd.usage.recorder import Accountant
    from gpusd.usage.report import build

    conn = connect(tmp_path / "h.sqlite")
    acc = Accountant(conn, 10.0)
    t0 = time.time() - 3600
    for i in range(7):
        snap = snapshot_with([ProcessInfo(pid=999998, user="mallory", command="train.py")], [])
        mark_unleased(snap)  # type: ignore[arg-type]
        snap.timestamp = t0 + 10 * i  # type: ignore[attr-defined]
        snap.gpus[0].utilization_gpu = 90.0  # type: ignore[attr-defined]
        acc.add(snap)  # type: ignore[arg-type]
    answer = query.usage(conn, t0 - 60, t0 + 600, t0 + 600, Retention(), True, host="h", node_id="0")
    report = build([answer], by="user")
    (row,) = [r for r in report["rows"] if r["user"] == "mallory"]
    assert row["gpu_hours_unleased"] > 0 and row["gpu_hours_unleased"] == row["gpu_hours_used"]
    assert [j["kind"] for j in report["top_jobs"]] == ["unleased"]
