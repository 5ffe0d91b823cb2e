"""One real container (docs/allocation.md, "Containers"): ``gpusd run -n 2 -- podman run ...`` where podman can
run here.  The image is made on the spot (the host's /bin/sh and its C library, imported: no registry), the
CDI spec names the fake NVML's GPUs by UUID with a variable each, so the container's environment shows which
CDI devices podman resolved.  Everything runs in a mount namespace of its own (a tmpfs on /run holds the spec
as /run/cdi: podman 4.3 reads no other directory; podman's storage mounts go with the namespace).  Skipped,
with podman's own error, where podman cannot start a container (no podman, not root, a sandbox that refuses
its setrlimit calls...)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from fakenvml import fake_uuid, make_gpus
from jobs_helpers import GPUSD, job_env

IMAGE = "localhost/gpusd-test-sh:1"


def _rootfs_tar(tmp: Path) -> Path:
    root = tmp / "rootfs"
    for path in ("/bin/sh", "/lib/x86_64-linux-gnu/libc.so.6", "/lib64/ld-linux-x86-64.so.2"):
        if not os.path.exists(path):
            pytest.skip(f"no {path} to make an image from")
        dest = root / path.lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, dest)
    tar = tmp / "rootfs.tar"
    subprocess.run(["tar", "-C", str(root), "-cf", str(tar), "."], check=True)
    return tar


def test_podman_gets_exactly_the_two_leased_gpus_by_cdi(fake_nvml, cli_env, tmp_path, request):
    if os.geteuid() != 0:
        pytest.skip("needs root: a mount namespace of its own for the CDI directory and podman's storage")
    podman = shutil.which("podman")
    if podman is None:
        pytest.skip("podman is not installed")
    fake_nvml.write(make_gpus(4))
    spec = {"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu",
            "devices": [{"name": fake_uuid(i), "containerEdits": {"env": [f"SEEN_{i}={fake_uuid(i)}"]}}
                        for i in range(4)]}
    (tmp_path / "nv.json").write_text(json.dumps(spec))
    tar = _rootfs_tar(tmp_path)
    short = Path(tempfile.mkdtemp(prefix="gpd-", dir="/tmp"))  # podman refuses a runroot over 50 characters
    request.addfinalizer(lambda: shutil.rmtree(short, ignore_errors=True))
    pod = [podman, "--root", str(short / "s"), "--runroot", str(short / "r"),
           "--cgroup-manager", "cgroupfs", "--events-backend", "file"]
    inside = "echo CVD=$CUDA_VISIBLE_DEVICES; env | grep ^SEEN_ | sort"
    run = [*pod, "run", "--rm", "--network", "none", IMAGE, "/bin/sh", "-c", inside]
    gpusd = [*GPUSD, "run", "-n", "2", "--", *run]
    script = (f"mount -t tmpfs none /run && mkdir /run/cdi && cp {tmp_path}/nv.json /run/cdi/ && "
              f"{shlex.join([*pod, 'import', str(tar), IMAGE])} >/dev/null && "
              f"{{ {shlex.join([*pod, 'run', '--rm', '--network', 'none', IMAGE, '/bin/sh', '-c', 'true'])} "
              f"|| {{ echo PROBE-FAILED >&2; exit 99; }}; }} && exec {shlex.join(gpusd)}")
    env = job_env(cli_env)
    r = subprocess.run(["unshare", "-m", "sh", "-c", script], env=env, capture_output=True, text=True, timeout=300)
    if r.returncode == 99 and "PROBE-FAILED" in r.stderr:
        why = [line for line in r.stderr.splitlines() if line.strip() and "PROBE-FAILED" not in line]
        pytest.skip(f"podman cannot run a container here: {(why[-1] if why else 'no reason given')[:200]}")
    assert r.returncode == 0, r.stderr
    cvd = next(line[4:] for line in r.stdout.splitlines() if line.startswith("CVD="))
    leased = cvd.split(",")
    assert len(leased) == 2 and set(leased) <= {fake_uuid(i) for i in range(4)}
    seen = sorted(line.split("=", 1)[1] for line in r.stdout.splitlines() if line.startswith("SEEN_"))
    assert seen == sorted(leased)  # podman resolved exactly the two leased GPUs' CDI devices
    assert sys.executable  # (the gpusd above ran with this interpreter)
