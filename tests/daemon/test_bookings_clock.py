"""A booking's hold survives a step of the daemon's wall clock without granting a GPU twice (docs/pool.md,
"Clocks"): libfaketime steps the wall clock of a real daemon process forward past WHEN while a
backfilled job (admitted for the WHEN that was further away) still holds a booked GPU; the daemon sees
the step, and holds the booked GPUs only once that job's lease has ended."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from authority_helpers import AuthorityDaemon
from waiting import wait_until_sync

LIB = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"
SIM = "2xA100-80GB"

pytestmark = pytest.mark.skipif(not os.path.exists(LIB) or shutil.which("faketime") is None,
                                reason="needs libfaketime (Debian's faketime package)")


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def test_a_wall_clock_step_past_when_waits_for_the_backfilled_job_and_never_grants_twice(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpusd.alloc.api import LeaseRequest, allocate
    from gpusd.alloc.bookings import Booking
    from gpusd.alloc.leases import LeaseStore
    from gpusd.alloc.select import Constraints
    from gpusd.daemon import poolstate
    from gpusd.daemon.bookings import DIR_NAME
    from gpusd.inventory import open_backend

    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    monkeypatch.setenv("GPUSD_STATE_DIR", str(state))  # where lease requests read the daemon's bookings
    with open_backend(SIM) as b:
        uuids = [g.uuid for g in b.snapshot().gpus]
    now = time.time()
    booking = Booking("b00c1a55e0d1", "alice", tuple(uuids), now + 60, now + 600, (0, 1), "step test", now)
    assert poolstate.write(state, booking.booking_id, booking.to_dict(), DIR_NAME)
    clock = tmp_path / "clock"
    _write(clock, "+0\n")
    env = dict(os.environ, GPUSD_SIMULATE=SIM, LD_PRELOAD=LIB, FAKETIME_TIMESTAMP_FILE=str(clock),
               FAKETIME_DONT_FAKE_MONOTONIC="1", FAKETIME_NO_CACHE="1")
    log = tmp_path / "daemon.log"
    daemon = AuthorityDaemon(env, state, log).start()
    try:
        wait_until_sync(lambda: (state / "bookings.json").exists(), timeout=30, what="the bookings summary")
        # a job with a 20 s limit (plus grace) fits before WHEN (60 s away): it gets GPU 0
        job = allocate(LeaseRequest(Constraints.build(count=1, time_limit=20.0), simulate=SIM))
        [mine] = job.uuids
        # the daemon's wall clock jumps 90 s forward: WHEN is past for it, while the job still holds GPU 0
        _write(clock, "+90\n")
        wait_until_sync(lambda: "the wall clock stepped by +9" in log.read_text(), timeout=30, what="the step")
        wait_until_sync(lambda: "cannot be held yet" in log.read_text(), timeout=30, what="the late hold")

        def holders() -> dict[str, list[str]]:
            out: dict[str, list[str]] = {}
            for le in LeaseStore().leases():
                out.setdefault(str(le.device), []).append(str(le.lease_id))
            return out

        held = holders()
        assert held == {mine: [job.lease.lease_id]}, held  # GPU 0 is the job's alone; the hold took nothing
        job.release()
        # its lease ended: the hold takes both booked GPUs, for alice (waited for until both records are
        # written: between a lock taken and its record, a listing names the lock's holder by its uid alone)
        wait_until_sync(lambda: len(holders()) == 2 and "-" not in sum(holders().values(), []), timeout=60,
                        what="the hold")
        leases = LeaseStore().leases()
        assert {le.user for le in leases} == {"alice"} and {le.command for le in leases} == {
            f"booking {booking.booking_id}"}
        assert all(len(v) == 1 for v in holders().values())
    finally:
        daemon.stop()
