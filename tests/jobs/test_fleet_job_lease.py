"""A fleet job's command starts only under a lease its host still holds: a `gpusd run --fleet` cut off
from the host until its lease expired (its ssh session got through only afterwards) must not run on
GPUs the host has granted again (a double grant in the fault campaign's split_long)."""
from __future__ import annotations

import os
from pathlib import Path


def test_a_fleet_job_whose_lease_ended_does_not_start_its_command(tmp_path: Path) -> None:
    from gpusd.alloc.handle import Holder
    from gpusd.alloc.leases import LeaseStore
    from gpusd.ids import JobId
    from gpusd.jobs.fleet import LEASE_GONE, FleetJob

    mark = tmp_path / "ran"
    cmd = ["sh", "-c", f"touch {mark}"]
    devices = [{"index": 0, "uuid": "GPU-aaaa", "label": "0"}]
    job = FleetJob(JobId.new(), "touch", "client")
    try:
        assert job.run(cmd, {"GPUSD_LEASE": "0123456789ab"}, devices, False) == LEASE_GONE
        assert not mark.exists()
        lease = LeaseStore().acquire(["GPU-aaaa"], holder=Holder(pid=os.getpid()))
        assert lease is not None
        try:
            assert job.run(cmd, {"GPUSD_LEASE": lease.lease_id}, devices, False) == 0
            assert mark.exists()
        finally:
            lease.release()
    finally:
        job.close()
