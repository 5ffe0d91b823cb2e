"""The remote side of a fleet run (issue 13 item 1, docs/jobs.md "Fleet runs"), on this machine without
namespaces: ``gpusd fleet-job`` registers the job and runs the command under the job protocol; bad
arguments are refused before anything runs; the ssh script falls back to the plain command where the
host's gpusd has no ``fleet-job``; hostile record fields are bounded and shown sanitised."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import gpusd_cli
from waiting import wait_until_sync

GPUSD = [sys.executable, "-m", "gpusd"]
UUIDS = ["GPU-aaaaaaaa-0000-0000-0000-000000000001", "GPU-aaaaaaaa-0000-0000-0000-000000000003"]
DEVICES = json.dumps([{"index": 1, "uuid": UUIDS[0], "label": "1"}, {"index": 3, "uuid": UUIDS[1], "label": "3"}])


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2] / "src")
    env.update(extra)
    return env


def _jobs(env: dict[str, str]) -> list[dict[str, object]]:
    r = gpusd_cli(["jobs", "--all", "--json"], env=env)
    assert r.returncode == 0, r.stderr
    return list(json.loads(r.stdout)["jobs"])


def test_fleet_job_registers_the_job_and_runs_the_command_under_the_protocol(tmp_path: Path) -> None:
    """While the command runs, gpusd jobs lists it (its GPUs here, host = the asking machine, the lease);
    the command sees GPUSD_JOB_ID and a job file naming its GPUs; exit 75 starts it again with the
    restart count one higher; grow is refused with the reason; its exit status is gpusd's; the record
    goes with it."""
    go, seen = tmp_path / "go", tmp_path / "seen"
    script = (f'echo "$GPUSD_JOB_ID $GPUSD_RESTART_COUNT $GPUSD_RESTART_STATUS" >> {seen}; '
              f'cp "$GPUSD_JOB_FILE" {tmp_path}/file.json; '
              f'[ "$GPUSD_RESTART_COUNT" = 0 ] && exit 75; while [ ! -e {go} ]; do sleep 0.05; done; exit 9')
    env = _env(CUDA_VISIBLE_DEVICES="1,3")  # what the remote shell exports before it runs gpusd fleet-job
    p = subprocess.Popen([*GPUSD, "fleet-job", "--job", "0123456789ab", "--from", "laptop-7", "--lease",
                          "feedbeef0001", "--devices", DEVICES, "--", "sh", "-c", script], env=env, text=True)
    try:
        lines = wait_until_sync(lambda: seen.exists() and len(seen.read_text().splitlines()) == 2 and
                                seen.read_text().splitlines(), timeout=30)
        assert lines == ["0123456789ab 0 75", "0123456789ab 1 75"]
        (job,) = wait_until_sync(lambda: [j for j in _jobs(env) if j["restarts"] == 1], timeout=30)
        assert (job["job"], job["state"], job["host"], job["lease"], job["pid"]) == (
            "0123456789ab", "running", "laptop-7", "feedbeef0001", p.pid)
        assert job["indices"] == [1, 3] and job["devices"] == UUIDS and job["labels"] == []
        assert job["uid"] == os.geteuid() and "sh -c" in str(job["command"])
        told = json.loads((tmp_path / "file.json").read_text())
        assert told["job"] == "0123456789ab" and told["cuda_visible_devices"] == "1,3" and told["restarts"] == 1
        assert [d["uuid"] for d in told["devices"]] == UUIDS
        # its GPUs are the remote daemon's lease: grow and shrink say so (there is no supervisor to ask)
        r = gpusd_cli(["grow", "0123", "+1"], env=env)
        assert r.returncode == 1 and "fleet run (asked from laptop-7)" in r.stderr, r.stderr
        go.touch()
        assert p.wait(timeout=30) == 9
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert _jobs(env) == []


@pytest.mark.parametrize("args, why", [
    (["--job", "../../etc", "--devices", DEVICES], "not a job id"),
    (["--job", "0123456789ab", "--devices", "{not json"], "--devices: not JSON"),
    (["--job", "0123456789ab", "--devices", "[]"], "a list of 1 to 64"),
    (["--job", "0123456789ab", "--devices", json.dumps([{"index": -1, "uuid": "GPU-1"}])], "index"),
    (["--job", "0123456789ab", "--devices", json.dumps([{"index": 0, "uuid": "GPU-\x1b[2J"}])], "UUID"),
    (["--job", "0123456789ab", "--devices", json.dumps([{"index": 0, "uuid": "G"}] * 65)], "a list of 1 to 64"),
    (["--job", "0123456789ab", "--devices", DEVICES, "--lease=-rf; x"], "--lease: not a lease id"),
])
def test_fleet_job_refuses_bad_arguments_before_running_anything(tmp_path: Path, args: list[str], why: str) -> None:
    marker = tmp_path / "ran"
    r = gpusd_cli(["fleet-job", *args, "--", "touch", str(marker)], env=_env())
    assert r.returncode == 2 and why in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not marker.exists() and _jobs(_env()) == []


def test_the_asking_host_name_is_bounded_and_printable(tmp_path: Path) -> None:
    """``--from`` comes from the other machine: at most 255 printable characters in the record, and
    the job is listed (not skipped) all the same."""
    hostile = "evil\x1b]0;pwned\x07" + "h" * 1000
    script = f'while [ ! -e {tmp_path}/go ]; do sleep 0.05; done'
    p = subprocess.Popen([*GPUSD, "fleet-job", "--job", "0123456789ab", "--from", hostile, "--devices", DEVICES,
                          "--", "sh", "-c", script], env=_env())
    try:
        (job,) = wait_until_sync(lambda: _jobs(_env()), timeout=30)
        host = str(job["host"])
        assert len(host) == 255 and host.isprintable() and "\x1b" not in host, host
        (tmp_path / "go").touch()
        assert p.wait(timeout=30) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def _script_run(tmp_path: Path, gpusd: str | None) -> subprocess.CompletedProcess[str]:
    """The ssh script of a fleet run, run by sh here with ``gpusd`` (a fake) on its PATH, or none."""
    from gpusd.cli.pool import remote_script

    bindir = tmp_path / "bin"
    bindir.mkdir()
    if gpusd is not None:
        (bindir / "gpusd").write_text(gpusd)
        (bindir / "gpusd").chmod(0o755)
    script = remote_script({"CUDA_VISIBLE_DEVICES": "1,3"}, ["sh", "-c", 'echo "plain $CUDA_VISIBLE_DEVICES"'],
                           ["gpusd", "fleet-job", "--job", "0123456789ab", "--devices", DEVICES, "--"])
    return subprocess.run(["sh", "-c", script], env={"PATH": f"{bindir}:/usr/bin:/bin"}, capture_output=True,
                          text=True, timeout=30)


@pytest.mark.parametrize("gpusd, expect", [
    (None, "plain 1,3"),  # no gpusd on that host's PATH
    ("#!/bin/sh\necho \"usage: invalid choice: '$1'\" >&2; exit 2\n", "plain 1,3"),  # a gpusd without fleet-job
    ("#!/bin/sh\n[ \"$2\" = --help ] && exit 0\nshift; echo \"fleet-job $*\"\n", "fleet-job"),  # one with it
])
def test_the_remote_script_runs_the_command_plain_where_gpusd_has_no_fleet_job(tmp_path: Path, gpusd: str | None,
                                                                               expect: str) -> None:
    r = _script_run(tmp_path, gpusd)
    first, *rest = r.stderr.splitlines()
    assert r.returncode == 0 and r.stdout.startswith(expect), (r.stdout, r.stderr)
    assert first.split()[0] == "gpusd-remote-pid" and (first.split()[2:] == ["job"]) == (expect == "fleet-job")
    assert rest == []  # the probe says nothing


def test_labels_in_a_job_record_are_bounded_and_shown_sanitised(tmp_path: Path) -> None:
    """A record's labels (a fleet run on the asking machine: HOST:INDEX) are another user's words: a
    label with an escape sequence is shown without it; an over-long one makes the record skipped."""
    import fcntl

    from gpusd.alloc.leases import LeaseStore
    from gpusd.jobs.record import list_jobs

    store = LeaseStore()
    store.ensure()
    fds = []
    for job, labels in (("a" * 12, ["node\x1b[2J-1:0"]), ("b" * 12, ["x" * 400])):
        fd = os.open(store.dir / f"job-{job}.json", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, json.dumps({"job": job, "pid": os.getpid(), "devices": [], "indices": [], "priority": 1,
                                 "state": "running", "restarts": 0, "labels": labels, "host": "h"}).encode())
        fcntl.flock(fd, fcntl.LOCK_EX)
        fds.append(fd)
    try:
        assert [r.job for r in list_jobs(store)] == ["a" * 12]
        r = gpusd_cli(["jobs", "--all"], env=_env())
        assert r.returncode == 0 and "node-1:0" in r.stdout and "\x1b" not in r.stdout, r.stdout
    finally:
        for fd in fds:
            os.close(fd)
