"""``gpusd adopt PID`` (docs/allocation.md, "Adopting a running process"): a running GPU process becomes a
lease on the GPUs NVML lists it on, held by a small holder until the process exits; each refusal has a
one-line reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from fakenvml import FakeProcess, fake_uuid, make_gpus
from gpusd.alloc.lockdir import user_name
from jobs_helpers import GPUSD, job_env, leases_json
from other_user import MALLORY, as_user, needs_root
from waiting import wait_until_sync


def _leases(env: dict[str, str]) -> list[dict[str, object]]:
    return list(leases_json(env)["leases"])  # type: ignore[arg-type]


def _stray(fake_nvml, on: int = 1, n: int = 3) -> subprocess.Popen[bytes]:  # type: ignore[no-untyped-def]
    """A process NVML lists on GPU ``on`` (started without gpusd)."""
    p = subprocess.Popen(["sleep", "300"])
    gpus = make_gpus(n)
    gpus[on].processes = [FakeProcess(p.pid, 2 << 30)]
    fake_nvml.write(gpus)
    return p


def _adopt(env: dict[str, str], *args: str, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*GPUSD, "adopt", *args], env=env, capture_output=True, text=True, timeout=120,
                          **kw)  # type: ignore[call-overload]


def test_adopt_makes_a_lease_on_the_processs_gpu_that_ends_when_it_exits(fake_nvml, cli_env):
    env = job_env(cli_env)
    p = _stray(fake_nvml)
    try:
        r = _adopt(env, str(p.pid), "--note", "started before gpusd", "--json")
        assert r.returncode == 0, r.stderr
        answer = json.loads(r.stdout)
        assert answer["devices"] == [fake_uuid(1)]
        [le] = _leases(env)
        assert le["device"] == fake_uuid(1) and le["lease_id"] == answer["lease"]
        assert le["user"] == "root" and "started before gpusd" in str(le["command"])
        assert le["pid"] == answer["holder"]  # the small holder, not the CLI that has exited
        p.kill()
        p.wait()
        wait_until_sync(lambda: _leases(env) == [], timeout=30, what="the lease's end with the process")
    finally:
        p.kill()
        p.wait()


def test_the_adopted_process_is_no_longer_shown_unleased(fake_nvml, cli_env):
    env = job_env(cli_env)
    p = _stray(fake_nvml)
    try:
        r = subprocess.run([*GPUSD, "devices"], env=env, capture_output=True, text=True, timeout=60)
        assert f"unleased (gpusd adopt {p.pid})" in r.stdout, r.stdout
        assert _adopt(env, str(p.pid)).returncode == 0
        r = subprocess.run([*GPUSD, "devices", "--json"], env=env, capture_output=True, text=True, timeout=60)
        [proc] = [q for g in json.loads(r.stdout)["gpus"] for q in g["processes"]]
        assert proc["pid"] == p.pid and not proc.get("unleased")
    finally:
        p.kill()
        p.wait()


def test_a_process_on_no_gpu_is_refused(fake_nvml, cli_env):
    env = job_env(cli_env)
    fake_nvml.write(make_gpus(2))
    r = _adopt(env, str(os.getpid()))
    assert r.returncode != 0 and "runs on no GPU" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert _leases(env) == []


def test_a_gpu_leased_to_someone_else_is_refused_naming_the_lease(fake_nvml, cli_env):
    env = job_env(cli_env)
    p = _stray(fake_nvml)
    holder = subprocess.Popen([*GPUSD, "run", "--include", "1", "--", "sleep", "300"], env=env)
    try:
        [le] = wait_until_sync(lambda: _leases(env), timeout=30, what="the other lease")
        r = _adopt(env, str(p.pid))
        assert r.returncode != 0 and "leased already" in r.stderr, r.stderr
        assert str(le["lease_id"]) in r.stderr and fake_uuid(1) in r.stderr
        assert len(_leases(env)) == 1
    finally:
        for q in (p, holder):
            q.kill()
            q.wait()


def test_the_policy_cap_refuses_an_adoption_beyond_it(fake_nvml, cli_env, tmp_path: Path):
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"max_gpus_per_user": 1}))
    env = job_env(cli_env, GPUSD_POLICY=str(policy))
    p = _stray(fake_nvml)
    holder = subprocess.Popen([*GPUSD, "run", "--include", "0", "--", "sleep", "300"], env=env)
    try:
        wait_until_sync(lambda: _leases(env), timeout=30, what="the first lease")
        r = _adopt(env, str(p.pid))
        assert r.returncode != 0 and "1" in r.stderr and "cap" in r.stderr.lower(), r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
        assert [le["device"] for le in _leases(env)] == [fake_uuid(0)]
    finally:
        for q in (p, holder):
            q.kill()
            q.wait()


@needs_root
def test_another_users_process_is_refused(fake_nvml, cli_env):
    from gpusd.alloc.adopt import check

    p = _stray(fake_nvml)  # root's
    try:
        said = as_user(MALLORY, lambda: check(p.pid))
        assert said.startswith("error ConfigError") and "belongs to root" in said and "only its owner" in said, said
    finally:
        p.kill()
        p.wait()


@needs_root
def test_root_adopting_a_users_process_makes_that_user_the_holder(fake_nvml, cli_env):
    env = job_env(cli_env)
    p = subprocess.Popen(["setpriv", f"--reuid={MALLORY}", f"--regid={MALLORY}", "--clear-groups", "sleep", "300"])
    try:
        gpus = make_gpus(2)
        gpus[0].processes = [FakeProcess(p.pid, 1 << 30)]
        fake_nvml.write(gpus)
        wait_until_sync(lambda: os.stat(f"/proc/{p.pid}").st_uid == MALLORY, timeout=10, what="setpriv")
        r = _adopt(env, str(p.pid), "--json")
        assert r.returncode == 0, r.stderr
        [le] = _leases(env)
        assert le["user"] == user_name(MALLORY) and le["device"] == fake_uuid(0), le
    finally:
        p.kill()
        p.wait()
    wait_until_sync(lambda: _leases(env) == [], timeout=30, what="the lease's end")


def test_adopt_is_a_thin_cli_over_the_library() -> None:
    import gpusd.cli.adopt as cli

    assert "alloc.adopt" in Path(cli.__file__).read_text() and sys.modules.get("gpusd.cli.adopt") is cli


def test_through_the_lease_authority_the_daemon_holds_the_adopted_lease_until_the_process_exits(
        fake_nvml_inprocess, cli_env):
    from authority_helpers import ServerThread

    server = ServerThread()
    env = job_env(cli_env)
    p = _stray(fake_nvml_inprocess)
    try:
        r = _adopt(env, str(p.pid), "--json")
        assert r.returncode == 0, r.stderr
        [le] = _leases(env)
        assert le["device"] == fake_uuid(1) and not le.get("outside_authority")
        assert le["pid"] == json.loads(r.stdout)["holder"]  # the daemon's record names the holder (SO_PEERCRED)
        p.kill()
        p.wait()
        wait_until_sync(lambda: _leases(env) == [], timeout=30, what="the lease's end with the process")
    finally:
        p.kill()
        p.wait()
        server.stop()


@needs_root
def test_through_the_authority_root_adopting_a_users_process_asks_as_that_user(
        fake_nvml_inprocess, cli_env, shared_tmp: Path, monkeypatch):
    from authority_helpers import ServerThread

    sock = shared_tmp / "run" / "lease.sock"  # a socket every user can reach, as /run/gpusd/lease.sock is
    monkeypatch.setenv("GPUSD_LEASE_SOCKET", str(sock))
    server = ServerThread()
    env = job_env(cli_env, GPUSD_LEASE_SOCKET=str(sock))
    p = subprocess.Popen(["setpriv", f"--reuid={MALLORY}", f"--regid={MALLORY}", "--clear-groups", "sleep", "300"])
    try:
        gpus = make_gpus(2)
        gpus[0].processes = [FakeProcess(p.pid, 1 << 30)]
        fake_nvml_inprocess.write(gpus)
        wait_until_sync(lambda: os.stat(f"/proc/{p.pid}").st_uid == MALLORY, timeout=10, what="setpriv")
        r = _adopt(env, str(p.pid), "--json")
        assert r.returncode == 0, r.stderr
        [le] = _leases(env)
        assert le["user"] == user_name(MALLORY) and not le.get("outside_authority"), le
        assert os.stat(f"/proc/{json.loads(r.stdout)['holder']}").st_uid == MALLORY  # by the kernel's word
    finally:
        p.kill()
        p.wait()
    try:
        wait_until_sync(lambda: _leases(env) == [], timeout=30, what="the lease's end")
    finally:
        server.stop()


def test_a_process_on_a_mig_slice_is_adopted_on_that_slice(fake_nvml, cli_env):
    from fakenvml import FakeMig

    env = job_env(cli_env)
    p = subprocess.Popen(["sleep", "300"])
    try:
        gpus = make_gpus(2)
        slice_uuid = "MIG-11111111-2222-3333-4444-555555555555"
        gpus[1].mig_mode = 1
        gpus[1].migs = [FakeMig("3g.40gb", slice_uuid, 40 << 30, 3 << 30, gpu_instance_id=2)]
        gpus[1].processes = [FakeProcess(p.pid, 3 << 30, gpu_instance_id=2, compute_instance_id=0)]
        fake_nvml.write(gpus)
        r = _adopt(env, str(p.pid), "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["devices"] == [slice_uuid]
        assert [le["device"] for le in _leases(env)] == [slice_uuid]
    finally:
        p.kill()
        p.wait()


def test_without_a_driver_adopt_says_so_in_one_line(tmp_path: Path):
    env = job_env(dict(os.environ), GPUSD_NVML_LIBRARY=str(tmp_path / "no-libnvidia-ml.so.1"))
    p = subprocess.Popen(["sleep", "300"])
    try:
        r = _adopt(env, str(p.pid))
        assert r.returncode != 0 and "cannot list the GPU processes" in r.stderr and "--simulate" not in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    finally:
        p.kill()
        p.wait()
