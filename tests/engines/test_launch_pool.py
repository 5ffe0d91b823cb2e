"""The engine commands reserve from the pool (issue 10 + 11, docs/engines.md): on a namespace LAN with a
daemon per host (fleet secret, fake NVML) and an sshd per host, ``gpusd launch -n 4 --per-host 2``,
``gpusd hostfile -n N -- CMD`` and ``gpusd ray up -n N`` / ``ray down`` take their GPUs as remote leases,
hold them while the job runs (visible in the daemons' leases), and leave no lease behind.  Skipped (with
the reason) without root, ``ip netns`` or OpenSSH."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from fakenvml import make_gpus
from netns import GpuHost, Lan, Node, lan, netns_ok  # noqa: F401
from sshd import SshFleet, sshd_ok  # noqa: F401
from waiting import wait_until_sync

pytestmark = pytest.mark.timeout(300)
BIN = str(Path(sys.executable).parent)
SRC = str(Path(__file__).resolve().parents[2] / "src")
FAKE_RAY = str(Path(__file__).resolve().parent / "scripts" / "fake_ray")
TTL = "6"  # leases outlive the 3 s waits for "no lease left" (so those prove releases, not expiries), and
# a renewal delayed a few seconds on a loaded machine does not lose them


def _secret(path: Path) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return path


def _leased(lan: Lan, host: GpuHost) -> dict[int, list[dict[str, Any]]]:  # noqa: F811
    """GPU index -> its leases, as the host itself shows them (gpusd devices --json)."""
    r = lan.gpusd(host.node, ["devices", "--json"], env=host.env)
    assert r.returncode == 0, r.stderr
    return {g["index"]: g["leases"] for g in json.loads(r.stdout)["gpus"] if g.get("leases")}


def _wait_for(pred: Any, timeout: float, what: str) -> Any:
    return wait_until_sync(pred, timeout, step=0.1, what=what)  # the one wait helper (tests/waiting.py)


@pytest.fixture
def pool(lan: Lan, sshd_ok: None, tmp_path: Path):  # type: ignore[no-untyped-def]  # noqa: F811
    """Two GPU hosts with 3 fake GPUs each (daemons sharing a fleet secret, an sshd each) and a client."""
    key = _secret(tmp_path / "fleet.key")
    hosts = []
    for i, name in enumerate(("node-1", "node-2"), 1):
        hosts.append(lan.add_gpu_host(name, make_gpus(3), fast=True, node_name=f"h{i}",
                                      args=["--token-file", str(key), "--interval", "0.2"],
                                      extra_env={"GPUSD_LEASE_SOCKET": str(lan.workdir / f"h{i}-lease.sock")}))
    for h in hosts:
        h.start()
    client = lan.add_node("c1")
    (tmp_path / "client-state").mkdir()
    # an ssh session on a host sees that host's lock directory, and gpusd from this tree (the guards
    # of gpusd ray up run there), as on a real host where gpusd is installed
    host_env = {h.hostname: {"GPUSD_LOCK_DIR": h.env["GPUSD_LOCK_DIR"], "PYTHONPATH": SRC,
                             "PATH": f"{BIN}:/usr/sbin:/usr/bin:/sbin:/bin"} for h in hosts}
    with SshFleet(lan, [(h.node, h.hostname) for h in hosts], workdir=tmp_path / "ssh", host_env=host_env) as fleet:
        env = lan.base_env(client, GPUSD_MDNS_FAST="1", GPUSD_SSH_CONFIG=str(fleet.config),
                           GPUSD_STATE_DIR=str(tmp_path / "client-state"), GPUSD_TOKEN_FILE=str(key),
                           PATH=f"{BIN}:/usr/sbin:/usr/bin:/sbin:/bin")
        yield lan, hosts, client, env


def _no_lease_left(lan: Lan, hosts: list[GpuHost]) -> None:  # noqa: F811
    _wait_for(lambda: not any(_leased(lan, h) for h in hosts), 3, "every lease to end")


def test_launch_reserves_runs_with_the_reserved_gpus_and_releases(pool, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """gpusd launch -n 4 --per-host 2: 2 GPUs on each host, leased from its daemon while the ranks run
    (each rank sees exactly the GPUs its host's daemon leased), released at the end; and on Ctrl-C."""
    lan, hosts, client, env = pool
    go = tmp_path / "go"
    script = f'echo "visible=$CUDA_VISIBLE_DEVICES"; while [ ! -e {go} ]; do sleep 0.1; done'
    proc = lan.popen(client, [sys.executable, "-m", "gpusd", "launch", "-n", "4", "--per-host", "2", "--ttl", TTL,
                              "--no-chdir", "command", "--", "sh", "-c", script], env=env,
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        held = _wait_for(lambda: [_leased(lan, h) for h in hosts] if all(len(_leased(lan, h)) == 2 for h in hosts)
                         else None, 30, "2 leases on each host")
        for leases in held:  # the reservation, as each daemon holds it: the job's note, from the client
            for (le,) in leases.values():
                assert le["remote_from"] == client.ip and "gpusd launch command" in le["command"], le
        # held for more than a TTL: renewed while the job runs (the same leases, later expiries)
        time.sleep(float(TTL) + 1)
        now = [_leased(lan, h) for h in hosts]
        if [{i: le[0]["lease_id"] for i, le in x.items()} for x in now] != [
                {i: le[0]["lease_id"] for i, le in x.items()} for x in held]:
            proc.kill()
            raise AssertionError(f"the leases were not renewed: {now} {held} {proc.communicate()}")
        assert all(le[0]["expires"] > held[k][i][0]["expires"] for k, x in enumerate(now) for i, le in x.items())
        go.touch()
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    seen = dict(line.split(" ", 1) for line in out.splitlines())
    assert seen == {f"[{h.hostname}#{i}]": "visible=" + ",".join(map(str, sorted(held[i]))) for i, h in
                    enumerate(hosts)} or seen == {f"[{h.hostname}#{1 - i}]": "visible=" + ",".join(
                        map(str, sorted(held[i]))) for i, h in enumerate(hosts)}, (out, held)
    _no_lease_left(lan, hosts)

    # Ctrl-C: every rank stops, and the GPUs go back to the pool
    go.unlink()
    proc = lan.popen(client, [sys.executable, "-m", "gpusd", "launch", "-n", "2", "--per-host", "1", "--ttl", "30",
                              "--no-chdir", "command", "--", "sh", "-c", script], env=env,
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: all(_leased(lan, h) for h in hosts), 30, "a lease on each host")
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    _no_lease_left(lan, hosts)  # released by gpusd, not by expiry (TTL 30 s)


def test_hostfile_holds_the_reservation_while_its_command_runs(pool, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """gpusd hostfile -n 2 --format json -- true: the JSON names 2 GPUs of one host, no lease is left;
    Horovod's discovery script prints what gpusd holds: the hosts while the command runs, nothing after."""
    lan, hosts, client, env = pool
    r = lan.gpusd(client, ["hostfile", "-n", "2", "--ttl", TTL, "--format", "json", "--", "true"], env=env)
    assert r.returncode == 0, r.stderr
    view = json.loads(r.stdout)
    assert len(view["hosts"]) == 1 and len(view["hosts"][0]["gpus"]) == 2, view
    assert view["hosts"][0]["hostname"] in ("node-1", "node-2")
    _no_lease_left(lan, hosts)

    disc = tmp_path / "discover.sh"
    during = tmp_path / "during.txt"
    r = lan.gpusd(client, ["hostfile", "-n", "2", "--per-host", "1", "--ttl", TTL, "--format", "horovod",
                           "--output", str(disc), "--", "sh", "-c", f"{disc} > {during}"], env=env)
    assert r.returncode == 0, r.stderr
    assert sorted(during.read_text().split()) == ["node-1:1", "node-2:1"]
    after = lan.run(client, [str(disc)], env=env)
    assert after.returncode == 0 and after.stdout == "", after.stdout + after.stderr
    _no_lease_left(lan, hosts)


def test_hostfile_without_a_command_holds_until_release(pool, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Without CMD, the reservation outlives the command (like gpusd reserve) until gpusd release ID."""
    lan, hosts, client, env = pool
    r = lan.gpusd(client, ["hostfile", "-n", "1", "--ttl", TTL, "--format", "mpi"], env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() in ("node-1 slots=1", "node-2 slots=1"), r.stdout
    assert "gpusd release " in r.stderr, r.stderr
    lease_id = r.stderr.split("gpusd release ")[1].split()[0]
    time.sleep(float(TTL) + 1)  # renewed in the background
    assert sum(len(_leased(lan, h)) for h in hosts) == 1
    records = list((tmp_path / "client-state" / "jobs").glob("*.json"))  # what Horovod's discovery reads
    assert len(records) == 1
    r = lan.gpusd(client, ["release", lease_id], env=env)
    assert r.returncode == 0, r.stderr
    _no_lease_left(lan, hosts)
    # the job's record goes with the reservation (its renewer removes it as it ends)
    _wait_for(lambda: not records[0].exists(), 10, "the job record to be removed")


@pytest.mark.engines
def test_ray_up_holds_the_reservation_until_ray_down(pool, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    lan, hosts, client, env = pool
    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray is not installed (the engines extra)")
    if subprocess.run(["pgrep", "-f", "ray::|raylet|gcs_server"], capture_output=True).returncode == 0:
        pytest.skip("Ray processes already run on this machine: the test would stop them")
    base = ["--ray", f"{BIN}/ray", "--state-dir", str(tmp_path / "ray-state")]
    try:
        # a longer TTL: Ray's start loads the machine, and a late heartbeat must not lose the lease here
        r = lan.gpusd(client, ["ray", "up", "-n", "2", "--per-host", "1", "--ttl", "8", *base, "--",
                               "--object-store-memory=100000000"], env=env, timeout=180)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert f"{hosts[0].ip}:6379" in r.stdout or f"{hosts[1].ip}:6379" in r.stdout, r.stdout
        time.sleep(10)  # held by the renewer after gpusd ray up returned, beyond the TTL
        leased = [_leased(lan, h) for h in hosts]
        assert [len(x) for x in leased] == [1, 1], (leased, r.stderr)
    finally:
        r = lan.gpusd(client, ["ray", "down", *base], env=env, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    _no_lease_left(lan, hosts)  # released by ray down (within 3 s, before the 8 s TTL could end them)
    assert not (tmp_path / "ray-state" / "ray-placement.json").exists()


@pytest.mark.engines
def test_torchrun_all_reduce_on_gpus_reserved_from_the_pool(pool, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The issue's command: gpusd launch -n 4 --per-host 2 torchrun -- allreduce.py, reserving with a
    constraint (--exclude 1): every rank all-reduces over gloo and sees the GPUs reserved on its host."""
    lan, hosts, client, env = pool
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed (the engines extra)")
    script = Path(__file__).resolve().parent / "scripts" / "allreduce.py"
    r = lan.gpusd(client, ["launch", "-n", "4", "--per-host", "2", "--exclude", "1", "--ttl", "10",
                           "--env", "PATH", "--env", "OMP_NUM_THREADS=1",
                           "torchrun", "--", str(script)], env=env, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    results = [json.loads(line.partition("RESULT ")[2]) for line in r.stdout.splitlines() if "RESULT " in line]
    assert sorted(res["rank"] for res in results) == [0, 1, 2, 3], r.stdout[-3000:]
    assert all(res["world"] == 4 and res["sum"] == 10.0 for res in results)
    assert sorted(res["address"] for res in results) == sorted([h.ip for h in hosts for _ in range(2)])
    assert all(res["cuda_visible_devices"] == "0,2" and res["cuda_device_order"] == "PCI_BUS_ID" for res in results)
    _no_lease_left(lan, hosts)


# -- a Ray cluster ends with its reservation (issue 18, items 18 and 19) ------------------------------------
def _raylets() -> set[tuple[str, str]]:
    """The fake Ray nodes running (tests/engines/scripts/fake_ray): (node address, its GPUs)."""
    out = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            words = (proc / "cmdline").read_bytes().split(b"\0")
            state = (proc / "stat").read_bytes().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if b"fake-raylet" in words and state not in (b"Z", b"X"):
            i = words.index(b"fake-raylet")
            out.add((words[i + 1].decode(), words[i + 2].decode()))
    return out


def _nodes_of(record: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """A cluster's lease ids -> its Ray node there (address, GPUs)."""
    return {d["lease_id"]: (h["address"], ",".join(map(str, h["gpus"])))
            for d, h in zip(record["leases"], record["placement"]["hosts"])}


def _held_leases(hosts: list[GpuHost]) -> set[str]:  # noqa: F811
    """The lease ids live in the hosts' lock directories, as the daemons hold them (read directly: a
    lease that is gone here is one the daemon may grant again)."""
    from gpusd.alloc.leases import LeaseStore

    return {le.lease_id for h in hosts for le in LeaseStore(h.env["GPUSD_LOCK_DIR"]).leases()}


def _ray_up(lan: Lan, client: Node, env: dict[str, str], state: Path, *extra: str,  # noqa: F811
            python: tuple[str, ...] = ("--python", sys.executable)) -> dict[str, Any]:
    before = {p.name for p in (state / "ray").glob("*.json")} if (state / "ray").is_dir() else set()
    r = lan.gpusd(client, ["ray", "up", "-n", "2", "--per-host", "1", "--ray", FAKE_RAY, *python,
                           "--state-dir", str(state), *extra], env=env, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (new,) = [p for p in (state / "ray").glob("*.json") if p.name not in before]
    record = json.loads(new.read_text())
    assert f"Ray cluster {record['id']}" in r.stderr and "gpusd ray down " + record["id"] in r.stderr, r.stderr
    if "--for" not in extra:  # held 24 h: the end is tomorrow, and says so
        assert re.search(r"at most until \d{4}-\d\d-\d\d \d\d:\d\d:\d\d, --for", r.stderr), r.stderr
    return record


def _watch_until_gone(hosts: list[GpuHost], record: dict[str, Any], timeout: float) -> None:  # noqa: F811
    """Until the cluster's leases and its Ray nodes are gone: at no moment is a lease gone (its GPUs
    free for anyone) while its Ray node still runs."""
    leases = _nodes_of(record)
    deadline = time.monotonic() + timeout
    while True:
        held = _held_leases(hosts) & set(leases)  # first the leases, then the nodes: a node seen after
        nodes = _raylets()  # its lease was seen gone ran on GPUs that could be given again
        for lease, node in leases.items():
            assert lease in held or node not in nodes, f"the Ray node {node} runs after its lease ended"
        if not held and not any(node in nodes for node in leases.values()):
            return
        assert time.monotonic() < deadline, f"still held or running after {timeout}s: {held} {nodes}"
        time.sleep(0.05)


def _kill_raylets() -> None:
    """What a failed test left running (only fake_ray's processes, by pid)."""
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and b"fake-raylet" in (proc / "cmdline").read_bytes().split(b"\0"):
                os.kill(int(proc.name), signal.SIGKILL)
        except OSError:
            pass


def test_a_ray_cluster_stops_before_its_reservation_ends(pool, tmp_path: Path, request) -> None:  # type: ignore[no-untyped-def]
    """gpusd ray up holds its GPUs with a background renewer: when it is killed (a laptop closed), or
    --for is over, the leases run out — and every host stops its Ray node before its lease ends, so
    no GPU is given to someone else while Ray still uses it.  (Ray itself: the engines test below.)"""
    lan, hosts, client, env = pool
    state = tmp_path / "ray-state"
    request.addfinalizer(_kill_raylets)
    a = _ray_up(lan, client, env, state, "--ttl", "4")
    b = _ray_up(lan, client, env, state, "--ttl", "4", "--for", "6s")
    assert _raylets() == {*_nodes_of(a).values(), *_nodes_of(b).values()}  # a node per host and cluster
    assert _held_leases(hosts) == {d["lease_id"] for rec in (a, b) for d in rec["leases"]}
    os.kill(a["renewer_pid"], signal.SIGKILL)  # cluster a: nobody renews from now on
    _watch_until_gone(hosts, a, 30)
    _watch_until_gone(hosts, b, 30)  # cluster b: --for 6s is over, its leases run out
    # nothing left to stop: ray down says so for each host, and forgets the clusters
    r = lan.gpusd(client, ["ray", "down", "--all", "--state-dir", str(state)], env=env, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert list((state / "ray").glob("*.json")) == []


def test_ray_down_stops_one_cluster_of_several(pool, tmp_path: Path, request) -> None:  # type: ignore[no-untyped-def]
    """Two gpusd ray up: two records; ray down alone asks which; ray down ID stops that cluster's nodes
    (and only those) and releases its GPUs at once; --all the rest."""
    lan, hosts, client, env = pool
    state = tmp_path / "ray-state"
    request.addfinalizer(_kill_raylets)
    a = _ray_up(lan, client, env, state, "--ttl", "30")
    b = _ray_up(lan, client, env, state, "--ttl", "30")
    assert a["id"] != b["id"]
    base = ["ray", "down", "--state-dir", str(state)]
    r = lan.gpusd(client, base, env=env, timeout=60)
    assert r.returncode == 2 and "say which" in r.stderr and a["id"] in r.stderr and b["id"] in r.stderr, r.stderr
    assert _raylets() == {*_nodes_of(a).values(), *_nodes_of(b).values()}  # nothing was stopped
    r = lan.gpusd(client, [*base, a["id"]], env=env, timeout=120)
    assert r.returncode == 0 and f"stopping Ray cluster {a['id']}" in r.stderr, r.stdout + r.stderr
    assert _raylets() == set(_nodes_of(b).values())  # a's nodes are gone, b's run on
    held = _held_leases(hosts)  # a's GPUs are back (released, long before the 30 s TTL), b's held
    assert held == set(_nodes_of(b)), (held, a["leases"], b["leases"])
    r = lan.gpusd(client, [*base, "nosuch"], env=env, timeout=60)
    assert r.returncode == 1 and b["id"] in r.stderr, r.stderr
    r = lan.gpusd(client, [*base, "--all"], env=env, timeout=120)
    assert r.returncode == 0 and b["id"] in r.stderr, r.stderr
    assert _raylets() == set() and _held_leases(hosts) == set()
    assert not _renewer_alive(a["renewer_pid"]) and not _renewer_alive(b["renewer_pid"])  # no orphaned renewer


def _renewer_alive(pid: int) -> bool:
    try:
        return b"gpusd.pool.renewer" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _ray_processes(nodes: list[Node]) -> dict[str, list[int]]:  # noqa: F811
    """Ray's processes in each namespace host (by its address): raylet, GCS, workers, dashboard..."""
    inodes = {os.stat(f"/run/netns/{n.ns}").st_ino: n.ip for n in nodes}
    out: dict[str, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (proc / "stat").read_bytes().rsplit(b")", 1)[1].split()[0]
            ns = os.readlink(proc / "ns" / "net")
        except (OSError, IndexError):
            continue
        if state in (b"Z", b"X") or not any(k in cmdline for k in (
                "raylet", "gcs_server", "ray/_private/", "ray/dashboard", "ray::", "default_worker.py")):
            continue
        ip = inodes.get(int(ns.partition("[")[2].rstrip("]") or 0))
        if ip is not None:
            out.setdefault(ip, []).append(int(proc.name))
    return out


@pytest.mark.engines
def test_ray_stops_on_every_host_before_its_gpus_can_be_given_again(pool, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The issue's case with Ray itself: gpusd ray up -n 2 --per-host 1, a task on each GPU, then the
    renewer is killed (a laptop closed).  Every host stops its Ray node — raylet, workers and all —
    before its lease ends: at no moment is a lease gone while Ray still runs on that host."""
    lan, hosts, client, env = pool
    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray is not installed (the engines extra)")
    if subprocess.run(["pgrep", "-f", "ray::|raylet|gcs_server"], capture_output=True).returncode == 0:
        pytest.skip("Ray processes already run on this machine: the test would stop them")
    state = tmp_path / "ray-state"
    base = ["--ray", f"{BIN}/ray", "--state-dir", str(state)]
    nodes = [h.node for h in hosts]
    driver = None
    try:
        r = lan.gpusd(client, ["ray", "up", "-n", "2", "--per-host", "1", "--ttl", "10", *base, "--",
                               "--object-store-memory=100000000"], env=env, timeout=180)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        (path,) = (state / "ray").glob("*.json")
        record = json.loads(path.read_text())
        started = tmp_path / "started"
        started.mkdir()
        driver = lan.popen(client, [sys.executable, str(Path(__file__).resolve().parent / "scripts" /
                                                         "ray_hold_gpus.py"), record["address"], str(started)],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            _wait_for(lambda: len(list(started.iterdir())) == 2 or driver.poll() is not None, 120,
                      "a task on each GPU")
            assert driver.poll() is None
        except AssertionError:
            driver.kill()
            raise AssertionError(f"the driver: {driver.communicate()[0][-3000:]}") from None
        running = _ray_processes(nodes)
        assert set(running) == {h.ip for h in hosts}, running
        os.kill(record["renewer_pid"], signal.SIGKILL)  # nobody renews from now on
        leases = {d["lease_id"]: h["address"] for d, h in zip(record["leases"], record["placement"]["hosts"])}
        deadline = time.monotonic() + 60
        while True:
            held = _held_leases(hosts) & set(leases)  # the leases first, then Ray's processes
            procs = _ray_processes(nodes)
            for lease, ip in leases.items():
                assert lease in held or not procs.get(ip), f"Ray runs on {ip} after its lease ended: {procs[ip]}"
            if not held and not procs:
                break
            assert time.monotonic() < deadline, (held, procs)
            time.sleep(0.05)
    finally:
        if driver is not None:
            driver.kill()
            driver.communicate(timeout=30)
        lan.gpusd(client, ["ray", "down", "--all", *base], env=env, timeout=120)
    assert _ray_processes(nodes) == {}


def test_a_cut_link_stops_the_remote_ranks_before_their_lease_ends(pool, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The client's cable is pulled while gpusd launch runs: nothing reaches the host any more (no
    renewal, no end of the ssh channel).  The rank there is stopped by its watchdog when gpusd's
    heartbeats stop coming, before the host's daemon lets the lease expire."""
    lan, hosts, client, env = pool
    pidfile = tmp_path / "rank.pid"
    script = f"echo $$ > {pidfile}; while :; do sleep 0.2; done"
    proc = lan.popen(client, [sys.executable, "-m", "gpusd", "launch", "-n", "1", "--ttl", "9", "--grace", "1",
                              "--no-chdir", "command", "--", "sh", "-c", script], env=env,
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    cut = False
    try:
        _wait_for(lambda: pidfile.exists() and pidfile.read_text().strip(), 60, "the rank to start")
        rank = int(pidfile.read_text())
        (lease,) = _held_leases(hosts)
        subprocess.run(["ip", "-n", lan.switch, "link", "set", f"v{client.index}", "down"], check=True)
        cut = True
        deadline = time.monotonic() + 40
        while True:
            held = lease in _held_leases(hosts)  # the lease first, then the rank
            alive = Path(f"/proc/{rank}").exists() and b"Z" not in Path(f"/proc/{rank}/stat").read_bytes(
                ).rsplit(b")", 1)[1].split()[:1]
            assert held or not alive, "the rank still runs after its lease ended"
            if not alive:
                break
            assert time.monotonic() < deadline, "the rank still runs 40 s after the link was cut"
            time.sleep(0.05)
    finally:
        if cut:
            subprocess.run(["ip", "-n", lan.switch, "link", "set", f"v{client.index}", "up"])
        try:
            proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode != 0  # gpusd learnt it too: ssh gave up, or the lease was lost


def test_ray_down_that_cannot_reach_a_host_lets_its_lease_run_out(pool, tmp_path: Path, request) -> None:  # type: ignore[no-untyped-def]
    """ray down cannot ssh to one host (its sshd is gone; its daemon still answers): it says so and
    stops renewing instead of releasing, so that host's guard still stops its Ray node before its lease
    ends there (a release would free the GPUs under the running node)."""
    lan, hosts, client, env = pool
    state = tmp_path / "ray-state"
    request.addfinalizer(_kill_raylets)
    a = _ray_up(lan, client, env, state, "--ttl", "4")
    far = next(h for h in hosts if h.hostname != a["placement"]["hosts"][0]["hostname"])  # not the head
    sshd = int((tmp_path / "ssh" / f"host-{far.node.name}" / "sshd.pid").read_text())  # started by the fixture
    os.kill(sshd, signal.SIGTERM)
    _wait_for(lambda: not Path(f"/proc/{sshd}").exists() or b" Z " in Path(f"/proc/{sshd}/stat").read_bytes(),
              10, "sshd to end")
    r = lan.gpusd(client, ["ray", "down", a["id"], "--state-dir", str(state)], env=env, timeout=120)
    assert r.returncode == 255 and "not every host" in r.stderr, r.stdout + r.stderr
    _watch_until_gone(hosts, a, 30)
    assert list((state / "ray").glob("*.json")) == []


def test_a_ray_node_on_this_machine_is_guarded_too(pool, tmp_path: Path, request) -> None:  # type: ignore[no-untyped-def]
    """ray up run on one of the GPU hosts: the node there starts without ssh, under this machine's guard
    (gpusd's own Python, no --python), and stops before its lease ends like the remote one."""
    lan, hosts, client, env = pool
    state = tmp_path / "ray-state"
    request.addfinalizer(_kill_raylets)
    here = hosts[0].node
    local_env = {**env, "GPUSD_INTERFACES": here.ip, "GPUSD_LOCK_DIR": hosts[0].env["GPUSD_LOCK_DIR"]}
    a = _ray_up(lan, here, local_env, state, "--ttl", "4", python=())
    assert here.ip in {h["address"] for h in a["placement"]["hosts"]}, a  # both hosts: this one among them
    assert _raylets() == set(_nodes_of(a).values())
    os.kill(a["renewer_pid"], signal.SIGKILL)
    _watch_until_gone(hosts, a, 30)


# -- every rank ends with its job, ranks in sessions of their own that ignore SIGTERM included ------------
STUBBORN = str(Path(__file__).resolve().parent / "scripts" / "stubborn_rank.py")


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def _kill_pids(pids: list[int]) -> None:
    """What a failed test left running (the ranks it started, by pid)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


@pytest.mark.engines
@pytest.mark.parametrize("how", ["ctrl-c", "kill-9"])
def test_no_torchrun_rank_outlives_its_lease(pool, tmp_path: Path, request, how: str) -> None:  # type: ignore[no-untyped-def]
    """gpusd launch -n 4 --per-host 2 torchrun whose ranks ignore SIGTERM (torchrun starts each in a
    session of its own and waits 30 s for them): stopped by Ctrl-C of the launcher, or by kill -9 of
    it, no rank runs on any host once the job's leases have ended — and every rank carries its host's
    lease (the daemon knows it by GPUSD_LEASE)."""
    lan, hosts, client, env = pool
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed (the engines extra)")
    ranks_dir = tmp_path / "ranks"
    ranks_dir.mkdir()
    proc = lan.popen(client, [sys.executable, "-m", "gpusd", "launch", "-n", "4", "--per-host", "2", "--ttl", "10",
                              "--grace", "2", "--env", "PATH", "--env", "OMP_NUM_THREADS=1", "--no-chdir",
                              "torchrun", "--", STUBBORN, str(ranks_dir)], env=env,
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids: list[int] = []
    request.addfinalizer(lambda: _kill_pids(pids))
    try:
        _wait_for(lambda: len(list(ranks_dir.glob("*.pid"))) == 4, 180, "4 ranks to start")
        pids.extend(int(p.read_text()) for p in ranks_dir.glob("*.pid"))
        leases = _held_leases(hosts)
        assert len(leases) == 2, leases
        for pid in pids:  # each rank in its own session, naming its host's lease
            env_of = (Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
            named = {w.split(b"=", 1)[1].decode() for w in env_of if w.startswith(b"GPUSD_LEASE=")}
            assert len(named) == 1 and named <= leases, named
            assert os.getsid(pid) == pid
        if how == "ctrl-c":
            proc.send_signal(signal.SIGINT)
        else:
            proc.kill()
        deadline = time.monotonic() + 60
        while True:
            held = _held_leases(hosts) & leases  # first the leases, then the ranks: a rank seen after its
            running = [pid for pid in pids if _alive(pid)]  # lease was seen gone ran on GPUs free for others
            assert held or not running, f"ranks {running} still run after the job's leases ended ({how})"
            if not held and not running:
                break
            assert time.monotonic() < deadline, f"after 60 s: leases {held}, ranks {running}"
            time.sleep(0.05)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    if how == "ctrl-c":
        assert proc.returncode == 130, err[-3000:]
