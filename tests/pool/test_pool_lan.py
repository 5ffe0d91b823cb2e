"""The fleet pool on a LAN of network namespaces (issue 10, docs/pool.md): remote leases held by a
host's daemon, fleet selection, ``gpusd reserve``/``release``/``reservations`` and ``gpusd run
--fleet`` over real SSH (one sshd per host, tests/sshd.py).  Skipped (with the reason) without root,
``ip netns`` or OpenSSH."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from fakenvml import make_gpus
from netns import GpuHost, Lan, Node, lan, netns_ok  # noqa: F401
from waiting import wait_until_sync

TTL = 3.0


def secret_file(path: Path, value: str) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    return path


def gpu_host(lan: Lan, name: str, n: int, key: Path) -> GpuHost:  # noqa: F811
    node_name = f"h{len(lan.nodes) + 1}"
    return lan.add_gpu_host(name, make_gpus(n), fast=True, node_name=node_name,
                            args=["--token-file", str(key), "--interval", "0.2"],
                            extra_env={"GPUSD_LEASE_SOCKET": str(lan.workdir / f"{node_name}-lease.sock")})


def start_all(hosts: list[GpuHost]) -> None:
    with ThreadPoolExecutor(len(hosts)) as pool:
        list(pool.map(lambda h: h.start(), hosts))


def gpusd(lan: Lan, node: Node, args: list[str], env: dict[str, str] | None = None,  # noqa: F811
          timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return lan.gpusd(node, args, env=env if env is not None else lan.base_env(node, GPUSD_MDNS_FAST="1"),
                     timeout=timeout)


def devices_json(lan: Lan, host: GpuHost) -> dict[str, Any]:  # noqa: F811
    r = gpusd(lan, host.node, ["devices", "--json"], env=host.env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def leases_of(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    return [le for g in snapshot["gpus"] for le in g.get("leases") or []]


def wait_for(pred: Any, timeout: float, what: str) -> Any:
    return wait_until_sync(pred, timeout, step=0.1, what=what)  # the one wait helper (tests/waiting.py)


def signed(lan: Lan, node: Node, method: str, url: str, key_file: Path | None, body: Any = None) -> dict[str, Any]:  # noqa: F811
    """One request from ``node``: signed with ``key_file``'s secret (None: unsigned)."""
    code = f"""
import json
from gpusd.wire.http import request_json
from gpusd.wire.signing import FleetKey, load_secret
kf = {str(key_file) if key_file else None!r}
key = FleetKey(load_secret(kf)) if kf else None
node = None
if key is not None and {method!r} != "GET":  # a signed write names the daemon's node (docs/security.md)
    from urllib.parse import urlsplit
    from gpusd.wire.http import fetch_json
    parts = urlsplit({url!r})
    node = fetch_json(f"{{parts.scheme}}://{{parts.netloc}}/api/v1/host").data["node_id"]
r = request_json({method!r}, {url!r}, {body!r}, key=key, node_id=node)
print(json.dumps({{"status": r.status, "data": r.data, "verified": r.verified}}))
"""
    r = lan.run(node, [sys.executable, "-c", code], timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


SRC = Path(__file__).resolve().parents[2] / "src"
BIN = str(Path(sys.executable).parent)


def gpusd_there(host: GpuHost) -> dict[str, str]:
    """What a login on ``host`` sees (sshd's SetEnv): gpusd on the PATH, this source tree, and the
    host's lock directory, the one its daemon leases in (on a real host: the installed gpusd and
    the default lock directory)."""
    return {"PATH": f"{BIN}:/usr/sbin:/usr/bin:/sbin:/bin", "PYTHONPATH": str(SRC),
            "GPUSD_LOCK_DIR": host.env["GPUSD_LOCK_DIR"]}


def jobs_of(lan: Lan, node: Node, env: dict[str, str], *args: str) -> list[dict[str, Any]]:  # noqa: F811
    r = gpusd(lan, node, ["jobs", "--json", *args], env=env)
    assert r.returncode == 0, r.stderr
    return list(json.loads(r.stdout)["jobs"])


@pytest.mark.timeout(240)
def test_a_reservation_shows_everywhere_and_ends_by_release_by_expiry_and_with_its_killed_client(
        lan: Lan, tmp_path: Path) -> None:  # noqa: F811
    key = secret_file(tmp_path / "fleet.key", secrets.token_hex(32))
    h1 = gpu_host(lan, "node-1", 2, key)
    start_all([h1])
    client = lan.add_node("client")
    env = lan.base_env(client, GPUSD_MDNS_FAST="1")
    tok = ["--token-file", str(key)]

    r = gpusd(lan, client, ["reserve", "-n", "1", "--ttl", str(TTL), "--for", "1h", "--note", "notebook", "--json",
                            *tok], env=env)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    lease_id, renewer = res["leases"][0]["lease_id"], res["renewer_pid"]
    assert res["host"] == "node-1"
    assert res["env"]["CUDA_VISIBLE_DEVICES"] in ("0", "1")
    uuid = res["leases"][0]["devices"][0]["uuid"]
    try:
        # on the host itself (gpusd devices reads the lock directory): holder, note, origin, expiry
        local = wait_for(lambda: [le for le in leases_of(devices_json(lan, h1)) if le["lease_id"] == lease_id],
                         5, "the lease in gpusd devices")
        assert local[0]["device"] == uuid and local[0]["remote_from"] == client.ip
        assert "@" in local[0]["user"]
        assert local[0]["command"] == "notebook" and local[0]["expires"] > time.time()
        table = gpusd(lan, h1.node, ["devices"], env=h1.env).stdout
        assert re.search(r"@\d\d:\d\d:\d\d", table), table  # the holder, and until when

        # renewed in the background: still there after several TTLs
        time.sleep(2.5 * TTL)
        assert any(le["lease_id"] == lease_id for le in leases_of(devices_json(lan, h1)))

        # gpusd list (from the client), with holder and expiry; gpusd top --once; the fleet JSON
        r = gpusd(lan, client, ["list", "--json", *tok], env=env)
        listed = [le for d in json.loads(r.stdout) for le in d["gpu"]["leases"]]
        assert any(le["lease_id"] == lease_id and le["user"] and le["expires"] for le in listed), r.stdout
        r = gpusd(lan, client, ["list", *tok], env=env)
        assert "reserved" in r.stdout, r.stdout
        r = gpusd(lan, client, ["top", "--once", "--width", "200", *tok], env=env)
        assert "until" in r.stdout, r.stdout + r.stderr
        # the dashboard's data: the daemon's fleet view (signed, over HTTPS)
        fleet = signed(lan, client, "GET", f"https://{h1.ip}:4781/api/v1/fleet", key)
        assert fleet["verified"] is True
        shown = [le for host in fleet["data"]["hosts"] for g in (host["snapshot"] or {}).get("gpus", [])
                 for le in g["leases"]]
        assert [(le["lease_id"], le["user"], le["remote_from"]) for le in shown] == [
            (lease_id, local[0]["user"], client.ip)] and shown[0]["expires"]
        r = gpusd(lan, client, ["reservations", "--json", *tok], env=env)
        mine = json.loads(r.stdout)["reservations"]
        assert [d["lease_id"] for d in mine] == [lease_id]

        # gpusd release: gone from the host
        r = gpusd(lan, client, ["release", lease_id, *tok], env=env)
        assert r.returncode == 0, r.stderr
        wait_for(lambda: not leases_of(devices_json(lan, h1)), 3, "the released lease to go")
    finally:
        try:
            os.kill(renewer, signal.SIGKILL)
        except ProcessLookupError:
            pass

    # kill -9 of the reserving client's renewer: free within TTL + 2 s
    r = gpusd(lan, client, ["reserve", "-n", "2", "--ttl", str(TTL), "--json", *tok], env=env)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert len(leases_of(devices_json(lan, h1))) == 2, (res, h1.log_tail())
    os.kill(res["renewer_pid"], signal.SIGKILL)
    # free again once the TTL runs out (nobody released them); the time it takes is measured in
    # bench/bench_pool.py ("failure"), not asserted here: a loaded machine is slow to start processes
    wait_for(lambda: not leases_of(devices_json(lan, h1)), TTL + 10, "the GPUs to be free again")


@pytest.mark.timeout(240)
def test_strangers_cannot_create_renew_or_release_leases(lan: Lan, tmp_path: Path) -> None:  # noqa: F811
    key = secret_file(tmp_path / "fleet.key", secrets.token_hex(32))
    wrong = secret_file(tmp_path / "wrong.key", secrets.token_hex(32))
    h1 = gpu_host(lan, "node-1", 1, key)
    start_all([h1])
    evil = lan.add_node("evil")
    https = f"https://{h1.ip}:4781/api/v1"
    http = f"http://{h1.ip}:4780/api/v1"
    body = {"count": 1, "holder": "mallory", "ttl": 30}
    for url in (https, http):
        for kf in (None, wrong):
            got = signed(lan, evil, "POST", url + "/leases", kf, body)
            assert got["status"] in (401, 405), got
    assert not leases_of(devices_json(lan, h1))
    # signed with the right secret but over plain HTTP from another machine: refused (TLS is on)
    got = signed(lan, evil, "POST", http + "/leases", key, body)
    assert got["status"] == 403, got
    # the real thing, then the stranger tries to renew and release it
    got = signed(lan, evil, "POST", https + "/leases", key, body)
    assert got["status"] == 201 and got["verified"] is True, got
    lease_id = got["data"]["lease_id"]
    for kf in (None, wrong):
        assert signed(lan, evil, "POST", f"{https}/leases/{lease_id}/renew", kf, {})["status"] == 401
        assert signed(lan, evil, "DELETE", f"{https}/leases/{lease_id}", kf)["status"] == 401
    assert [le["lease_id"] for le in leases_of(devices_json(lan, h1))] == [lease_id]
    # a reader without the secret sees the lease, not its holder
    public = signed(lan, evil, "GET", http + "/leases", None)
    assert public["data"]["leases"][0]["lease_id"] == lease_id and public["data"]["leases"][0]["user"] is None
    # the GPU is taken: a second request is answered 409 with the reason
    again = signed(lan, evil, "POST", https + "/leases", key, body)
    assert again["status"] == 409 and "GPU" in again["data"]["error"], again
    assert signed(lan, evil, "DELETE", f"{https}/leases/{lease_id}", key)["status"] == 200
    assert not leases_of(devices_json(lan, h1))


@pytest.mark.timeout(300)
def test_two_clients_race_for_the_last_gpu_the_winner_runs_over_ssh(lan: Lan, tmp_path: Path) -> None:  # noqa: F811
    from sshd import SshFleet, unavailable

    if unavailable():
        pytest.skip(unavailable() or "")
    key = secret_file(tmp_path / "fleet.key", secrets.token_hex(32))
    h1 = gpu_host(lan, "node-1", 2, key)
    h2 = gpu_host(lan, "node-2", 1, key)
    start_all([h1, h2])
    c1, c2 = lan.add_node("c1"), lan.add_node("c2")
    # node-1's two GPUs are held by a local job (gpusd run on that host): node-2's one GPU is the last
    local_job = lan.popen(h1.node, [sys.executable, "-m", "gpusd", "run", "-n", "2", "--", "sleep", "60"],
                          env=h1.env)
    wait_for(lambda: len(leases_of(devices_json(lan, h1))) == 2, 10, "the local job's leases")
    # (each host's gpusd, with its own lock directory, for the job record the fleet run writes there)
    with SshFleet(lan, [(h1.node, "node-1"), (h2.node, "node-2")], workdir=tmp_path / "ssh",
                  host_env={"node-1": gpusd_there(h1), "node-2": gpusd_there(h2)}) as fleet:
        cmd = ["run", "--fleet", "-n", "1", "--ttl", str(TTL), "--token-file", str(key), "--",
               "sh", "-c", 'echo "CVD=$CUDA_VISIBLE_DEVICES ORDER=$CUDA_DEVICE_ORDER"; '
                           'ip -o -4 addr show dev eth0; sleep 2; exit 7']

        def go(node: Node) -> subprocess.CompletedProcess[str]:  # noqa: F811
            env = lan.base_env(node, GPUSD_MDNS_FAST="1", GPUSD_SSH_CONFIG=str(fleet.config))
            return gpusd(lan, node, cmd, env=env, timeout=90)

        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(go, [c1, c2]))
    local_job.terminate()
    winners = [r for r in results if r.returncode == 7]
    losers = [r for r in results if r.returncode != 7]
    assert len(winners) == 1, [(r.returncode, r.stdout, r.stderr) for r in results]
    out = winners[0].stdout
    assert "CVD=0 ORDER=PCI_BUS_ID" in out and f"inet {h2.ip}/" in out, out
    assert losers[0].returncode == 4, (losers[0].returncode, losers[0].stderr)  # no GPU qualifies
    # the winner's lease ended with its command
    wait_for(lambda: not leases_of(devices_json(lan, h2)), 3, "the winner's lease to end")


@pytest.mark.timeout(240)
def test_a_client_waiting_for_the_fleet_gets_the_gpu_when_it_is_released(lan: Lan, tmp_path: Path) -> None:  # noqa: F811
    key = secret_file(tmp_path / "fleet.key", secrets.token_hex(32))
    h1 = gpu_host(lan, "node-1", 1, key)
    start_all([h1])
    c1, c2 = lan.add_node("c1"), lan.add_node("c2")
    tok = ["--token-file", str(key)]
    r = gpusd(lan, c1, ["reserve", "-n", "1", "--json", *tok])
    assert r.returncode == 0, r.stderr
    first = json.loads(r.stdout)
    try:
        r = gpusd(lan, c2, ["reserve", "-n", "1", *tok])
        assert r.returncode == 4 and "no verified host" in r.stderr, (r.returncode, r.stderr)  # told no
        waiter = subprocess.Popen(["ip", "netns", "exec", c2.ns, sys.executable, "-m", "gpusd", "reserve", "-n", "1",
                                   "--wait", "--timeout", "60", "--json", *tok],
                                  env=lan.base_env(c2, GPUSD_MDNS_FAST="1"), stdout=subprocess.PIPE, text=True)
        lan.procs.append(waiter)
        time.sleep(3)
        assert waiter.poll() is None  # still waiting
        assert gpusd(lan, c1, ["release", first["leases"][0]["lease_id"], *tok]).returncode == 0
        out, _ = waiter.communicate(timeout=30)
        assert waiter.returncode == 0
        second = json.loads(out)
        assert second["host"] == "node-1" and second["leases"][0]["lease_id"] != first["leases"][0]["lease_id"]
        os.kill(second["renewer_pid"], signal.SIGTERM)  # the renewer releases as it stops
        try:
            wait_for(lambda: not leases_of(devices_json(lan, h1)), 5, "the second lease to end")
        except AssertionError:
            raise AssertionError((second, leases_of(devices_json(lan, h1)), h1.log_tail(10))) from None
    finally:
        try:
            os.kill(first["renewer_pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass  # it saw its lease released, and stopped


@pytest.mark.timeout(240)
def test_run_fleet_passes_stdin_stdout_stderr_and_signals_over_ssh(lan: Lan, tmp_path: Path) -> None:  # noqa: F811
    from sshd import SshFleet, unavailable

    if unavailable():
        pytest.skip(unavailable() or "")
    key = secret_file(tmp_path / "fleet.key", secrets.token_hex(32))
    h1 = gpu_host(lan, "node-1", 2, key)
    start_all([h1])
    client = lan.add_node("client")
    # through gpusd fleet-job there (the remote side of a fleet run, which makes it a job there)
    with SshFleet(lan, [(h1.node, "node-1")], workdir=tmp_path / "ssh", host_env={"node-1": gpusd_there(h1)}) as fleet:
        env = lan.base_env(client, GPUSD_MDNS_FAST="1", GPUSD_SSH_CONFIG=str(fleet.config))
        base = [sys.executable, "-m", "gpusd", "run", "--fleet", "-n", "2", "--token-file", str(key), "--"]
        # stdin in, stdout and stderr out (the remote pid line gpusd uses is not shown), exit status back
        r = subprocess.run(["ip", "netns", "exec", client.ns, *base, "sh", "-c",
                            "tr a-z A-Z; echo oops >&2; echo $CUDA_VISIBLE_DEVICES; exit 3"],
                           input="hello\n", env=env, capture_output=True, text=True, timeout=60)
        assert (r.returncode, r.stdout, r.stderr) == (3, "HELLO\n0,1\n", "oops\n"), r
        # SIGTERM to gpusd run reaches the remote command (which reports it and exits 42)
        marker = tmp_path / "started"
        p = subprocess.Popen(["ip", "netns", "exec", client.ns, *base, "sh", "-c",
                              f"trap 'echo got TERM; exit 42' TERM; touch {marker}; while :; do sleep 0.1; done"],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lan.procs.append(p)
        wait_for(marker.exists, 30, "the remote command to start")
        time.sleep(0.5)
        p.send_signal(signal.SIGTERM)  # ip netns exec execs gpusd: this is gpusd run's pid
        out, err = p.communicate(timeout=30)
        assert p.returncode == 42 and "got TERM" in out, (p.returncode, out, err)
    wait_for(lambda: not leases_of(devices_json(lan, h1)), 5, "the lease to end with the command")


@pytest.mark.timeout(240)
def test_host_filters_per_host_and_moving_on_to_the_next_host(lan: Lan, tmp_path: Path) -> None:  # noqa: F811
    key = secret_file(tmp_path / "fleet.key", secrets.token_hex(32))
    h1, h2 = gpu_host(lan, "node-1", 1, key), gpu_host(lan, "node-2", 1, key)
    start_all([h1, h2])
    c1, c2 = lan.add_node("c1"), lan.add_node("c2")
    tok = ["--token-file", str(key), "--ttl", "3"]

    def reserve(node: Node, *args: str) -> subprocess.CompletedProcess[str]:  # noqa: F811
        return gpusd(lan, node, ["reserve", "--json", *tok, *args])

    def end(r: subprocess.CompletedProcess[str]) -> None:
        os.kill(json.loads(r.stdout)["renewer_pid"], signal.SIGTERM)

    # both hosts rank the same (idle, one GPU each; node-1 first by name): two clients at once both
    # ask node-1, one gets 409 and moves on to node-2
    with ThreadPoolExecutor(2) as pool:
        both = list(pool.map(lambda n: reserve(n, "-n", "1"), [c1, c2]))
    assert [r.returncode for r in both] == [0, 0], [r.stderr for r in both]
    assert sorted(json.loads(r.stdout)["host"] for r in both) == ["node-1", "node-2"]
    for r in both:
        end(r)
    wait_for(lambda: not leases_of(devices_json(lan, h1)) and not leases_of(devices_json(lan, h2)), 5, "releases")
    time.sleep(1)  # the snapshots the clients rank on show the GPUs free again
    # a glob on host names; a GPU model no host has; per_host: one GPU on each of two hosts
    r = reserve(c1, "-n", "1", "--host", "*-2")
    assert r.returncode == 0 and json.loads(r.stdout)["host"] == "node-2", r.stderr
    end(r)
    wait_for(lambda: not leases_of(devices_json(lan, h2)), 5, "the release")
    time.sleep(1)
    r = reserve(c1, "-n", "1", "--model", "H100")
    assert r.returncode == 4, r.stderr
    r = reserve(c1, "-n", "2", "--per-host", "1")
    assert r.returncode == 0, r.stderr
    parts = json.loads(r.stdout)["leases"]
    assert sorted(p["host"] for p in parts) == ["node-1", "node-2"] and all(len(p["devices"]) == 1 for p in parts)
    end(r)
    r = reserve(c1, "-n", "2")  # two GPUs on one host: no host has them
    assert r.returncode == 4, r.stderr


@pytest.mark.timeout(120)
def test_run_fleet_on_the_local_host_runs_without_ssh(lan: Lan, tmp_path: Path) -> None:  # noqa: F811
    key = secret_file(tmp_path / "fleet.key", secrets.token_hex(32))
    h1 = gpu_host(lan, "node-1", 2, key)
    start_all([h1])
    env = dict(h1.env, GPUSD_MDNS_FAST="1", PATH="/usr/bin:/bin")  # the host's own state: its node id
    env["GPUSD_SSH_CONFIG"] = "/nonexistent/ssh_config"  # ssh would fail (255) if it were used
    listed = tmp_path / "jobs.json"
    r = gpusd(lan, h1.node, ["run", "--fleet", "-n", "2", "--token-file", str(key), "--",
                             "sh", "-c", f"echo $CUDA_VISIBLE_DEVICES $GPUSD_LEASE $GPUSD_JOB_ID; "
                             f"{sys.executable} -m gpusd jobs --json > {listed}; exit 5"], env=env)
    assert r.returncode == 5, (r.stdout, r.stderr)
    cvd, lease, job_id = r.stdout.split()
    assert cvd == "0,1" and len(lease) == 12
    # one machine, one job record: this host's GPUs, asked from here
    (job,) = json.loads(listed.read_text())["jobs"]
    assert (job["job"], job["indices"], job["labels"], job["host"], job["lease"]) == (job_id, [0, 1], [], "node-1",
                                                                                     lease), job
    assert jobs_of(lan, h1.node, h1.env, "--all") == []
    wait_for(lambda: not leases_of(devices_json(lan, h1)), 5, "the lease to end with the command")


@pytest.mark.timeout(240)
def test_a_fleet_run_is_a_job_on_the_host_that_runs_it_and_on_the_machine_that_asked(
        lan: Lan, tmp_path: Path) -> None:  # noqa: F811
    """issue 13 item 1: while a gpusd run --fleet command runs, gpusd jobs on the host that runs it lists
    it (the user it runs as, its GPUs there, host = the machine that asked), the daemon's lease names
    it, the command has the job protocol's environment, and gpusd jobs on the asking machine lists the
    same job with its GPUs as HOST:INDEX; both records go with the command."""
    from sshd import SshFleet, unavailable

    if unavailable():
        pytest.skip(unavailable() or "")
    key = secret_file(tmp_path / "fleet.key", secrets.token_hex(32))
    h1 = gpu_host(lan, "node-1", 3, key)
    start_all([h1])
    client = lan.add_node("client")
    go, seen = tmp_path / "go", tmp_path / "seen.json"
    script = (f'printf \'{{"job": "%s", "cvd": "%s", "file": %s}}\' "$GPUSD_JOB_ID" "$CUDA_VISIBLE_DEVICES" '
              f'"$(cat "$GPUSD_JOB_FILE")" > {seen}.tmp; mv {seen}.tmp {seen}; '
              f'while [ ! -e {go} ]; do sleep 0.1; done; echo done')
    with SshFleet(lan, [(h1.node, "node-1")], workdir=tmp_path / "ssh", host_env={"node-1": gpusd_there(h1)}) as fleet:
        env = lan.base_env(client, GPUSD_MDNS_FAST="1", GPUSD_SSH_CONFIG=str(fleet.config),
                           GPUSD_HOSTNAME="laptop-7", GPUSD_LOCK_DIR=str(tmp_path / "client-locks"))
        p = lan.popen(client, [sys.executable, "-m", "gpusd", "run", "--fleet", "-n", "2", "--token-file", str(key),
                               "--", "sh", "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                      text=True)
        try:
            wait_for(seen.exists, 60, "the remote command to start")
            told = json.loads(seen.read_text())
            gpus = {g["index"]: g["uuid"] for g in devices_json(lan, h1)["gpus"]}
            indices = [int(i) for i in told["cvd"].split(",")]
            assert len(indices) == 2 and told["file"]["job"] == told["job"], told
            assert [d["index"] for d in told["file"]["devices"]] == indices
            # the host that runs it: an ordinary job of the user the command runs as (root here)
            (there,) = jobs_of(lan, h1.node, h1.env, "--all")
            assert there["job"] == told["job"] and there["state"] == "running", there
            assert (there["user"], there["uid"], there["host"]) == ("root", os.geteuid(), "laptop-7"), there
            assert there["indices"] == indices and there["devices"] == [gpus[i] for i in indices]
            assert "sh -c" in there["command"] and there["labels"] == []
            # its lease, the daemon's record, names the job (gpusd leases, top and the dashboard show it)
            held = leases_of(devices_json(lan, h1))
            assert sorted(le["device"] for le in held) == sorted(gpus[i] for i in indices)
            assert {le["job"] for le in held} == {told["job"]} and {le["lease_id"] for le in held} == {there["lease"]}
            top = wait_for(lambda: (r := gpusd(lan, client, ["top", "--once", "--width", "200", "--token-file",
                                                              str(key)], env=env)).stdout.count(f"job {told['job']}")
                           == 2 and r, 30, "gpusd top on the asking machine to show the job beside its two GPUs")
            assert "until" in top.stdout
            # the machine that asked: the same job, its GPUs as HOST:INDEX, none of this machine's
            (here,) = jobs_of(lan, client, env)
            assert (here["job"], here["state"], here["host"], here["user"]) == (told["job"], "running", "laptop-7",
                                                                              "root"), here
            assert here["labels"] == [f"node-1:{i}" for i in indices] and here["indices"] == [], here
            assert here["pid"] == p.pid and here["lease"] == there["lease"]
            table = gpusd(lan, client, ["jobs"], env=env)
            assert ",".join(here["labels"]) in table.stdout, table.stdout
            go.touch()
            out, err = p.communicate(timeout=60)
        finally:
            if p.poll() is None:
                p.kill()
        assert (p.returncode, out) == (0, "done\n"), (p.returncode, out, err)
    # both records went with the command, and the lease with them
    assert jobs_of(lan, client, env, "--all") == []
    assert jobs_of(lan, h1.node, h1.env, "--all") == []
    wait_for(lambda: not leases_of(devices_json(lan, h1)), 5, "the lease to end with the command")
