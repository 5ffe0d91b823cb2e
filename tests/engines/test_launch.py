"""gpusd launch over SSH on a namespace LAN (tests/netns.py + tests/sshd.py): one command per host, the
head run locally, output prefixed by host and rank, the first failure's status, Ctrl-C stops every host."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tests_paths
from netns import Lan, Node, lan, netns_ok, read_lines  # noqa: F401
from sshd import SshFleet, sshd_ok  # noqa: F401

SRC = str(tests_paths.SRC)


def _placement(tmp_path: Path, hosts: list[tuple[str, Node, list[int]]], job: str = "job-1") -> Path:
    path = tmp_path / "placement.json"
    path.write_text(json.dumps({"job_id": job, "hosts": [
        {"hostname": name, "address": node.ip, "ssh_target": name, "gpus": gpus} for name, node, gpus in hosts]}))
    return path


@pytest.fixture
def two_hosts(lan: Lan, sshd_ok: None, tmp_path: Path):  # type: ignore[no-untyped-def]
    h1, h2 = lan.add_node("h1"), lan.add_node("h2")
    # an ssh session imports gpusd from this tree, as a host where gpusd is installed: each host's part of
    # the job runs under gpusd's guard there
    host_env = {name: {"PYTHONPATH": SRC} for name in ("node-1", "node-2")}
    with SshFleet(lan, [(h1, "node-1"), (h2, "node-2")], workdir=tmp_path / "ssh", host_env=host_env) as fleet:
        yield lan, fleet, h1, h2


def _gpusd(lan: Lan, fleet: SshFleet, node: Node, args: list[str],
           timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return lan.run(node, [sys.executable, "-m", "gpusd", *args], env=fleet.env(node), timeout=timeout)


def test_launch_runs_one_command_per_host_with_its_gpus(two_hosts, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The head (this namespace) runs without SSH, node-2 over SSH; each sees its own GPUs and rank;
    every output line carries host and rank."""
    lan, fleet, h1, h2 = two_hosts
    pl = _placement(tmp_path, [("node-1", h1, [0, 2]), ("node-2", h2, [1])])
    script = ('echo "visible=$CUDA_VISIBLE_DEVICES order=$CUDA_DEVICE_ORDER rank=$GPUSD_NODE_RANK '
              'head=$GPUSD_HEAD via=${SSH_CONNECTION:-local} flag=$MY_FLAG"; echo oops >&2')
    r = _gpusd(lan, fleet, h1, ["launch", "--placement", str(pl), "--env", "MY_FLAG=on", "command",
                                "--", "sh", "-c", script])
    assert r.returncode == 0, r.stderr
    lines = sorted(r.stdout.splitlines())
    assert lines[0] == f"[node-1#0] visible=0,2 order=PCI_BUS_ID rank=0 head={h1.ip} via=local flag=on"
    assert lines[1].startswith(f"[node-2#1] visible=1 order=PCI_BUS_ID rank=1 head={h1.ip} via={h1.ip} ")
    assert lines[1].split()[7] == str(h2.ip) and lines[1].endswith("flag=on")
    assert sorted(r.stderr.splitlines()) == ["[node-1#0] oops", "[node-2#1] oops"]


def test_launch_returns_the_first_failing_ranks_status_and_stops_the_rest(two_hosts, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    lan, fleet, h1, h2 = two_hosts
    pl = _placement(tmp_path, [("node-1", h1, [0]), ("node-2", h2, [0])])
    mark = tmp_path / "survivor"
    # node-2 fails at once with 7; node-1 would run for a long time and then write a mark.
    script = f'if [ "$GPUSD_NODE_RANK" = 1 ]; then exit 7; fi; sleep 60; touch {mark}'
    t = time.monotonic()
    r = _gpusd(lan, fleet, h1, ["launch", "--placement", str(pl), "--grace", "2", "command", "--", "sh", "-c", script])
    assert r.returncode == 7, r.stderr
    assert "node-2#1 (node-2) exited with status 7" in r.stderr
    assert time.monotonic() - t < 50  # node-1 was stopped, not waited for (60 s)
    assert not mark.exists()


def test_launch_reports_an_unreachable_host(two_hosts, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    lan, fleet, h1, h2 = two_hosts
    pl = tmp_path / "placement.json"
    pl.write_text(json.dumps({"hosts": [{"hostname": "node-1", "address": h1.ip, "gpus": [0]},
                                        {"hostname": "node-9", "address": "198.18.0.250", "gpus": [0]}]}))
    r = _gpusd(lan, fleet, h1, ["launch", "--placement", str(pl), "--ssh-option", "ConnectTimeout=2", "command", "--",
                                "true"])
    assert r.returncode == 255 and "node-9#1 (node-9) ssh failed" in r.stderr


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_stops_every_host(two_hosts, tmp_path: Path, sig: signal.Signals) -> None:  # type: ignore[no-untyped-def]
    """SIGINT (Ctrl-C) or SIGTERM to gpusd launch: the remote command and its children are gone, the local
    one too, and the status says so.  (Namespaces share the pid space, so the test sees remote pids.)"""
    lan, fleet, h1, h2 = two_hosts
    pl = _placement(tmp_path, [("node-1", h1, [0]), ("node-2", h2, [0])])
    script = 'sleep 300 & echo "pids $$ $!"; wait'
    p = lan.popen(h1, [sys.executable, "-m", "gpusd", "launch", "--placement", str(pl), "--grace", "3", "command",
                       "--", "sh", "-c", script], env=fleet.env(h1), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout is not None
    lines = read_lines(p.stdout.fileno(), 2, 30)
    pids = [int(x) for line in lines if " pids " in line for x in line.split()[2:]]
    assert len(pids) == 4, (lines, p.stderr.read() if p.poll() is not None and p.stderr else "")
    assert all(_alive(pid) for pid in pids)
    p.send_signal(sig)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 130, err
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in pids if _alive(pid)] == []


def test_killed_launcher_leaves_no_remote_job(two_hosts, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """kill -9 of gpusd (and its ssh): the remote watchdog sees ssh's channel close and stops the job."""
    lan, fleet, h1, h2 = two_hosts
    pl = _placement(tmp_path, [("node-2", h2, [0])])
    p = lan.popen(h1, [sys.executable, "-m", "gpusd", "launch", "--placement", str(pl), "--grace", "2", "command",
                       "--", "sh", "-c", 'sleep 300 & echo "pids $$ $!"; wait'], env=fleet.env(h1),
                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    assert p.stdout is not None
    lines = read_lines(p.stdout.fileno(), 1, 30)
    pids = [int(x) for x in lines[0].split()[2:]]
    assert len(pids) == 2 and all(_alive(pid) for pid in pids)
    os.killpg(p.pid, signal.SIGKILL)  # gpusd and the ssh it started (same group)
    p.wait(10)
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in pids if _alive(pid)] == []


GLOO_PROBE = r'''
import sys
from gpusd.engines.generate import HostCommand
from gpusd.engines.launch import LaunchOptions, run_commands
from gpusd.engines.placement import Placement

p = Placement.from_dict({"job_id": "gloo-1", "hosts": [
    {"hostname": "node-1", "address": sys.argv[1], "gpus": [0]},
    {"hostname": "node-2", "address": sys.argv[2], "gpus": [0]}]})
env = {"GLOO_SOCKET_IFNAME": sys.argv[3]} if len(sys.argv) > 3 else {}
cmds = [HostCommand(h, i, ["sh", "-c", 'echo "ifname=$GLOO_SOCKET_IFNAME"'], iface_env=("GLOO_SOCKET_IFNAME",))
        for i, h in enumerate(p.hosts)]
sys.exit(run_commands(cmds, LaunchOptions(env=env)))
'''


def test_torchrun_and_deepspeed_get_the_interface_of_the_placement_address(two_hosts) -> None:  # type: ignore[no-untyped-def]
    """Where a host's name resolves to loopback (Debian's 127.0.1.1), gloo would bind 127.0.0.1: each host
    (the head here, node-2 over ssh) gets GLOO_SOCKET_IFNAME = the interface carrying its placement
    address, unless the user gives one (--env)."""
    from gpusd.engines.generate import deepspeed_commands, torchrun_commands
    from gpusd.engines.placement import Placement

    lan, fleet, h1, h2 = two_hosts
    p = Placement.of([("node-1", [0]), ("node-2", [1])])
    assert all(c.iface_env == ("GLOO_SOCKET_IFNAME",) for c in [*torchrun_commands(p, ["t.py"]),
                                                                 *deepspeed_commands(p, ["t.py"])])
    r = lan.run(h1, [sys.executable, "-c", GLOO_PROBE, h1.ip, h2.ip], env=fleet.env(h1), timeout=60)
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.splitlines()) == ["[node-1#0] ifname=eth0", "[node-2#1] ifname=eth0"], r.stdout
    r = lan.run(h1, [sys.executable, "-c", GLOO_PROBE, h1.ip, h2.ip, "lo"], env=fleet.env(h1), timeout=60)
    assert sorted(r.stdout.splitlines()) == ["[node-1#0] ifname=lo", "[node-2#1] ifname=lo"], r.stdout
