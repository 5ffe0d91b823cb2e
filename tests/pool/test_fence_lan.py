"""Fencing on a LAN of network namespaces with sshd (gpusd.daemon.fence, docs/pool.md "Fencing"): a
``gpusd run --fleet`` job whose holder is cut off past the TTL is stopped on its host (SIGTERM, then
SIGKILL after the grace, every descendant, a rank in a session of its own included) before its GPU
is granted again, and the next grant's epoch is greater.  Skipped (with the reason) without root,
``ip netns`` or OpenSSH."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from fakenvml import make_gpus
from netns import Lan, lan, netns_ok  # noqa: F401
from waiting import wait_until_sync

TTL = 3.0
GRACE = 2.0

SRC = Path(__file__).resolve().parents[2] / "src"
BIN = str(Path(sys.executable).parent)

# the job: its leader handles SIGTERM (says so, and exits); its rank, in a session of its own (as
# torchrun starts ranks), ignores SIGTERM and must be killed
JOB = r"""
import os, signal, subprocess, sys, time
d = sys.argv[1]
rank = subprocess.Popen([sys.executable, "-c", "import signal, time\n"
                         "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                         "time.sleep(600)"], start_new_session=True)
def term(*_):
    with open(os.path.join(d, "term"), "w") as f:
        f.write("SIGTERM")
    sys.exit(0)
signal.signal(signal.SIGTERM, term)
with open(os.path.join(d, "first.tmp"), "w") as f:
    job = json.load(open(os.environ["GPUSD_JOB_FILE"]))
    json.dump({"leader": os.getpid(), "rank": rank.pid, "epoch": os.environ.get("GPUSD_LEASE_EPOCH"),
               "file": [job.get("epoch"), *(g.get("epoch") for g in job["devices"])]}, f)
os.replace(os.path.join(d, "first.tmp"), os.path.join(d, "first.json"))
while True:
    time.sleep(0.1)
""".replace("import os,", "import json, os,")

# the next job on that GPU: which of the first job's processes still run as it starts
NEXT = r"""
import json, os, sys
d = sys.argv[1]
first = json.load(open(os.path.join(d, "first.json")))
def running(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
print(json.dumps({"running": [p for p in (first["leader"], first["rank"]) if running(p)],
                  "epoch": os.environ.get("GPUSD_LEASE_EPOCH")}))
"""


def secret_file(path: Path) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return path


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` now."""
    out = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return out


def stop_left(work: Path) -> None:
    """Kill what the first job left running (where the fence failed), by the pids it wrote down."""
    try:
        first = json.loads((work / "first.json").read_text())
    except (OSError, ValueError):
        return
    for pid in (first["leader"], first["rank"]):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            if str(work).encode() in cmdline or b"SIG_IGN" in cmdline:  # still the job's, not a reused pid
                os.kill(pid, 9)
        except OSError:
            pass


def link(lan: Lan, index: int, state: str) -> None:  # noqa: F811
    subprocess.run(["ip", "-n", lan.switch, "link", "set", f"v{index}", state], check=True, timeout=30)


@pytest.mark.timeout(180)
def test_a_fleet_job_cut_off_past_its_ttl_is_stopped_on_its_host_before_its_gpu_is_granted_again(
        lan: Lan, tmp_path: Path) -> None:  # noqa: F811
    from sshd import SshFleet, unavailable

    if unavailable():
        pytest.skip(unavailable() or "")
    key = secret_file(tmp_path / "fleet.key")
    h1 = lan.add_gpu_host("node-1", make_gpus(1), fast=True, node_name="h1",
                          args=["--token-file", str(key), "--interval", "0.2"],
                          extra_env={"GPUSD_LEASE_SOCKET": str(lan.workdir / "h1-lease.sock"),
                                     "GPUSD_FENCE_GRACE": str(GRACE), "GPUSD_FENCE_DELAY": "5"})
    h1.start()
    client = lan.add_node("client")
    work = tmp_path / "job"
    work.mkdir()
    (work / "job.py").write_text(JOB)
    (work / "next.py").write_text(NEXT)
    login = {"PATH": f"{BIN}:/usr/sbin:/usr/bin:/sbin:/bin", "PYTHONPATH": str(SRC),
             "GPUSD_LOCK_DIR": h1.env["GPUSD_LOCK_DIR"]}
    with SshFleet(lan, [(h1.node, "node-1")], workdir=tmp_path / "ssh", host_env={"node-1": login}) as fleet:
        env = lan.base_env(client, GPUSD_MDNS_FAST="1", GPUSD_SSH_CONFIG=str(fleet.config),
                           GPUSD_LOCK_DIR=str(tmp_path / "client-locks"))
        p = lan.popen(client, [sys.executable, "-m", "gpusd", "run", "--fleet", "-n", "1", "--ttl", str(TTL),
                               "--token-file", str(key), "--", sys.executable, str(work / "job.py"), str(work)],
                      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            wait_until_sync(lambda: (work / "first.json").exists(), 60, step=0.1,
                            what="the fleet job to start on node-1")
            first = json.loads((work / "first.json").read_text())
            # the fleet job's file on node-1 carries the grant's epoch too, for the job and its GPU
            assert first["epoch"] and first["file"] == [int(first["epoch"])] * 2, first
            link(lan, client.index, "down")  # the holder is cut off: nobody renews its lease
            # the next job on node-1 asks for the GPU at once and waits for it
            nxt = lan.run(h1.node, [sys.executable, "-m", "gpusd", "run", "--wait", "--timeout", "60", "-n", "1",
                                    "--", sys.executable, str(work / "next.py"), str(work)],
                          env=h1.env, timeout=90)
            assert nxt.returncode == 0, nxt.stderr
            then = json.loads(nxt.stdout)
            # granted only once the first job's processes were gone: the leader by SIGTERM (it said so),
            # the rank that ignores SIGTERM, in a session of its own, by SIGKILL after the grace
            assert then["running"] == [], (then, first)
            assert (work / "term").read_text() == "SIGTERM"
            # the fencing token grew: a framework can refuse the first job's writes
            assert first["epoch"] and then["epoch"] and int(then["epoch"]) > int(first["epoch"]), (first, then)
        finally:
            link(lan, client.index, "up")
            ssh = children(p.pid)  # its ssh, in a session of its own, still waiting on the cut-off link
            if p.poll() is None:
                p.kill()
                p.wait(10)
            for pid in ssh:
                try:
                    os.kill(pid, 9)
                except OSError:
                    pass
            stop_left(work)
        log = h1.log_tail(200)
        assert "SIGKILL after the" in log and str(first["rank"]) in log, log
