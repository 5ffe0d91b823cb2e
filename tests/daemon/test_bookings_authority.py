"""Where the daemon is the lease authority: once it holds a booking's GPUs for the booker, the booker's own
``gpusd run`` on the host gets them (the hold lets go for it; everyone else is still kept off them by the
booking: tests/daemon/test_bookings.py) (docs/pool.md, "Time")."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from authority_helpers import AuthorityDaemon
from conftest import REPO, gpusd_cli
from other_user import needs_root
from waiting import wait_until_sync

SIM = "2xA100-80GB"


@needs_root
def test_the_bookers_own_run_takes_the_held_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpusd.alloc.bookings import Booking
    from gpusd.alloc.leases import LeaseStore
    from gpusd.daemon import poolstate
    from gpusd.daemon.bookings import DIR_NAME
    from gpusd.inventory import open_backend

    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    monkeypatch.setenv("GPUSD_STATE_DIR", str(state))
    with open_backend(SIM) as b:
        uuids = [g.uuid for g in b.snapshot().gpus]
    now = time.time()
    booking = Booking("b00c1a55e0d2", "root", tuple(uuids), now + 2, now + 600, (0, 1), None, now)
    assert poolstate.write(state, booking.booking_id, booking.to_dict(), DIR_NAME)
    env = dict(os.environ, GPUSD_SIMULATE=SIM, PYTHONPATH=str(REPO / "src"))
    daemon = AuthorityDaemon(env, state, tmp_path / "daemon.log").start()
    try:
        def commands() -> set[str | None]:
            return {le.command for le in LeaseStore.authority().leases()}

        wait_until_sync(lambda: commands() == {f"booking {booking.booking_id}"}, timeout=60, what="the hold")
        # root's run (the booker's) is served by the daemon: the hold lets go and the run gets both GPUs
        r = gpusd_cli(["run", "-n", "2", "--", "sh", "-c", "echo $CUDA_VISIBLE_DEVICES"],
                      env={k: v for k, v in env.items() if k != "GPUSD_SIMULATE"})
        assert r.returncode == 0 and sorted(r.stdout.strip().split(",")) == ["0", "1"], r.stderr
        assert "hold" not in r.stderr
        log = (tmp_path / "daemon.log").read_text()
        assert "handed to its booker's request" in log
    finally:
        daemon.stop()
