"""Leased GPUs into containers (docs/allocation.md, "Containers"): ``gpusd run -n N -- docker|podman|apptainer
...`` gives the container exactly the leased GPUs, for as long as the container lives; options that would
bypass the lease are refused.  The runtimes are fakes on PATH (tests/fakeruntime) that record their arguments
and run the container's command with only the variables passed in."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from fakenvml import fake_uuid, make_gpus
from jobs_helpers import GPUSD, job_env, jobs_json, leases_json
from waiting import wait_until_sync


def _leased(env: dict[str, str]) -> list[str]:
    return sorted(str(le["device"]) for le in leases_json(env)["leases"])  # type: ignore[index]


def _inside(tmp: Path) -> list[str]:
    """A container command: writes what it sees, then waits for tmp/stop."""
    return ["sh", "-c", f'echo "$CUDA_VISIBLE_DEVICES" > {tmp}/seen; '
            f'while [ ! -e {tmp}/stop ]; do sleep 0.05; done; exit "$(cat {tmp}/stop || echo 0)"']


def _kill(p: subprocess.Popen[str]) -> None:
    if p.poll() is None:
        p.kill()
        p.wait()


@pytest.fixture
def env(fake_nvml, cli_env, fake_runtimes):  # type: ignore[no-untyped-def]
    fake_nvml.write(make_gpus(4))
    return fake_runtimes.env(job_env(cli_env))


def _run_to_the_end(env: dict[str, str], tmp: Path, cmd: list[str]) -> tuple[list[str], str]:
    """Start gpusd run, see the lease while the container runs, end the container; (the leased UUIDs, what
    the container saw)."""
    p = subprocess.Popen([*GPUSD, "run", "-n", "2", "--", *cmd], env=env, text=True, stderr=subprocess.PIPE)
    try:
        wait_until_sync(lambda: (tmp / "seen").exists(), timeout=30, what="the container's start")
        leased = _leased(env)
        assert len(leased) == 2
        (tmp / "stop").write_text("0")
        assert p.wait(timeout=30) == 0, p.stderr.read() if p.stderr else ""
        assert _leased(env) == []  # gone with the container
        return leased, (tmp / "seen").read_text().strip()
    finally:
        _kill(p)


def test_docker_run_gets_exactly_the_two_leased_gpus_by_uuid_and_the_lease_ends_with_it(env, fake_runtimes,
                                                                                      tmp_path):
    leased, seen = _run_to_the_end(env, tmp_path, ["docker", "run", "--rm", "img", *_inside(tmp_path)])
    [call] = fake_runtimes.calls("docker")[:1]
    argv = call["argv"]
    gpus = argv[argv.index("--gpus") + 1]
    assert gpus.startswith('"device=') and sorted(gpus.strip('"')[len("device="):].split(",")) == leased
    assert sorted(seen.split(",")) == leased
    assert all(u in {fake_uuid(i) for i in range(4)} for u in leased)
    assert f"NVIDIA_VISIBLE_DEVICES={gpus.strip(chr(34))[len('device='):]}" in argv  # an image's "all" overridden
    assert argv[-len(_inside(tmp_path)) - 1] == "img"  # the container's own command untouched


def test_the_job_records_the_container_it_started(env, fake_runtimes, tmp_path):
    p = subprocess.Popen([*GPUSD, "run", "--", "docker", "run", "img", *_inside(tmp_path)], env=env, text=True,
                         stderr=subprocess.PIPE)
    try:
        rec = wait_until_sync(lambda: [j for j in jobs_json(env) if j.get("container")], timeout=30,
                              what="the container id in the job record")[0]
        assert [rec["container"]] == fake_runtimes.containers()
        (tmp_path / "stop").write_text("0")
        assert p.wait(timeout=30) == 0
    finally:
        _kill(p)


def test_podman_gets_the_leased_gpus_by_cdi_name(env, fake_runtimes, tmp_path):
    leased, seen = _run_to_the_end(env, tmp_path, ["podman", "run", "--rm", "img", *_inside(tmp_path)])
    argv = fake_runtimes.calls("podman")[0]["argv"]
    cdi = sorted(argv[i + 1] for i, a in enumerate(argv) if a == "--device")
    assert cdi == [f"nvidia.com/gpu={u}" for u in leased]
    assert "--gpus" not in argv
    assert sorted(seen.split(",")) == leased


def test_apptainer_gets_nv_and_the_leased_gpus_passed_in(env, fake_runtimes, tmp_path):
    leased, seen = _run_to_the_end(env, tmp_path, ["apptainer", "exec", "img.sif", *_inside(tmp_path)])
    call = fake_runtimes.calls("apptainer")[0]
    assert call["argv"][:2] == ["exec", "--nv"]
    assert sorted(call["env"]["APPTAINERENV_CUDA_VISIBLE_DEVICES"].split(",")) == leased
    assert sorted(seen.split(",")) == leased


@pytest.mark.parametrize("cmd, says", [
    (["docker", "run", "-d", "img"], "--follow-container"),
    (["docker", "run", "-dit", "img"], "--follow-container"),
    (["podman", "run", "--detach", "img"], "--follow-container"),
    (["docker", "run", "--gpus", "all", "img"], "--gpus all"),
    (["docker", "run", "--gpus=device=0", "img"], "--gpus"),
    (["sudo", "docker", "run", "--device", "/dev/nvidia0", "img"], "--device /dev/nvidia0"),
    (["podman", "run", "--device", "nvidia.com/gpu=all", "img"], "nvidia.com/gpu=all"),
    (["docker", "run", "-e", "NVIDIA_VISIBLE_DEVICES=all", "img"], "NVIDIA_VISIBLE_DEVICES"),
    (["docker", "run", "--privileged", "img"], "--privileged"),
    (["apptainer", "instance", "start", "img.sif", "x"], "instance"),
])
def test_what_would_bypass_the_lease_is_refused_with_one_line_before_any_lease(env, fake_runtimes, cmd, says):
    r = subprocess.run([*GPUSD, "run", "--", *cmd], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in r.stderr, r.stderr
    assert fake_runtimes.calls() == []  # the runtime was never called
    assert _leased(env) == []


def test_no_lease_passes_a_container_run_through_untouched(env, fake_runtimes):
    cmd = ["docker", "run", "--rm", "--gpus", "all", "img", "true"]
    r = subprocess.run([*GPUSD, "run", "--no-lease", "--", *cmd], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert fake_runtimes.calls("docker")[0]["argv"] == cmd[1:]


def test_a_followed_detached_container_keeps_its_lease_until_it_exits(env, fake_runtimes, tmp_path):
    p = subprocess.Popen([*GPUSD, "run", "--follow-container", "--", "docker", "run", "-d", "img",
                          *_inside(tmp_path)], env=env, text=True, stderr=subprocess.PIPE)
    try:
        wait_until_sync(lambda: (tmp_path / "seen").exists(), timeout=30, what="the container's start")
        [cid] = fake_runtimes.containers()
        # the client has exited (-d printed the id); the lease stays with the container
        wait_until_sync(lambda: any(c["argv"][:1] == ["wait"] for c in fake_runtimes.calls("docker")), timeout=30)
        assert len(_leased(env)) == 1 and p.poll() is None
        (tmp_path / "stop").write_text("3")
        assert p.wait(timeout=30) == 3  # the container's exit status
        assert fake_runtimes.exit_status(cid) == 3
        assert _leased(env) == []
    finally:
        _kill(p)


def test_sigterm_to_gpusd_run_stops_a_followed_container(env, fake_runtimes, tmp_path):
    p = subprocess.Popen([*GPUSD, "run", "--follow-container", "--grace", "2", "--", "docker", "run", "-d", "img",
                          "sleep", "300"], env=env, text=True, stderr=subprocess.PIPE)
    try:
        wait_until_sync(lambda: any(c["argv"][:1] == ["wait"] for c in fake_runtimes.calls("docker")), timeout=30)
        [cid] = fake_runtimes.containers()
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=60)
        assert any(c["argv"][:1] == ["stop"] and cid in c["argv"] for c in fake_runtimes.calls("docker"))
        assert fake_runtimes.exit_status(cid) is not None
        assert _leased(env) == []
    finally:
        _kill(p)


def test_a_container_that_outlives_a_killed_gpusd_run_keeps_its_lease_until_it_exits(env, fake_runtimes,
                                                                                    tmp_path):
    p = subprocess.Popen([*GPUSD, "run", "--", "docker", "run", "--rm", "img", *_inside(tmp_path)], env=env,
                         text=True, stderr=subprocess.PIPE)
    try:
        wait_until_sync(lambda: any(c["argv"][:1] == ["wait"] for c in fake_runtimes.calls("docker")), timeout=30)
        [client] = [c["pid"] for c in fake_runtimes.calls("docker") if c["argv"][:1] == ["run"]]
        p.kill()
        p.wait()
        os.kill(client, signal.SIGKILL)  # the runtime's client too: only the container is left
        leased = _leased(env)
        assert len(leased) == 1  # held by `docker wait` for the container
        (tmp_path / "stop").write_text("0")
        wait_until_sync(lambda: _leased(env) == [], timeout=30, what="the lease's end with the container")
    finally:
        _kill(p)


def test_through_the_lease_authority_a_container_outliving_gpusd_run_keeps_its_lease(fake_nvml_inprocess, cli_env,
                                                                                   fake_runtimes, tmp_path):
    from authority_helpers import ServerThread

    server = ServerThread()
    fake_nvml_inprocess.write(make_gpus(2))
    env = fake_runtimes.env(job_env(cli_env))
    p = subprocess.Popen([*GPUSD, "run", "--", "docker", "run", "--rm", "img", *_inside(tmp_path)], env=env,
                         text=True, stderr=subprocess.PIPE)
    try:
        wait_until_sync(lambda: any(c["argv"][:1] == ["wait"] for c in fake_runtimes.calls("docker")), timeout=30)
        [held] = leases_json(env)["leases"]  # type: ignore[index]
        assert not held.get("outside_authority")  # the daemon's lease
        [client] = [c["pid"] for c in fake_runtimes.calls("docker") if c["argv"][:1] == ["run"]]
        p.kill()
        p.wait()
        os.kill(client, signal.SIGKILL)
        assert len(_leased(env)) == 1  # `docker wait` keeps the lease's connection open
        (tmp_path / "stop").write_text("0")
        wait_until_sync(lambda: _leased(env) == [], timeout=30, what="the lease's end with the container")
    finally:
        _kill(p)
        server.stop()


def test_a_container_run_with_fleet_is_refused_rather_than_run_unrewritten(env, fake_runtimes):
    r = subprocess.run([*GPUSD, "run", "--fleet", "--", "docker", "run", "--rm", "img", "true"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "not with --fleet" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert fake_runtimes.calls() == []


def test_a_preempted_container_job_stops_its_container_before_its_gpu_is_granted_again(fake_nvml, cli_env,
                                                                                      fake_runtimes, tmp_path):
    fake_nvml.write(make_gpus(1))
    env = fake_runtimes.env(job_env(cli_env))
    stubborn = ["sh", "-c", f"trap '' TERM; touch {tmp_path}/seen; while :; do sleep 0.05; done"]
    low = subprocess.Popen([*GPUSD, "run", "--preemptible", "--priority", "low", "--grace", "1", "--", "docker",
                            "run", "--rm", "img", *stubborn], env=env, text=True, stderr=subprocess.PIPE)
    try:
        wait_until_sync(lambda: any(c["argv"][:1] == ["wait"] for c in fake_runtimes.calls("docker")), timeout=30)
        [cid] = fake_runtimes.containers()
        high = subprocess.run([*GPUSD, "run", "--priority", "high", "--wait", "--timeout", "60", "--", "true"],
                              env=env, capture_output=True, text=True, timeout=120)
        assert high.returncode == 0, high.stderr
        assert fake_runtimes.exit_status(cid) is not None  # the container ended before the GPU was granted again
        assert any(c["argv"][:1] == ["stop"] and cid in c["argv"] for c in fake_runtimes.calls("docker"))
    finally:
        _kill(low)
