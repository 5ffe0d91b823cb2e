"""``gpusd slurm conf`` (docs/slurm.md): the slurm.conf and gres.conf lines gpusd writes from
snapshots, and ``--check``.  Pure functions on the data model (the real Slurm takes these lines in
tests/slurm/test_slurm_lan.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from gpusd.model import GpuInfo, GpuLink, HostSnapshot
from gpusd.slurm import conf


def host(name: str = "gpu-a.lab", n: int = 2, model: str = "NVIDIA A100-SXM4-80GB", *, cpus: int = 64,
         threads: int = 2, cpus_of: list[str] | None = None, nvlink: bool = True) -> HostSnapshot:
    gpus = []
    for i in range(n):
        links = [GpuLink(peer=j, level=40, nvlink=(12 if nvlink and i // 2 == j // 2 else 0))
                 for j in range(n) if j != i]
        gpus.append(GpuInfo(index=i, uuid=f"GPU-{name}-{i}", name=model, links=links,
                            local_cpus=(cpus_of[i] if cpus_of else None)))
    return HostSnapshot(hostname=name, node_id="n", timestamp=0.0, gpus=gpus, cpus=cpus, sockets=2,
                        cores_per_socket=cpus // (2 * threads), threads_per_core=threads, memory=512 * 2**30)


def test_a_node_line_says_what_slurmd_would_and_what_gpusd_knows_of_the_gpus() -> None:
    line = conf.node_line(host(), "198.18.0.2")
    assert line == ("NodeName=gpu-a NodeAddr=198.18.0.2 CPUs=64 Boards=1 SocketsPerBoard=2 CoresPerSocket=16 "
                    "ThreadsPerCore=2 RealMemory=524288 Gres=gpu:a100:2 Feature=gpusd,a100 State=UNKNOWN")


def test_gres_types_are_short_slurm_words() -> None:
    assert conf.gpu_type("NVIDIA A100-SXM4-80GB") == "a100"
    assert conf.gpu_type("NVIDIA RTX A6000") == "rtx_a6000"
    assert conf.gpu_type("Tesla T4") == "t4"
    assert conf.gpu_type("NVIDIA H100 80GB HBM3") == "h100_80gb_hbm3"
    for hostile in ("\x1b[31m;rm -rf /:x=y", "a b=c,gpu:9", "::::", "x\nNodeName=evil"):
        assert re.fullmatch(r"[a-z0-9_]{1,32}", conf.gpu_type(hostile)), hostile  # one Slurm word
    assert conf.gpu_type(None) == "gpu"


def test_gres_lines_carry_cores_from_the_cpu_affinity_and_links_from_nvlink() -> None:
    # 2 sockets x 16 cores x 2 threads: CPUs 0-15 and 32-47 are socket 0's threads, cores 0-15
    snap = host(n=4, cpus_of=["0-15,32-47", "0-15,32-47", "16-31,48-63", "16-31,48-63"])
    lines = conf.gres_lines(snap)
    assert lines == [
        "NodeName=gpu-a Name=gpu Type=a100 File=/dev/nvidia0 Cores=0-15 Links=-1,12,0,0 Flags=nvidia_gpu_env",
        "NodeName=gpu-a Name=gpu Type=a100 File=/dev/nvidia1 Cores=0-15 Links=12,-1,0,0 Flags=nvidia_gpu_env",
        "NodeName=gpu-a Name=gpu Type=a100 File=/dev/nvidia2 Cores=16-31 Links=0,0,-1,12 Flags=nvidia_gpu_env",
        "NodeName=gpu-a Name=gpu Type=a100 File=/dev/nvidia3 Cores=16-31 Links=0,0,12,-1 Flags=nvidia_gpu_env",
    ]
    no_nvlink = conf.gres_lines(host(n=2, nvlink=False, cpus_of=["0-7", "0-7"]))
    assert all("Links=" not in line for line in no_nvlink)  # PCIe only: no Links= at all


def test_a_lost_gpu_is_left_out_and_said_so() -> None:
    snap = host(n=3)
    snap.gpus[1].healthy, snap.gpus[1].error = False, "GPU is lost"
    assert "Gres=gpu:a100:2" in (conf.node_line(snap) or "")
    lines = conf.gres_lines(snap)
    assert lines[0] == "# gpu-a: GPU 1 left out (lost or unhealthy)"
    assert [line.split()[3] for line in lines[1:]] == ["File=/dev/nvidia0", "File=/dev/nvidia2"]


def test_slurm_numbers_the_gpus_gres_conf_lists_skipping_those_left_out() -> None:
    """Slurm's GPU N is the N-th line of gres.conf: a GPU left out at position 0 or in the middle
    shifts the ones after it, with 2 and 8 GPUs."""
    for n, lost in ((2, 0), (8, 0), (8, 3)):
        snap = host(n=n)
        snap.gpus[lost].healthy = False
        order = [g.uuid for g in conf.gres_gpus(snap)]
        assert order == [f"GPU-gpu-a.lab-{i}" for i in range(n) if i != lost]
        files = [w for line in conf.gres_lines(snap) if not line.startswith("#") for w in line.split()
                 if w.startswith("File=")]
        assert files == [f"File=/dev/nvidia{i}" for i in range(n) if i != lost]  # the same order


def _vendor_host(model: str, n: int, vendor: str) -> HostSnapshot:
    snap = host(n=n, model=model, nvlink=False)
    for g in snap.gpus:
        g.vendor = vendor
    return snap


def test_amd_and_intel_gpus_are_render_nodes_with_their_vendor_flag() -> None:
    """gres.conf(5): an AMD GPU is its DRM render node (Slurm's gpu/rsmi writes /dev/dri/renderD<minor>)
    with Flags=amd_gpu_env (ROCR_VISIBLE_DEVICES only), an Intel one with intel_gpu_env
    (ZE_AFFINITY_MASK only); NVIDIA's keeps /dev/nvidiaN with nvidia_gpu_env."""
    amd = conf.gres_lines(_vendor_host("AMD Instinct MI300X", 2, "amd"), with_node=False)
    assert amd == ["Name=gpu Type=mi300x File=/dev/dri/renderD128 Flags=amd_gpu_env",
                   "Name=gpu Type=mi300x File=/dev/dri/renderD129 Flags=amd_gpu_env"]
    intel = conf.gres_lines(_vendor_host("Intel(R) Data Center GPU Max 1550", 1, "intel"), with_node=False)
    assert intel == ["Name=gpu Type=max_1550 File=/dev/dri/renderD128 Flags=intel_gpu_env"]
    # another directory for the device files keeps the vendor's number
    moved = conf.gres_lines(_vendor_host("AMD Instinct MI300X", 1, "amd"), with_node=False, device="/t/dev/rD")
    assert moved == ["Name=gpu Type=mi300x File=/t/dev/rD128 Flags=amd_gpu_env"]


def test_a_render_node_is_read_from_sysfs_where_the_kernel_shows_one(tmp_path: Path) -> None:
    from gpusd.inventory.vendors import slurm_file

    snap = _vendor_host("AMD Instinct MI300X", 1, "amd")
    gpu = snap.gpus[0]
    gpu.pci_bus_id = "00000000:C1:00.0"
    drm = tmp_path / "bus" / "pci" / "devices" / "0000:c1:00.0" / "drm"
    (drm / "card3").mkdir(parents=True)
    (drm / "renderD131").mkdir()
    assert slurm_file(gpu, sysfs=str(tmp_path)) == "/dev/dri/renderD131"


def test_a_host_whose_name_is_not_a_slurm_word_is_left_out() -> None:
    for bad in ("x y", "-rf", "a=b", "ok\nNodeName=evil", ""):
        snap = host(name=bad)
        assert conf.node_line(snap) is None
        assert "NodeName" not in conf.slurm_conf([(snap, None)]).split("\n", 2)[2]
        assert all(line.startswith("#") for line in conf.gres_lines(snap))


def test_an_address_that_is_not_one_is_not_written() -> None:
    assert "NodeAddr" not in (conf.node_line(host(), "1.2.3.4 Gres=gpu:99") or "")


def test_check_reports_hosts_added_gone_and_changed() -> None:
    a, b, c = host("gpu-a"), host("gpu-b", 4), host("gpu-c")
    text = conf.slurm_conf([(a, None), (c, None)])
    text += "NodeName=old[1-2] CPUs=8 Gres=gpu:2\n"
    b_changed = host("gpu-c", 1)
    diff = conf.check(text, [a, b, b_changed])
    assert diff.added == ["gpu-b"]
    assert diff.gone == ["old1", "old2"]
    assert [n for n, _ in diff.changed] == ["gpu-c"] and "Gres=gpu:a100:2 in the file" in diff.changed[0][1]
    assert conf.check(conf.slurm_conf([(a, None)]), [a]).same


def test_parse_nodes_reads_defaults_ranges_and_continuations() -> None:
    nodes = conf.parse_nodes("NodeName=DEFAULT CPUs=4\nNodeName=n[01-03],x \\\n  Gres=gpu:t4:1 # comment\n")
    assert sorted(nodes) == ["n01", "n02", "n03", "x"]
    assert nodes["n02"] == {"cpus": "4", "gres": "gpu:t4:1"}


def test_slurm_conf_local_prints_this_machine() -> None:
    r = subprocess.run([sys.executable, "-m", "gpusd", "slurm", "conf", "--local", "--simulate", "2xA100-80GB"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "GresTypes=gpu" in r.stdout and "Gres=gpu:a100:2" in r.stdout
    r = subprocess.run([sys.executable, "-m", "gpusd", "slurm", "conf"], capture_output=True, text=True, timeout=60,
                       env={k: v for k, v in __import__("os").environ.items() if not k.startswith("GPUSD_TOKEN")})
    assert r.returncode == 2 and "proved themselves" in r.stderr  # no secret: no host is believed


def test_the_controller_address_is_a_host_or_address_and_a_port() -> None:
    import pytest

    from gpusd.errors import ConfigError
    from gpusd.slurm.node import parse_controller

    assert parse_controller("ctl.lab") == ("ctl.lab", 6817)
    assert parse_controller("10.0.0.2:7000") == ("10.0.0.2", 7000)
    assert parse_controller("[fd00::2]:6817") == ("fd00::2", 6817)
    assert parse_controller("6818") == ("", 6818)  # --slurmctld PORT: this host
    for bad in ("a b", "ctl:0", "ctl:99999", "ctl;reboot", "-x", "ctl:6817:1"):
        with pytest.raises(ConfigError):
            parse_controller(bad)


def test_slurmd_joins_as_a_dynamic_configless_node_with_the_host_gpus() -> None:
    from gpusd.slurm.node import slurmd_argv

    argv = slurmd_argv(host(n=2), ("10.0.0.2", 6817), ["slurmd"])
    assert argv == ["slurmd", "-D", "-Z", "--conf-server", "10.0.0.2:6817",
                    "--conf", "Gres=gpu:a100:2 Feature=gpusd,a100"]
