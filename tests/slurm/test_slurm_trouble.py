"""When things go wrong on a gpusd-joined Slurm cluster (docs/slurm.md, "When things go wrong"), against
Debian's real slurmctld, slurmd and munge on a LAN of network namespaces (tests/slurm_helpers.py):
a GPU lost before the start and while running, a controller host without GPUs, AMD and Intel nodes, a
reservation aimed at a Slurm node, a restart during a job where no ``SLURM_CONF`` says where the
controller is.  No gpusd daemon here has ``SLURM_CONF``: each finds the controller as a configless
slurmd does.  Every wait is bounded; every process is stopped by pid (SlurmLab.close, Lan.close)."""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
from pathlib import Path

from fakenvml import make_gpus
from lan_helpers import secret_file
from netns import GpuHost, Lan, lan, netns_ok  # noqa: F401
from slurm_helpers import DYNAMIC, SlurmLab, gpu_host, job_scripts, slurm, slurm_leases, wait_for  # noqa: F401


def _controller(lan: Lan, key: Path) -> GpuHost:  # noqa: F811
    """The controller's host: ``gpusd start --slurmctld`` and no GPU, no GPU library at all (the
    fake NVML is taken off its library path and NVML is the one backend asked for: opening it fails)."""
    return lan.add_gpu_host("ctl", [], fast=True, node_name="ctl",
                            args=["--token-file", str(key), "--interval", "0.2", "--slurmctld", "6817"],
                            extra_env={"GPUSD_LEASE_SOCKET": str(lan.workdir / "ctl-lease.sock"),
                                       "GPUSD_SLURM_DIR": str(lan.workdir / "ctl-slurm"),
                                       "LD_LIBRARY_PATH": "", "GPUSD_BACKENDS": "nvidia"})


def _node(lan: Lan, slurm: SlurmLab, host: GpuHost, files: str) -> None:  # noqa: F811
    """``host`` as ``gpusd start --slurm`` joins it: slurmd in its own mount namespace, gres.conf in a
    directory of the test, the simulated GPUs' device files named by ``files``; no SLURM_CONF."""
    host.env.update(GPUSD_SLURMD=str(slurm.slurmd_wrapper()), SLURMD_HOST=host.hostname,
                    GPUSD_SLURM_DIR=str(lan.workdir / f"{host.hostname}-slurm"), GPUSD_SLURM_DEVICES=files)
    host.env.pop("SLURM_CONF", None)


def _state(slurm: SlurmLab, name: str) -> str:  # noqa: F811
    return slurm.node_info(name).get("State", "")


def _srun(slurm: SlurmLab, ctl: GpuHost, node: str, gres: str, *cmd: str,  # noqa: F811
          timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return slurm.run_in(ctl.node, ["srun", "-w", node, f"--gres={gres}", *cmd], timeout=timeout)


def _lost(n: int, *which: int) -> list:  # type: ignore[type-arg]
    gpus = make_gpus(n)
    for i in which:
        gpus[i].errors = {"*": 15}  # fallen off the bus: NVML says GPU_IS_LOST
    return gpus


def test_a_node_whose_gpu_0_is_lost_drains_then_gives_slurm_only_its_good_gpu(lan: Lan, slurm: SlurmLab,  # noqa: F811
                                                                              tmp_path: Path) -> None:
    """Rows 1, 2, 3 and 5 of the admin's checks:

    * the controller's host has no GPU: ``gpusd start --slurmctld`` opens no GPU backend, writes the
      empty gres.conf the cluster's Include names, and nodes find the controller through it;
    * a node started with GPU 0 already lost is drained with gpusd's reason once it has registered
      (tried again until then), and its gres.conf lists GPU 1 only;
    * once the admin resumes it, ``srun --gres=gpu:1`` runs: Slurm's GPU 0 is gres.conf's first GPU,
      which the prolog leases -- NVML's GPU 1, never the lost one;
    * ``gpusd reserve`` aimed at it says it is a Slurm node and how to ask Slurm, with the job's count;
    * a GPU lost while the daemon runs drains it again; back, and the daemon restarted, the node is
      resumed (gpusd lifts only its own drain)."""
    key = secret_file(tmp_path / "fleet.key", secrets.token_hex(32))
    ctl = _controller(lan, key)
    a = gpu_host(lan, "gpu-a", _lost(2, 0), key, ["--slurm"])
    dev = slurm.device_files(2)
    extra = DYNAMIC + job_scripts(slurm, lan, [a])
    slurm.start_slurmctld(ctl.node, extra=extra, gres_conf="Include /run/gpusd/slurm/gres.conf\n")
    ctl.start()
    assert (lan.workdir / "ctl-slurm" / "gres.conf").is_file()  # what slurmctld's Include reads
    assert "no NVIDIA driver" not in ctl.log_tail()
    _node(lan, slurm, a, f"{dev}/nvidia")
    a.start()
    wait_for(lambda: "DRAIN" in _state(slurm, "gpu-a"), 90,
             lambda: f"gpu-a drained at start:\n{a.log_tail()}\n{slurm.log('slurmd-gpu-a.log')}")
    info = slurm.node_info("gpu-a")
    assert info["Gres"] == "gpu:a100:1", info
    assert "gpusd: GPU 0" in slurm.scontrol("show", "node", "gpu-a").stdout
    gres = (lan.workdir / "gpu-a-slurm" / "gres.conf").read_text()
    assert re.findall(r"File=\S+", gres) == [f"File={dev}/nvidia1"], gres
    # the admin resumes the node (docs: it rejoined without the lost GPU); a 1-GPU job runs on GPU 1
    assert slurm.scontrol("update", "nodename=gpu-a", "state=resume").returncode == 0
    wait_for(lambda: "IDLE" in _state(slurm, "gpu-a") and "DRAIN" not in _state(slurm, "gpu-a"), 30, "resumed")
    job = subprocess.Popen(["ip", "netns", "exec", ctl.node.ns, "srun", "-w", "gpu-a", "--gres=gpu:1", "sh", "-c",
                            "echo $SLURM_STEP_GPUS; sleep 5"], env=slurm.env(), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        held = wait_for(lambda: slurm_leases(a), 60, lambda: f"the job's lease:\n{slurm.log('prolog.log')}\n"
                        f"{a.log_tail()}\n{slurm.log('slurmctld.log', 10)}")
        assert isinstance(held, list) and [le["gpu"] for le in held] == [1], held
        out, err = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(10)
    assert job.returncode == 0, (out, err, slurm.log("prolog.log"))
    assert out.strip() == "0"  # Slurm's number: gres.conf's first GPU
    wait_for(lambda: not slurm_leases(a), 30, lambda: slurm.log("epilog.log"))
    # a reservation aimed at the Slurm node (one GPU: all it has now): it says so, and how to ask Slurm
    r = lan.gpusd(ctl.node, ["reserve", "-n", "1", "--host", "gpu-a", "--for", "60", "--token-file", str(key)],
                  env=lan.base_env(ctl.node, GPUSD_MDNS_FAST="1"), timeout=90)
    assert r.returncode == 4, (r.stdout, r.stderr)
    assert "gpu-a (a Slurm node)" in r.stderr and "srun --gres=gpu:1 " in r.stderr, r.stderr
    assert "no verified host" not in r.stderr, r.stderr
    # GPU 1 is lost while the daemon runs: drained again, with its reason
    a.write(_lost(2, 0, 1))
    wait_for(lambda: "DRAIN" in _state(slurm, "gpu-a") and "GPU 1" in slurm.scontrol("show", "node", "gpu-a").stdout,
             60, lambda: f"gpu-a drained for GPU 1:\n{a.log_tail()}")
    # both back; the daemon dies and starts again: slurmd re-registers the node, gpusd lifts its own drain
    a.write(make_gpus(2))
    a.kill()
    a.proc.wait(10)  # type: ignore[union-attr]
    a.start()
    wait_for(lambda: "IDLE" in _state(slurm, "gpu-a") and "DRAIN" not in _state(slurm, "gpu-a"), 90,
             lambda: f"gpu-a resumed: {slurm.node_info('gpu-a')}\n{a.log_tail()}")


def test_a_restart_during_a_job_without_slurm_conf_asks_the_controller(lan: Lan, slurm: SlurmLab,  # noqa: F811
                                                                       tmp_path: Path) -> None:
    """Row 6: no SLURM_CONF in the daemon's environment.  The daemon keeps the controller's config as
    its slurmd fetched it (configless); stopped during an ``srun``, it drains the node (the delete is
    refused while the job runs), and the next daemon asks the controller, is told the job runs and
    takes its lease again -- never logging it as ended; the job's epilog ends it."""
    key = secret_file(tmp_path / "fleet.key", secrets.token_hex(32))
    ctl = _controller(lan, key)
    b = gpu_host(lan, "gpu-b", 2, key, ["--slurm"])
    dev = slurm.device_files(2)
    slurm.start_slurmctld(ctl.node, extra=DYNAMIC + job_scripts(slurm, lan, [b]),
                          gres_conf="Include /run/gpusd/slurm/gres.conf\n")
    ctl.start()
    _node(lan, slurm, b, f"{dev}/nvidia")
    b.start()
    wait_for(lambda: "IDLE" in _state(slurm, "gpu-b"), 90, lambda: b.log_tail())
    job = subprocess.Popen(["ip", "netns", "exec", ctl.node.ns, "srun", "-w", "gpu-b", "--gres=gpu:1", "sleep", "30"],
                           env=slurm.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: slurm_leases(b), 60, lambda: slurm.log("prolog.log"))
        b.stop(timeout=60)
        assert "DRAIN" in _state(slurm, "gpu-b"), (slurm.node_info("gpu-b"), b.log_tail())
        b.start()
        held = wait_for(lambda: slurm_leases(b), 40, lambda: b.log_tail())
        assert isinstance(held, list) and len(held) == 1
        assert "has ended meanwhile" not in (b.state_dir / "gpusd.log").read_text()
        _, err = job.communicate(timeout=60)
        assert job.returncode == 0, err
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(10)
    wait_for(lambda: not slurm_leases(b), 40, lambda: f"{slurm.log('epilog.log')}\n{b.log_tail()}")


def _scenario(path: Path, model: str, n: int, lost: tuple[int, ...] = ()) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"gpus": [{"model": model, "util": 5, "lost": i in lost} for i in range(n)]}))
    os.replace(tmp, path)


def test_amd_and_intel_nodes_get_render_nodes_and_their_own_variable(lan: Lan, slurm: SlurmLab,  # noqa: F811
                                                                      tmp_path: Path) -> None:
    """Row 4, on the simulator's MI300X and Max 1550 against the real slurmd: gres.conf names the GPUs'
    render nodes (``/dev/dri/renderD128``...) with ``Flags=amd_gpu_env`` / ``intel_gpu_env``, slurmd
    takes it, and a job gets ``ROCR_VISIBLE_DEVICES`` (or ``ZE_AFFINITY_MASK``) numbered as ROCm (Level
    Zero) numbers the GPUs -- and no CUDA_VISIBLE_DEVICES; the prolog (leasing what Slurm gave) succeeds."""
    key = secret_file(tmp_path / "fleet.key", secrets.token_hex(32))
    ctl = _controller(lan, key)
    scenario = tmp_path / "gpus.json"
    _scenario(scenario, "MI300X", 2)
    c = gpu_host(lan, "gpu-c", 0, key, ["--slurm", "--simulate", str(scenario)])
    dri = slurm.render_files(2)
    slurm.start_slurmctld(ctl.node, extra=DYNAMIC + job_scripts(slurm, lan, [c]),
                          gres_conf="Include /run/gpusd/slurm/gres.conf\n")
    ctl.start()
    _node(lan, slurm, c, f"{dri}/renderD")
    c.start()
    wait_for(lambda: "IDLE" in _state(slurm, "gpu-c"), 90,
             lambda: f"{c.log_tail()}\n{slurm.log('slurmd-gpu-c.log')}")
    gres = (lan.workdir / "gpu-c-slurm" / "gres.conf").read_text()
    assert re.findall(r"File=(\S+).* Flags=(\S+)", gres) == [(f"{dri}/renderD128", "amd_gpu_env"),
                                                            (f"{dri}/renderD129", "amd_gpu_env")], gres
    assert slurm.node_info("gpu-c")["Gres"].startswith("gpu:mi300x:2")
    r = _srun(slurm, ctl, "gpu-c", "gpu:2", "sh", "-c", "echo ${ROCR_VISIBLE_DEVICES}/${CUDA_VISIBLE_DEVICES-unset}")
    assert r.returncode == 0 and r.stdout.strip() == "0,1/unset", (r.stdout, r.stderr, slurm.log("prolog.log"))
    # the node leaves (gpusd stop deletes it, once the job has completed) and comes back as an Intel node
    wait_for(lambda: not slurm_leases(c) and _state(slurm, "gpu-c").startswith("IDLE"), 30,
             lambda: f"the job to complete: {slurm.node_info('gpu-c')}\n{slurm.log('epilog.log')}")
    c.stop(timeout=60)
    wait_for(lambda: not slurm.node_info("gpu-c"), 30, lambda: f"gpu-c removed: {slurm.node_info('gpu-c')}\n"
             f"{c.log_tail()}")
    _scenario(scenario, "MAX1550", 1)
    c.start()
    wait_for(lambda: "IDLE" in _state(slurm, "gpu-c"), 90,
             lambda: f"{c.log_tail()}\n{slurm.log('slurmd-gpu-c.log')}")
    gres = (lan.workdir / "gpu-c-slurm" / "gres.conf").read_text()
    assert re.findall(r"File=(\S+).* Flags=(\S+)", gres) == [(f"{dri}/renderD128", "intel_gpu_env")], gres
    r = _srun(slurm, ctl, "gpu-c", "gpu:1", "sh", "-c",
              "echo ${ZE_AFFINITY_MASK}/${ROCR_VISIBLE_DEVICES-unset}/${CUDA_VISIBLE_DEVICES-unset}")
    assert r.returncode == 0 and r.stdout.strip() == "0/unset/unset", (r.stdout, r.stderr)


def test_eight_gpus_with_one_lost_in_the_middle_keep_slurms_numbers_apart_from_nvmls(  # noqa: F811
        lan: Lan, slurm: SlurmLab, tmp_path: Path) -> None:  # noqa: F811
    """Row 1 with 8 GPUs, GPU 3 lost at start: gres.conf lists the 7 others, and a job Slurm gives
    its GPUs 0-3 (positions) gets a lease on NVML's 0, 1, 2 and 4 -- never the lost GPU 3."""
    key = secret_file(tmp_path / "fleet.key", secrets.token_hex(32))
    ctl = _controller(lan, key)
    a = gpu_host(lan, "gpu-a", _lost(8, 3), key, ["--slurm"])
    dev = slurm.device_files(8)
    slurm.start_slurmctld(ctl.node, extra=DYNAMIC + job_scripts(slurm, lan, [a]),
                          gres_conf="Include /run/gpusd/slurm/gres.conf\n")
    ctl.start()
    _node(lan, slurm, a, f"{dev}/nvidia")
    a.start()
    wait_for(lambda: "DRAIN" in _state(slurm, "gpu-a"), 90, lambda: a.log_tail())
    assert slurm.node_info("gpu-a")["Gres"].startswith("gpu:a100:7")
    assert slurm.scontrol("update", "nodename=gpu-a", "state=resume").returncode == 0
    job = subprocess.Popen(["ip", "netns", "exec", ctl.node.ns, "srun", "-w", "gpu-a", "--gres=gpu:4", "sh", "-c",
                            "echo $SLURM_STEP_GPUS; sleep 5"], env=slurm.env(), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        held = wait_for(lambda: slurm_leases(a), 60, lambda: f"{slurm.log('prolog.log')}\n{a.log_tail()}")
        assert isinstance(held, list) and sorted(le["gpu"] for le in held) == [0, 1, 2, 4], held
        out, err = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(10)
    assert job.returncode == 0 and out.strip() == "0,1,2,3", (out, err)
