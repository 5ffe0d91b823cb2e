"""What a user of ``gpusd hostfile`` and ``gpusd ray up`` types and reads, on this machine alone (a
placement whose hosts are this machine: no SSH, no root): ``hostfile --port``, ``ray up``'s
head-only and worker-only options, the address alone on stdout, an error that names what ``ray start``
said, and each host's guard run by the Python that has gpusd there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import tests_paths

SRC = str(tests_paths.SRC)


def _cli(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpusd", *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": SRC, **(env or {})})


def _placement(tmp_path: Path) -> Path:
    path = tmp_path / "placement.json"
    path.write_text(json.dumps({"job_id": "ports-1", "hosts": [
        {"hostname": "node-1", "address": "127.0.0.1", "gpus": [0, 2]},
        {"hostname": "node-2", "address": "127.0.0.1", "ssh_target": "localhost", "gpus": [1]}]}))
    return path


# -- gpusd hostfile --port ----------------------------------------------------------------------------------
def test_hostfile_port_changes_torchruns_rendezvous_port(tmp_path: Path) -> None:
    r = _cli(["hostfile", "--format", "torchrun", "--port", "29600", "--placement", str(_placement(tmp_path))])
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 2 and all("--rdzv-endpoint=127.0.0.1:29600 " in line for line in lines), lines
    assert "29400" not in r.stdout


def test_hostfile_port_changes_deepspeeds_master_port_and_rays_port(tmp_path: Path) -> None:
    pl = str(_placement(tmp_path))
    r = _cli(["hostfile", "--format", "deepspeed", "--port", "29601", "--placement", pl,
              "--output", str(tmp_path / "hostfile")])
    assert r.returncode == 0, r.stderr
    assert "--master_port=29601" in r.stdout and "29500" not in r.stdout
    r = _cli(["hostfile", "--format", "ray", "--port", "6390", "--placement", pl])
    assert r.returncode == 0, r.stderr
    assert "--port=6390" in r.stdout and "--address=127.0.0.1:6390" in r.stdout


def test_hostfile_refuses_a_port_that_is_no_port(tmp_path: Path) -> None:
    r = _cli(["hostfile", "--format", "torchrun", "--port", "70000", "--placement", str(_placement(tmp_path))])
    assert r.returncode == 2 and "1-65535" in r.stderr and "Traceback" not in r.stderr


# -- gpusd ray up -------------------------------------------------------------------------------------------
RECORDING_RAY = """#!/bin/sh
# a stand-in for ray: records each invocation's arguments (one line each) and says something
printf '%s\\n' "$*" >> {log}
echo "ray start output: $*"
{fail}
"""


def _fake_ray(tmp_path: Path, fail: str = "") -> Path:
    ray = tmp_path / "ray"
    ray.write_text(RECORDING_RAY.format(log=tmp_path / "ray.log", fail=fail))
    ray.chmod(0o755)
    return ray


def _ray_up(tmp_path: Path, *extra: str, fail: str = "") -> subprocess.CompletedProcess[str]:
    return _cli(["ray", "up", "--placement", str(_placement(tmp_path)), "--ray", str(_fake_ray(tmp_path, fail)),
                 "--state-dir", str(tmp_path / "state"), "--port", "6390", *extra])


def test_ray_up_prints_the_address_alone_on_stdout(tmp_path: Path) -> None:
    """ADDR=$(gpusd ray up ...): stdout is the address; what each ray start says goes to stderr."""
    r = _ray_up(tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "127.0.0.1:6390\n"
    assert "[node-1#0] ray start output" in r.stderr and "[node-2#1] ray start output" in r.stderr


def test_head_and_worker_options_go_to_their_side_only(tmp_path: Path) -> None:
    r = _ray_up(tmp_path, "--head-option=--dashboard-port=8266", "--head-option=--include-dashboard=false",
                "--worker-option=--object-store-memory=100000000", "--", "--num-cpus=1")
    assert r.returncode == 0, r.stderr
    head, worker = (tmp_path / "ray.log").read_text().splitlines()
    assert "--head" in head.split() and "--head" not in worker.split()
    assert "--dashboard-port=8266" in head.split() and "--include-dashboard=false" in head.split()
    assert "--dashboard-port=8266" not in worker and "--include-dashboard" not in worker
    assert "--object-store-memory=100000000" in worker.split() and "--object-store-memory" not in head
    assert "--num-cpus=1" in head.split() and "--num-cpus=1" in worker.split()  # after --: every ray start


def test_a_failed_ray_start_is_named_with_what_it_said(tmp_path: Path) -> None:
    """The error names the real cause: the last lines of ray start's output on the host that failed."""
    r = _ray_up(tmp_path, fail='echo "ConnectionError: GCS port 6390 taken" >&2; exit 1')
    assert r.returncode == 1
    assert "ray up failed on node-1#0 (status 1): " in r.stderr and "GCS port 6390 taken" in r.stderr.split(
        "ray up failed on node-1#0")[1], r.stderr
    assert "--python" not in r.stderr  # not the Python's fault
    assert r.stdout == ""


def test_each_hosts_guard_runs_under_the_python_that_has_gpusd_there(tmp_path: Path) -> None:
    """Without --python, a remote host's guard is not plain ``python3`` from PATH (there: a Python
    without gpusd) but the Python found as gpusd launch finds it: this machine's interpreter where the
    same path exists there (else the gpusd on PATH)."""
    from gpusd.engines.placement import HostSlot
    from gpusd.engines.plan import guard_argv

    other = tmp_path / "bin"
    other.mkdir()
    fake = other / "python3"  # the first python3 on the host's PATH: not one with gpusd
    fake.write_text("#!/bin/sh\necho 'a python3 without gpusd' >&2; exit 42\n")
    fake.chmod(0o755)
    remote = HostSlot("node-9", "198.18.0.9", "node-9", (0,))
    argv = [*guard_argv(remote, None), "--stop", "--lease", "0123456789ab"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": SRC, "PATH": f"{other}:/usr/bin:/bin"})
    assert r.returncode == 3 and "no guard of lease 0123456789ab" in r.stderr, (argv, r.stderr)
