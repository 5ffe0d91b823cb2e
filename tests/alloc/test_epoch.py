"""Fencing tokens (gpusd.alloc.epoch, docs/allocation.md "Epochs"): every grant of a GPU carries an
epoch greater than every earlier grant's of that GPU, through the lock directory and through the
daemon alike, across daemon restarts and a clock stepped back; a hostile value in the shared lock
directory neither lowers it nor makes it overflow."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from authority_helpers import ServerThread
from conftest import gpusd_cli
from fakenvml import make_gpus

GPUSD = [sys.executable, "-m", "gpusd"]
SHOW = 'echo "$GPUSD_LEASE_EPOCH"; cat "$GPUSD_JOB_FILE"'


def grant(env: dict[str, str], faked: str | None = None) -> tuple[int, dict[str, object]]:
    """One `gpusd run` (its clock set back by ``faked``, libfaketime's syntax): the epoch in the
    command's environment, and its job file."""
    argv = [*GPUSD, "run", "--", "sh", "-c", SHOW]
    if faked is not None:
        argv = ["faketime", "-f", faked, *argv]
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    first, rest = r.stdout.split("\n", 1)
    return int(first), json.loads(rest)


def epoch_file(lock_dir: str, uuid: str, authority: bool = False) -> Path:
    return Path(lock_dir) / ("authority" if authority else "") / f"epoch-{uuid}"


def test_the_epoch_grows_with_every_grant_through_the_lock_directory(fake_nvml, cli_env) -> None:
    fake_nvml.write(make_gpus(1))
    env = dict(cli_env, GPUSD_LEASE_SOCKET="off")
    seen = []
    for _ in range(3):
        epoch, job = grant(env)
        assert job["epoch"] == epoch and [d["epoch"] for d in job["devices"]] == [epoch], job
        seen.append(epoch)
    assert seen == sorted(set(seen)), seen  # strictly growing
    assert 0 < seen[-1] < 2**53  # a JSON-safe integer


def test_a_clock_stepped_back_repeats_no_epoch(fake_nvml, cli_env) -> None:
    if shutil.which("faketime") is None:
        pytest.skip("libfaketime's faketime is not installed")
    fake_nvml.write(make_gpus(1))
    env = dict(cli_env, GPUSD_LEASE_SOCKET="off")
    before, _ = grant(env)
    after, _ = grant(env, faked="-1d")  # NTP stepping the clock back a day, or a VM resumed from a snapshot
    assert after > before


def test_a_hostile_value_in_the_shared_directory_neither_lowers_nor_overflows_the_epoch(fake_nvml, cli_env) -> None:
    (gpu,) = make_gpus(1)
    fake_nvml.write([gpu])
    env = dict(cli_env, GPUSD_LEASE_SOCKET="off")
    first, _ = grant(env)
    path = epoch_file(env["GPUSD_LOCK_DIR"], gpu.uuid)
    # lowered: the clock still keeps it growing
    path.write_text("1\n")
    second, _ = grant(env)
    assert second > first
    # far beyond the clock (an overflow meant): not believed, the epoch stays JSON-safe and growing
    path.write_text("9" * 20 + "\n")
    third, _ = grant(env)
    assert second < third < 2**53
    # junk, or a symlink in its place: ignored, never followed
    path.write_text("\x1b[2Jjunk\n")
    fourth, _ = grant(env)
    assert fourth > third
    target = Path(env["GPUSD_LOCK_DIR"]).parent / "elsewhere"
    target.write_text("00000000000000000005\n")
    path.unlink()
    path.symlink_to(target)
    fifth, _ = grant(env)
    assert fifth > fourth and target.read_text() == "00000000000000000005\n"


def test_the_epoch_grows_through_the_daemon_and_the_lock_directory_and_survives_a_daemon_restart(
        fake_nvml_inprocess, cli_env, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpusd.alloc import epoch

    (gpu,) = make_gpus(1)
    fake_nvml_inprocess.write([gpu])
    fallback = dict(cli_env, GPUSD_LEASE_SOCKET="off")
    seen = []
    server = ServerThread()
    try:
        e, _ = grant(cli_env)
        seen.append(e)
        holder = subprocess.Popen([*GPUSD, "run", "--", "sh", "-c", 'echo "$GPUSD_LEASE_EPOCH"; sleep 30'],
                                  env=cli_env, stdout=subprocess.PIPE, text=True, start_new_session=True)
        try:
            assert holder.stdout is not None
            line = holder.stdout.readline()
            seen.append(int(line))
            # the lease record says it too (gpusd leases --json)
            (lease,) = json.loads(gpusd_cli(["leases", "--json"], env=cli_env).stdout)["leases"]
            assert lease["epoch"] == seen[-1] and lease["device"] == gpu.uuid, lease
        finally:
            os.killpg(holder.pid, 9)
            holder.wait()
        e, _ = grant(fallback)  # a grant beside the daemon, in the shared lock directory
        seen.append(e)
    finally:
        server.stop()
    # the daemon's count is kept where only it can write, across its restart: a restarted daemon
    # whose clock is a day behind still grants a greater epoch
    assert epoch_file(cli_env["GPUSD_LOCK_DIR"], gpu.uuid, authority=True).exists()
    real = epoch.now_floor
    monkeypatch.setattr(epoch, "now_floor", lambda: real() - 86400 * 10**6)  # the daemon runs in this process
    server = ServerThread()
    try:
        e, _ = grant(cli_env)
        seen.append(e)
    finally:
        server.stop()
    assert seen == sorted(set(seen)), seen


def test_a_record_with_a_bad_epoch_still_counts() -> None:
    """A damaged epoch costs the epoch, never the lease: the GPU stays leased, shown without one."""
    from gpusd.alloc.leases import LeaseStore

    store = LeaseStore()
    with store.mutex():
        lease = store.acquire(["GPU-e1"])
    assert lease is not None
    try:
        (info,) = store.leases()
        assert info.epoch == lease.epoch and info.epoch is not None
        lease.update(epoch="\x1b[2J", epochs=[2**70])
        (info,) = store.leases()
        assert (info.lease_id, info.device, info.epoch) == (lease.lease_id, "GPU-e1", None)
    finally:
        lease.release()
