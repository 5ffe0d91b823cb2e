"""What gpusd generates for each engine, read by the engine's OWN parser (DeepSpeed's runner, torchrun's
argument parser, Horovod's host parsing and discovery, Open MPI's mpirun), never by re-reading our output.

The engines are heavy (torch, deepspeed, horovod: the ``engines`` test extra; Open MPI: the distribution's
``openmpi-bin``): these tests carry the ``engines`` marker and skip, saying why, where one is missing.
Placement checks and the per-rank wrapper need nothing and are not marked."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpusd.engines import generate as g
from gpusd.engines.placement import HostSlot, Placement, PlacementError
from gpusd.engines.rank_gpu import RankError, choose
from tests_paths import SRC

P = Placement.of([("node-1", [0, 2]), ("node-2", [1])], job_id="job-7")


def _cli(args: list[str], cwd: Path | None = None, env: dict[str, str] | None = None
         ) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **(env or {})}
    env["PYTHONPATH"] = str(SRC)
    return subprocess.run([sys.executable, "-m", "gpusd", *args], capture_output=True, text=True, env=env,
                          timeout=60, cwd=cwd)


def _placement_file(tmp_path: Path, p: Placement = P) -> Path:
    path = tmp_path / "placement.json"
    path.write_text(p.to_json())
    return path


# -- the placement: hostile names never reach a command line -------------------------------------------------
@pytest.mark.parametrize("field,value", [
    ("hostname", "-oProxyCommand=touch /tmp/x"), ("ssh_target", "-oProxyCommand=sh"), ("hostname", "a b"),
    ("address", "h;reboot"), ("hostname", "$(id)"), ("ssh_target", "ro ot@h"), ("hostname", "node\n1"),
    ("hostname", ""), ("address", "node..x")])
def test_placement_rejects_names_that_are_not_host_names(field: str, value: str) -> None:
    d = {"hostname": "node-1", "address": "10.0.0.1", "ssh_target": "node-1", "gpus": [0]}
    d[field] = value
    with pytest.raises(PlacementError):
        Placement.from_dict({"hosts": [d]})


@pytest.mark.parametrize("hosts,why", [
    ([{"hostname": "a", "gpus": [0, 0]}], "twice"), ([{"hostname": "a", "gpus": []}], "no GPU"),
    ([{"hostname": "a", "gpus": [-1]}], "integer"), ([{"hostname": "a", "gpus": ["0"]}], "integer"),
    ([{"hostname": "a", "gpus": [True]}], "integer"), ([{"hostname": "a", "gpus": [0]}] * 2, "listed twice"),
    ([{"hostname": "a", "gpus": [0], "uuids": ["x"]}], "UUID"), ([], "at least one host")])
def test_placement_rejects_bad_gpu_lists(hosts: list[dict[str, object]], why: str) -> None:
    with pytest.raises(PlacementError, match=why):
        Placement.from_dict({"hosts": hosts})


def test_a_hostile_placement_is_refused_by_the_cli_before_any_ssh(tmp_path: Path) -> None:
    """``ssh_target: -oProxyCommand=...`` would make ssh run a local command: gpusd refuses the
    placement with a clear message, and nothing runs."""
    mark = tmp_path / "pwned"
    path = tmp_path / "placement.json"
    path.write_text(json.dumps({"hosts": [{"hostname": "n", "ssh_target": f"-oProxyCommand=touch {mark}",
                                           "gpus": [0]}]}))
    r = _cli(["launch", "--placement", str(path), "command", "--", "true"])
    assert r.returncode == 1 and "ssh_target must be a host name" in r.stderr and "Traceback" not in r.stderr
    assert not mark.exists()


def test_placement_round_trips_and_excludes_reserving(tmp_path: Path) -> None:
    """--placement names the GPUs itself: -n (which reserves) or --per-host with it is a clear error."""
    path = _placement_file(tmp_path)
    assert Placement.load(path) == P and P.head.hostname == "node-1" and P.total_gpus == 3
    r = _cli(["launch", "--placement", str(path), "-n", "3", "command", "--", "true"])
    assert r.returncode == 2 and "-n and --placement exclude each other" in r.stderr, r.stderr  # bad usage
    r = _cli(["launch", "--placement", str(path), "--per-host", "2", "command", "--", "true"])
    assert r.returncode == 2 and "--per-host needs -n" in r.stderr, r.stderr
    r = _cli(["launch", "command", "--", "true"], env={"GPUSD_PLACEMENT": ""})
    assert r.returncode == 1 and "give -n N to reserve" in r.stderr and "Traceback" not in r.stderr
    r = _cli(["hostfile", "--format", "json", "--placement", str(path)])
    view = json.loads(r.stdout)
    assert view["hosts"][1]["env"] == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "1"}
    assert Placement.from_dict(view) == P


def test_mig_slices_are_named_by_uuid() -> None:
    slot = HostSlot("n", "n", "n", (0,), ("MIG-1234-abcd",))
    assert slot.cuda_env()["CUDA_VISIBLE_DEVICES"] == "MIG-1234-abcd"


# -- the per-rank wrapper ---------------------------------------------------------------------------------
def test_rank_wrapper_gives_each_open_mpi_rank_its_gpu() -> None:
    env = {"GPUSD_RANK_GPUS": g.rank_gpus(P)}
    got = [choose({**env, "OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_LOCAL_RANK": str(lr)})
           for r, lr in ((0, 0), (1, 1), (2, 0))]
    assert got == ["0", "2", "1"]
    with pytest.raises(RankError, match="map-by slot"):  # ranks mapped round-robin by node: refused
        choose({**env, "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "0"})
    with pytest.raises(RankError, match="beyond"):
        choose({**env, "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "0"})


def test_rank_wrapper_follows_horovods_host_names() -> None:
    env = {"GPUSD_RANK_GPUS": g.rank_gpus(P)}
    assert choose({**env, "HOROVOD_HOSTNAME": "node-2", "HOROVOD_LOCAL_RANK": "0"}) == "1"
    assert choose({**env, "HOROVOD_HOSTNAME": "node-1", "HOROVOD_LOCAL_RANK": "1"}) == "2"
    with pytest.raises(RankError, match="not in the placement"):
        choose({**env, "HOROVOD_HOSTNAME": "node-3", "HOROVOD_LOCAL_RANK": "0"})


def test_rank_wrapper_execs_the_command_with_the_gpu_set(tmp_path: Path) -> None:
    env = {**os.environ, "GPUSD_RANK_GPUS": g.rank_gpus(P), "OMPI_COMM_WORLD_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "PYTHONPATH": str(SRC)}
    r = subprocess.run([sys.executable, "-m", "gpusd.engines.rank_gpu", "--", "sh", "-c",
                        'echo "$CUDA_DEVICE_ORDER $CUDA_VISIBLE_DEVICES"'], capture_output=True, text=True, env=env)
    assert r.stdout == "PCI_BUS_ID 2\n"
    del env["OMPI_COMM_WORLD_LOCAL_RANK"]
    r = subprocess.run([sys.executable, "-m", "gpusd.engines.rank_gpu", "--", "true"], capture_output=True,
                       text=True, env=env)
    assert r.returncode == 2 and "no local rank" in r.stderr


# -- DeepSpeed's own parsers ------------------------------------------------------------------------------
DS_PARSE = r"""
import json, sys
from deepspeed.launcher import runner
hostfile, include, argv, per_host = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
pool = runner.fetch_hostfile(hostfile)
active = runner.parse_inclusion_exclusion(pool, include, "")
a, b = runner.parse_args(argv), runner.parse_args(per_host)
print("RESULT " + json.dumps({"pool": dict(pool), "active": {h: list(g) for h, g in active.items()},
      "args": [a.hostfile, a.master_addr, a.user_script, a.user_args],
      "per_host": [b.no_ssh, b.node_rank, b.include]}))
"""


@pytest.mark.engines
def test_deepspeed_reads_the_hostfile_and_include(tmp_path: Path) -> None:
    """DeepSpeed's runner turns our hostfile + --include into exactly the GPUs of the placement (it
    checks every index against range(slots): slots = highest index + 1), and parses the command line.
    (In a subprocess: importing DeepSpeed initialises NVML in the importing process.)"""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (the engines extra)")
    r = _cli(["hostfile", "--format", "deepspeed", "--placement", str(_placement_file(tmp_path)),
              "--output", str(tmp_path / "hostfile"), "--", "train.py", "--deepspeed"])
    assert r.returncode == 0, r.stderr
    command = r.stdout.splitlines()[-1].split()
    include = next(w.split("=", 1)[1] for w in command if w.startswith("--include="))
    per_host = [w.replace(g.FILES, str(tmp_path)) for w in g.deepspeed_commands(P, ["train.py"])[1].argv[1:]]
    out = subprocess.run([sys.executable, "-c", DS_PARSE, str(tmp_path / "hostfile"), include,
                          json.dumps(command[1:]), json.dumps(per_host)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.split("RESULT ", 1)[1])
    assert got["pool"] == {"node-1": 3, "node-2": 2}
    assert got["active"] == {"node-1": [0, 2], "node-2": [1]}
    assert got["args"] == [str(tmp_path / "hostfile"), "node-1", "train.py", ["--deepspeed"]]
    assert got["per_host"] == [True, 1, include]


# -- torchrun's own parser -----------------------------------------------------------------------------------
TORCHRUN_PARSE = r"""
import json, sys
from torch.distributed import run
out = []
for argv in json.loads(sys.argv[1]):
    a = run.parse_args(argv)
    out.append([a.nnodes, a.nproc_per_node, a.rdzv_backend, a.rdzv_endpoint, a.rdzv_id, a.rdzv_conf, a.local_addr,
                a.training_script, a.training_script_args, list(run.parse_min_max_nnodes(a.nnodes))])
print("RESULT " + json.dumps(out))
"""


@pytest.mark.engines
def test_torchrun_parses_each_hosts_command_line() -> None:
    """torchrun's own argument parser reads each host's line as meant (in a subprocess: torch stays out
    of the test process, where gpusd checks whether CUDA libraries are loaded)."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed (the engines extra)")
    argvs = [c.argv[1:] for c in g.torchrun_commands(P, ["train.py", "--lr", "1"])]
    out = subprocess.run([sys.executable, "-c", TORCHRUN_PARSE, json.dumps(argvs)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.split("RESULT ", 1)[1])
    script = ["train.py", ["--lr", "1"], [2, 2]]
    assert got == [["2", "2", "c10d", "node-1:29400", "job-7", "is_host=1", "node-1", *script],
                   ["2", "1", "c10d", "node-1:29400", "job-7", "is_host=0", "node-2", *script]]


# -- Horovod's own parsers ------------------------------------------------------------------------------------
@pytest.mark.engines
def test_horovod_parses_hosts_and_runs_the_discovery_script(tmp_path: Path) -> None:
    hosts = pytest.importorskip("horovod.runner.common.util.hosts")
    discovery = pytest.importorskip("horovod.runner.elastic.discovery")
    parsed = hosts.parse_hosts(g.horovod_hosts(P))
    assert [(h.hostname, h.slots) for h in parsed] == [("node-1", 2), ("node-2", 1)]
    script = tmp_path / "discover.sh"
    r = _cli(["hostfile", "--format", "horovod", "--placement", str(_placement_file(tmp_path)),
              "--output", str(script), "--", "train.py"])
    assert r.returncode == 0, r.stderr
    assert f"--host-discovery-script {script}" in r.stdout
    env_pp = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(SRC)
    try:
        found = discovery.HostDiscoveryScript(str(script), slots=1).find_available_hosts_and_slots()
    finally:
        if env_pp is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = env_pp
    assert found == {"node-1": 2, "node-2": 1}


# -- Open MPI: mpirun itself ------------------------------------------------------------------------------------
@pytest.mark.engines
def test_mpirun_accepts_the_hostfile(tmp_path: Path) -> None:
    """``mpirun --hostfile`` with our file: Open MPI lays out the slots as the placement says (checked
    with --display-map, no process started remotely)."""
    if shutil.which("mpirun") is None:
        pytest.skip("Open MPI is not installed (Debian: apt-get install openmpi-bin)")
    (tmp_path / "hostfile").write_text(g.mpi_hostfile(P))
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    r = subprocess.run(["mpirun", "--hostfile", str(tmp_path / "hostfile"), "--display-map", "-np", "3",
                        "--map-by", "slot", "--do-not-launch", "true"], capture_output=True, text=True, env=env,
                       timeout=60)
    ranks: dict[str, list[int]] = {}
    slots: dict[str, int] = {}
    node = ""
    for line in r.stdout.splitlines():
        m = re.search(r"Data for node: (\S+)\s+Num slots: (\d+)", line)
        if m:
            node = m.group(1)
            slots[node] = int(m.group(2))
            ranks[node] = []
        m = re.search(r"Process rank: (\d+)", line)
        if m:
            ranks[node].append(int(m.group(1)))
    assert slots == {"node-1": 2, "node-2": 1}, r.stdout + r.stderr
    assert ranks == {"node-1": [0, 1], "node-2": [2]}  # what the per-rank wrapper expects


def test_hostfile_output_never_writes_through_a_symlink(tmp_path: Path) -> None:
    """Another user's symlink at the output path (a shared directory) is refused, the target untouched."""
    target = tmp_path / "victim"
    target.write_text("precious\n")
    link = tmp_path / "hostfile"
    link.symlink_to(target)
    r = _cli(["hostfile", "--format", "mpi", "--placement", str(_placement_file(tmp_path)), "--output", str(link)])
    assert r.returncode != 0 and "symbolic link" in r.stderr
    assert target.read_text() == "precious\n" and link.is_symlink()
    r = _cli(["hostfile", "--format", "mpi", "--placement", str(_placement_file(tmp_path)),
              "--output", str(tmp_path / "plain")])
    assert r.returncode == 0 and (tmp_path / "plain").read_text() == "node-1 slots=2\nnode-2 slots=1\n"


def test_each_mpi_rank_carries_its_own_hosts_lease(tmp_path: Path) -> None:
    """mpirun starts the other hosts' ranks itself: each rank's wrapper sets GPUSD_LEASE to its own
    host's lease (GPUSD_RANK_LEASES, passed with -x), so that host's daemon knows the rank."""
    from gpusd.engines.plan import commands_for

    (cmd,) = commands_for("mpirun", P, ["true"], python=sys.executable, leases=["aaaaaaaaaaaa", "bbbbbbbbbbbb"])
    assert cmd.env["GPUSD_RANK_LEASES"] == "aaaaaaaaaaaa;bbbbbbbbbbbb"
    assert cmd.argv[cmd.argv.index("GPUSD_RANK_LEASES") - 1] == "-x"
    env = {**os.environ, **cmd.env, "PYTHONPATH": str(SRC)}
    show = [sys.executable, "-m", "gpusd.engines.rank_gpu", "--", "sh", "-c",
            'echo "$GPUSD_LEASE $CUDA_VISIBLE_DEVICES"']
    seen = [subprocess.run(show, capture_output=True, text=True, env={
        **env, "OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_LOCAL_RANK": str(lr)}).stdout for r, lr in
        ((0, 0), (1, 1), (2, 0))]
    assert seen == ["aaaaaaaaaaaa 0\n", "aaaaaaaaaaaa 2\n", "bbbbbbbbbbbb 1\n"], seen
    r = subprocess.run(show, capture_output=True, text=True, env={
        **env, "GPUSD_RANK_LEASES": "x;y z", "OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0"})
    assert r.returncode == 2 and "not a lease id" in r.stderr and "Traceback" not in r.stderr


def test_rank_wrapper_refuses_an_entry_that_names_no_gpu() -> None:
    """Every entry is checked before the rank's variables are set: a word that is neither an index nor a
    GPU UUID never becomes a rank's CUDA_VISIBLE_DEVICES."""
    env = {**os.environ, "GPUSD_RANK_GPUS": "node-1=0,-oops", "OMPI_COMM_WORLD_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "PYTHONPATH": str(SRC)}
    r = subprocess.run([sys.executable, "-m", "gpusd.engines.rank_gpu", "--", "sh", "-c", "echo ran"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 2 and "not a GPU: '-oops'" in r.stderr and "ran" not in r.stdout, r.stderr


def test_rank_wrapper_gives_a_mig_slice_by_its_uuid() -> None:
    p = Placement.from_dict({"hosts": [{"hostname": "node-1", "gpus": [0, 1],
                                        "uuids": ["GPU-aaaa-1111", "MIG-bbbb-2222"]}]})
    env = {**os.environ, "GPUSD_RANK_GPUS": g.rank_gpus(p), "OMPI_COMM_WORLD_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "PYTHONPATH": str(SRC)}
    r = subprocess.run([sys.executable, "-m", "gpusd.engines.rank_gpu", "--", "sh", "-c",
                        'echo "$CUDA_DEVICE_ORDER $CUDA_VISIBLE_DEVICES"'], capture_output=True, text=True, env=env,
                       timeout=60)
    assert r.stdout == "PCI_BUS_ID MIG-bbbb-2222\n", r.stderr


def test_rank_wrapper_says_126_for_a_command_it_cannot_execute(tmp_path: Path) -> None:
    script = tmp_path / "train.sh"
    script.write_text("#!/bin/sh\necho ran\n")
    script.chmod(0o644)  # not executable: the shell's 126, not "not found"
    env = {**os.environ, "GPUSD_RANK_GPUS": g.rank_gpus(P), "OMPI_COMM_WORLD_RANK": "0",
           "OMPI_COMM_WORLD_LOCAL_RANK": "0", "PYTHONPATH": str(SRC)}
    r = subprocess.run([sys.executable, "-m", "gpusd.engines.rank_gpu", "--", str(script)], capture_output=True,
                       text=True, env=env, timeout=60)
    assert r.returncode == 126 and "cannot run" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "gpusd.engines.rank_gpu", "--", str(tmp_path / "missing")],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 127, r.stderr
