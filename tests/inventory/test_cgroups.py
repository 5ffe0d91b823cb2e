"""A GPU process's container from /proc/PID/cgroup (gpusd.inventory.cgroups; docs/inventory.md, "Containers"):
fixture texts of each runtime and driver, and hostile ones."""

from __future__ import annotations

import pytest

from gpusd.inventory.cgroups import Container, parse

ID = "0123456789abcdef" * 4
POD = "6f3c1a2b-4d5e-4f60-8a9b-0c1d2e3f4a5b"


@pytest.mark.parametrize("text, want", [
    (f"0::/system.slice/docker-{ID}.scope\n", Container("docker", ID)),
    (f"12:pids:/docker/{ID}\n11:memory:/docker/{ID}\n0::/\n", Container("docker", ID)),
    (f"0::/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{ID}.scope/container\n",
     Container("podman", ID)),
    (f"0::/machine.slice/libpod-{ID}.scope\n", Container("podman", ID)),
    (f"5:cpu:/libpod_parent/libpod-{ID}\n", Container("podman", ID)),
    (f"0::/system.slice/nerdctl-{ID}.scope\n", Container("containerd", ID)),
    (f"0::/default/{ID}\n", Container("containerd", ID)),
    (f"0::/system.slice/crio-{ID}.scope\n", Container("cri-o", ID)),
    (f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{POD.replace('-', '_')}.slice/"
     f"cri-containerd-{ID}.scope\n", Container("kubernetes", ID, POD)),
    (f"4:memory:/kubepods/besteffort/pod{POD}/{ID}\n", Container("kubernetes", ID, POD)),
    ("0::/system.slice/slurmstepd.scope/job_4242/step_0/user/task_0\n", Container("slurm", "4242")),
    ("7:freezer:/slurm/uid_1000/job_77/step_batch\n", Container("slurm", "77")),
])
def test_each_runtime_and_driver_is_named(text: str, want: Container) -> None:
    assert parse(text) == want


@pytest.mark.parametrize("text", [
    "0::/\n",
    "0::/user.slice/user-1000.slice/session-3.scope\n",
    f"0::/system.slice/libpod-conmon-{ID}.scope\n",  # podman's monitor, not the container
    "4:memory:/process_api/bee9e72b30c609b5381d37c57fd08872\n",  # a hex directory that is no container
    f"0::/elsewhere/{ID}\n",
    "0::/system.slice/docker-XYZ.scope\n",
    "0::/system.slice/docker-" + "a" * 65 + ".scope\n",
    "0::/job_12/step_0\n",  # not under Slurm's cgroup
    "0::/" + "x" * 100000 + "\n",
    "0::/system.slice/docker-\x1b[31m" + ID + ".scope\n",
    "\x00\xff garbage",
])
def test_a_host_process_or_a_hostile_path_names_no_container(text: str) -> None:
    assert parse(text) is None
