"""One authority per GPU (docs/slurm.md): the Slurm jobs' leases the lease authority holds for
``gpusd slurm prolog``/``epilog``, and the refusal of gpusd's own leases on a Slurm node.  The lease
server runs in this process on the fake NVML (tests/authority_helpers.py); the real Slurm drives the
same requests in tests/slurm/test_slurm_lan.py."""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import time
from typing import Any

import pytest

from authority_helpers import ServerThread
from conftest import gpusd_cli
from fakenvml import make_gpus
from other_user import ALICE, MALLORY, AsUser, as_user, needs_root


@pytest.fixture
def authority(fake_nvml_inprocess: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    d = tempfile.mkdtemp(prefix="gpusd-slurm-", dir="/tmp")  # reachable by a second user
    os.chmod(d, 0o755)
    monkeypatch.setenv("GPUSD_LEASE_SOCKET", os.path.join(d, "lease.sock"))
    fake_nvml_inprocess.write(make_gpus(2))
    server = ServerThread()
    yield server
    server.stop()
    shutil.rmtree(d, ignore_errors=True)


def _env(cli_env: dict[str, str]) -> dict[str, str]:
    return dict(cli_env, GPUSD_LEASE_SOCKET=os.environ["GPUSD_LEASE_SOCKET"])


def _leases(env: dict[str, str]) -> list[dict[str, Any]]:
    r = gpusd_cli(["devices", "--json"], env=env)
    assert r.returncode == 0, r.stderr
    return [dict(le, gpu=g["index"]) for g in json.loads(r.stdout)["gpus"] for le in g.get("leases") or []]


def _ask(req: dict[str, Any]) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(os.environ["GPUSD_LEASE_SOCKET"])
        s.sendall(json.dumps(req).encode() + b"\n")
        out: dict[str, Any] = json.loads(s.makefile("rb").readline())
        return out


def _prolog(env: dict[str, str], job: str, gpus: str, uid: int = 0) -> Any:
    return gpusd_cli(["slurm", "prolog"], env=dict(env, SLURM_JOB_ID=job, SLURM_JOB_GPUS=gpus,
                                                   SLURM_JOB_UID=str(uid)))


def test_the_prolog_records_the_job_gpus_as_its_lease_and_the_epilog_ends_it(authority: Any,
                                                                           cli_env: dict[str, str]) -> None:
    env = _env(cli_env)
    r = _prolog(env, "42", "1")
    assert r.returncode == 0, r.stderr
    [held] = _leases(env)
    assert (held["gpu"], held["slurm_job"], held["command"], held["user"]) == (1, "42", "slurm job 42", "root")
    # gpusd's own choice avoids it: a second lease gets GPU 0, a third none
    r = gpusd_cli(["env", "-n", "2"], env=env)
    assert r.returncode == 4, r.stdout
    # a second prolog for the same job (Slurm retries) changes nothing; another job cannot have GPU 1
    assert _prolog(env, "42", "1").returncode == 0 and len(_leases(env)) == 1
    r = _prolog(env, "43", "1")
    assert r.returncode == 4 and "GPU" in r.stderr, r.stderr  # never given twice: the prolog fails
    r = gpusd_cli(["slurm", "epilog"], env=dict(env, SLURM_JOB_ID="42"))
    assert r.returncode == 0, r.stderr
    assert _leases(env) == []
    assert gpusd_cli(["slurm", "epilog"], env=dict(env, SLURM_JOB_ID="42")).returncode == 0  # twice: no harm


def test_a_gpu_gpusd_leased_already_fails_the_prolog(authority: Any, cli_env: dict[str, str]) -> None:
    env = _env(cli_env)
    import subprocess
    import sys

    holder = subprocess.Popen([sys.executable, "-m", "gpusd", "run", "--include", "0", "--", "sleep", "30"], env=env)
    try:
        deadline = time.monotonic() + 30
        while not _leases(env) and time.monotonic() < deadline:
            time.sleep(0.2)
        r = _prolog(env, "7", "0")
        assert r.returncode == 4, r.stderr
        assert [le.get("slurm_job") for le in _leases(env)] == [None]
    finally:
        holder.kill()
        holder.wait(10)


@needs_root
def test_only_root_may_record_a_slurm_job(authority: Any, cli_env: dict[str, str]) -> None:
    """A local user cannot take GPUs in a Slurm job's name, nor end a job's lease (root is who runs
    Slurm's prolog; the kernel says who asks)."""
    env = _env(cli_env)
    got = as_user(MALLORY, lambda: _ask({"op": "slurm", "v": 2, "action": "begin", "slurm_job": "9", "uid": 0,
                                         "devices": ["0"]}))
    assert "only root" in got and _leases(env) == []
    assert _prolog(env, "9", "0").returncode == 0
    got = as_user(MALLORY, lambda: _ask({"op": "slurm", "v": 2, "action": "end", "slurm_job": "9"}))
    assert "only root" in got and len(_leases(env)) == 1


def test_on_a_slurm_node_gpusd_leases_are_refused_saying_how_to_ask_slurm(authority: Any,
                                                                          cli_env: dict[str, str]) -> None:
    env = _env(cli_env)
    authority.server.slurm = True
    r = gpusd_cli(["run", "--", "true"], env=env)
    assert r.returncode == 4 and "srun --gres=gpu:1" in r.stderr, r.stderr
    r = gpusd_cli(["run", "-n", "2", "--", "true"], env=env)  # the hint asks Slurm for as many GPUs
    assert r.returncode == 4 and "srun --gres=gpu:2 " in r.stderr and "salloc --gres=gpu:2 " in r.stderr, r.stderr
    assert _leases(env) == []
    assert _prolog(env, "5", "0,1").returncode == 0  # Slurm's own still are recorded
    assert {le["gpu"] for le in _leases(env)} == {0, 1}


def test_malformed_slurm_requests_get_a_usage_answer(authority: Any) -> None:
    for req in ({"action": "begin"}, {"action": "begin", "slurm_job": "1;x", "uid": 0, "devices": ["0"]},
                {"action": "begin", "slurm_job": "1", "uid": -1, "devices": ["0"]},
                {"action": "begin", "slurm_job": "1", "uid": 0, "devices": []},
                {"action": "begin", "slurm_job": "1", "uid": 0, "devices": ["7"]},
                {"action": "drop", "slurm_job": "1"}):
        reply = _ask({"op": "slurm", "v": 2, **req})
        assert reply["ok"] is False and reply["error"] == "usage", (req, reply)


_kept: list[Any] = []


@needs_root
def test_a_user_record_claiming_a_slurm_job_is_shown_without_it(fake_nvml: Any, cli_env: dict[str, str],
                                                                shared_tmp: Any) -> None:
    """A local user's own lease cannot pass for a Slurm job's: only root's records (the lease
    authority) name one."""
    from gpusd.alloc.handle import Holder
    from gpusd.alloc.leases import LeaseStore

    fake_nvml.write(make_gpus(1))
    locks = shared_tmp / "locks"
    env = dict(cli_env, GPUSD_LOCK_DIR=str(locks), GPUSD_LEASE_SOCKET="off")
    LeaseStore(locks).ensure()
    uuid = json.loads(gpusd_cli(["devices", "--json"], env=env).stdout)["gpus"][0]["uuid"]

    def forge() -> str:
        lease = LeaseStore(locks).acquire([uuid], holder=Holder(slurm_job="42", command="slurm job 42"))
        assert lease is not None
        _kept.append(lease)  # held while the child lives
        return "held"

    mallory = AsUser(MALLORY, forge, stay=True)
    try:
        assert mallory.result == "ok held", mallory.result
        [held] = _leases(env)
        assert held["user"] == str(MALLORY) and held.get("slurm_job") is None, held
    finally:
        mallory.stop()


def test_a_restarted_authority_takes_the_leases_of_running_jobs_again(fake_nvml_inprocess: Any, tmp_path: Any,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     cli_env: dict[str, str]) -> None:
    """The Slurm jobs' leases end with the daemon; the next one takes those of the jobs the controller
    says still run (and forgets the others), so a restart between prolog and epilog loses nothing."""
    from gpusd.daemon.slurmjobs import restore

    monkeypatch.setenv("GPUSD_LEASE_SOCKET", str(tmp_path / "lease.sock"))
    fake_nvml_inprocess.write(make_gpus(2))
    env = _env(cli_env)
    state = tmp_path / "slurm-jobs.json"
    first = ServerThread()
    try:
        first.server.slurm_jobs.state = state
        assert _prolog(env, "42", "1", uid=ALICE).returncode == 0
        assert _prolog(env, "43", "0").returncode == 0
    finally:
        first.stop()
    assert _leases(env) == []  # they ended with the daemon
    second = ServerThread()
    try:
        second.server.slurm_jobs.state = state
        back = restore(second.server.slurm_jobs, lambda req: second.server.slurm_answer(req, 0),
                       lambda job: job == "42")  # the controller: 42 runs, 43 has ended
        assert back == ["42"]
        [held] = _leases(env)
        assert (held["gpu"], held["slurm_job"], held["user"]) == (1, "42", str(ALICE))
        assert set(json.loads(state.read_text())["jobs"]) == {"42"}
        assert gpusd_cli(["slurm", "epilog"], env=dict(env, SLURM_JOB_ID="42")).returncode == 0
        assert _leases(env) == [] and json.loads(state.read_text())["jobs"] == {}
    finally:
        second.stop()


@pytest.mark.parametrize("n, lost", [(2, 0), (8, 0), (8, 3)])
def test_the_prolog_numbers_gpus_as_the_gres_conf_gpusd_wrote(authority: Any, fake_nvml_inprocess: Any,
                                                              cli_env: dict[str, str], n: int, lost: int) -> None:
    """Slurm's GPU N is the N-th GPU of the gres.conf the daemon wrote (a lost GPU is left out of it),
    never NVML's GPU N: a lost GPU at position 0 or in the middle, with 2 and 8 GPUs."""
    from gpusd.model import GpuInfo, HostSnapshot
    from gpusd.slurm.conf import gres_gpus

    gpus = make_gpus(n)
    gpus[lost].errors = {"*": 15}  # fallen off the bus
    fake_nvml_inprocess.write(gpus)
    env = _env(cli_env)
    shown = json.loads(gpusd_cli(["devices", "--json"], env=env).stdout)["gpus"]
    snap = HostSnapshot("node", "n", 0.0, gpus=[GpuInfo(index=g["index"], uuid=g["uuid"], healthy=g["healthy"])
                                                  for g in shown])
    assert not snap.gpus[lost].healthy
    authority.server.slurm_jobs.order = [g.uuid for g in gres_gpus(snap)]  # what write_gres keeps
    present = [i for i in range(n) if i != lost]
    assert _prolog(env, "7", "0").returncode == 0  # Slurm's first GPU: the first one present
    assert [le["gpu"] for le in _leases(env)] == [present[0]]
    if len(present) > 1:
        r = _prolog(env, "8", str(len(present) - 1))  # Slurm's last GPU: the last one present
        assert r.returncode == 0, r.stderr
        assert sorted(le["gpu"] for le in _leases(env)) == [present[0], present[-1]]
    r = _prolog(env, "9", str(len(present)))  # past the end of gres.conf: Slurm cannot name it
    assert r.returncode != 0 and "lists" in r.stderr, r.stderr
    assert lost not in [le["gpu"] for le in _leases(env)]
    if n == 8:  # a job of two GPUs (across the gap where it is in the middle)
        a, b = (lost - 1, lost) if lost else (1, 2)
        assert _prolog(env, "10", f"{a},{b}").returncode == 0
        assert {le["gpu"] for le in _leases(env) if le["slurm_job"] == "10"} == {present[a], present[b]}


def test_a_job_the_controller_cannot_be_asked_about_is_held_until_it_says_it_ended(
        fake_nvml_inprocess: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, cli_env: dict[str, str]) -> None:
    """No controller to ask at restart (no SLURM_CONF, no cache yet): a remembered job is never taken
    for ended -- its lease is held again -- and ends once the controller says so."""
    from gpusd.daemon.slurmjobs import recheck, restore

    monkeypatch.setenv("GPUSD_LEASE_SOCKET", str(tmp_path / "lease.sock"))
    fake_nvml_inprocess.write(make_gpus(2))
    env = _env(cli_env)
    state = tmp_path / "slurm-jobs.json"
    first = ServerThread()
    try:
        first.server.slurm_jobs.state = state
        assert _prolog(env, "42", "1", uid=ALICE).returncode == 0
    finally:
        first.stop()
    second = ServerThread()
    try:
        jobs = second.server.slurm_jobs
        jobs.state = state
        assert restore(jobs, lambda req: second.server.slurm_answer(req, 0), lambda job: None) == ["42"]
        [held] = _leases(env)
        assert (held["gpu"], held["slurm_job"]) == (1, "42") and jobs.unsure == {"42"}
        assert recheck(jobs, lambda job: None) == ["42"] and len(_leases(env)) == 1  # still nobody to ask
        assert recheck(jobs, lambda job: False) == []  # the controller: it has ended
        assert _leases(env) == [] and json.loads(state.read_text())["jobs"] == {}
    finally:
        second.stop()
