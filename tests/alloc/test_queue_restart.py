"""Waiting through the daemon survives a stop or restart of the daemon (docs/allocation.md, "Waiting").

A ``gpusd run --wait`` queued at the lease authority keeps its place when the daemon stops: the
daemon leaves its ticket, the next daemon locks it again for the waiter (the kernel's pid and uid,
SO_PEERCRED) and the waiter asks again, says so on stderr and runs when its turn comes.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading

import pytest

from authority_helpers import ServerThread, kill_group, wait_for
from conftest import gpusd_cli
from fakenvml import make_gpus

GPUSD = [sys.executable, "-m", "gpusd"]
# A daemon that is not root leases in the shared directory, where tickets are their users' own: only
# root's daemon, in its own directory, keeps places (docs/allocation.md, "The authority's own directory").
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="only root's daemon keeps waiters' places")


def _state(env: dict[str, str]) -> dict:
    return json.loads(gpusd_cli(["leases", "--json"], env=env).stdout)




def _queued_pids(env: dict[str, str]) -> list[int]:
    return [w["pid"] for w in _state(env)["waiting"]]


@as_root
def test_queued_jobs_keep_their_places_across_a_daemon_restart(fake_nvml_inprocess, cli_env, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="gpusd.daemon.leasesock")
    fake_nvml_inprocess.write(make_gpus(1))
    out = tmp_path / "order"
    server = ServerThread()
    holder = subprocess.Popen([*GPUSD, "run", "--", "sleep", "60"], env=cli_env, start_new_session=True)
    waiters: list[subprocess.Popen] = []
    try:
        assert wait_for(lambda: len(_state(cli_env)["leases"]) == 1)
        for n in range(3):  # queued one after the other: 1, 2, 3
            waiters.append(subprocess.Popen(
                [*GPUSD, "run", "--wait", "--", "sh", "-c", f"echo {n + 1} >> {out}"], env=cli_env,
                start_new_session=True, stderr=subprocess.PIPE, text=True))
            assert wait_for(lambda n=n: len(_queued_pids(cli_env)) == n + 1)
        assert _queued_pids(cli_env) == [w.pid for w in waiters]
        # The first waiter cannot ask the next daemon before the others do: a daemon that queued
        # clients in the order they came back would put it last.
        os.kill(waiters[0].pid, signal.SIGSTOP)
        server.stop()
        server = ServerThread()
        # the two others came back, and the daemon kept the first one's place while it is away
        assert wait_for(lambda: all(f"pid {w.pid} (uid 0) waits again in its place" in caplog.text
                                     for w in waiters[1:]))
        assert _queued_pids(cli_env) == [w.pid for w in waiters]
        os.kill(waiters[0].pid, signal.SIGCONT)
        assert all(w.poll() is None for w in waiters)  # nobody gave up
        kill_group(holder)  # the GPU frees: they run one by one, in their order
        for w in waiters:
            assert w.wait(timeout=60) == 0
            err = w.stderr.read() if w.stderr else ""
            assert "the gpusd daemon restarted while this job waited: queued there again, in its place" in err, err
            assert len([line for line in err.splitlines() if "restarted" in line]) == 1, err
        assert out.read_text().split() == ["1", "2", "3"]
        assert _state(cli_env)["queued"] == []
    finally:
        for w in waiters:
            try:
                os.kill(w.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            kill_group(w)
        kill_group(holder)
        server.stop()


@as_root
def test_a_client_that_says_it_waited_before_gets_no_place_it_did_not_have(fake_nvml_inprocess, cli_env):
    """The place is the kernel's: the pid and uid of the connection, matched to the ticket the previous
    daemon left.  A request that only claims to come back is queued behind everyone."""
    from gpusd.alloc.authority import socket_path

    fake_nvml_inprocess.write(make_gpus(1))
    server = ServerThread()
    holder = subprocess.Popen([*GPUSD, "run", "--", "sleep", "60"], env=cli_env, start_new_session=True)
    waiter = None
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        assert wait_for(lambda: len(_state(cli_env)["leases"]) == 1)
        waiter = subprocess.Popen([*GPUSD, "run", "--wait", "--", "true"], env=cli_env, start_new_session=True,
                                  stderr=subprocess.PIPE, text=True)
        assert wait_for(lambda: _queued_pids(cli_env) == [waiter.pid])
        os.kill(waiter.pid, signal.SIGSTOP)  # away while the daemon restarts: its place is kept for it
        server.stop()
        server = ServerThread()
        s.settimeout(10)
        s.connect(str(socket_path()))
        s.sendall(json.dumps({"op": "lease", "v": 2, "count": 1, "wait": True, "requeue": True,
                              "command": "liar"}).encode() + b"\n")
        f = s.makefile("rb")
        assert json.loads(f.readline()) == {"op": "requeued", "kept": False}
        assert wait_for(lambda: _queued_pids(cli_env) == [waiter.pid, os.getpid()])  # behind the real one
        os.kill(waiter.pid, signal.SIGCONT)
        kill_group(holder)
        assert waiter.wait(timeout=60) == 0  # it came back first, in its place
        f.close()
    finally:
        s.close()
        if waiter is not None:
            try:
                os.kill(waiter.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            kill_group(waiter)
        kill_group(holder)
        server.stop()


def test_a_waiter_whose_daemon_does_not_come_back_waits_in_the_lock_directory(fake_nvml_inprocess, cli_env,
                                                                              monkeypatch, capsys):
    from gpusd.alloc import authority
    from gpusd.alloc.api import LeaseRequest, allocate
    from gpusd.alloc.select import Constraints

    monkeypatch.setattr(authority, "REQUEUE_WAIT", 1.0, raising=False)
    fake_nvml_inprocess.write(make_gpus(1))
    server = ServerThread()
    holder = subprocess.Popen([*GPUSD, "run", "--", "sleep", "60"], env=cli_env, start_new_session=True)
    box: dict = {}

    def wait() -> None:
        try:
            box["selection"] = allocate(LeaseRequest(Constraints(count=1), wait=True, timeout=60))
        except Exception as exc:  # noqa: BLE001 - the test says what it was
            box["error"] = exc

    waiter = threading.Thread(target=wait)
    try:
        assert wait_for(lambda: len(_state(cli_env)["leases"]) == 1)
        waiter.start()
        assert wait_for(lambda: len(_state(cli_env)["queued"]) == 1)
        server.stop()  # and no daemon comes back: the holder keeps its lease (handed over)
        assert wait_for(lambda: _queued_pids(cli_env) == [os.getpid()])  # queued in the lock directory
        assert "selection" not in box and "error" not in box
        kill_group(holder)
        waiter.join(60)
        assert "error" not in box, box.get("error")
        box["selection"].release()
        err = capsys.readouterr().err
        assert "none answered within 1s: waiting in the lock directory's queue instead" in err
    finally:
        kill_group(holder)
        waiter.join(60)


@as_root
@pytest.mark.parametrize("how", ["stop", "kill9"])
def test_jobs_queued_at_a_daemon_process_run_after_it_is_stopped_or_killed_and_started_again(
        fake_nvml, cli_env, tmp_path, how):
    from authority_helpers import DaemonProcess

    fake_nvml.write(make_gpus(1))
    out = tmp_path / "order"
    daemon = DaemonProcess(cli_env, tmp_path / "state")
    daemon.start()
    holder = subprocess.Popen([*GPUSD, "run", "--", "sleep", "60"], env=cli_env, start_new_session=True)
    waiters: list[subprocess.Popen] = []
    try:
        assert wait_for(lambda: len(_state(cli_env)["leases"]) == 1)
        for n in range(2):
            waiters.append(subprocess.Popen(
                [*GPUSD, "run", "--wait", "--", "sh", "-c", f"echo {n + 1} >> {out}"], env=cli_env,
                start_new_session=True, stderr=subprocess.PIPE, text=True))
            assert wait_for(lambda n=n: len(_queued_pids(cli_env)) == n + 1)
        first, second = waiters
        os.kill(first.pid, signal.SIGSTOP)  # it comes back last (and after a kill -9 the GPU is free)
        if how == "stop":
            daemon.stop()  # SIGTERM: what gpusd stop and systemd send
        else:
            daemon.kill9()
        daemon.start()
        assert wait_for(lambda: f"pid {second.pid} (uid 0) waits again in its place" in daemon.log())
        assert _queued_pids(cli_env) == [first.pid, second.pid]  # the absent first one's place is kept
        os.kill(first.pid, signal.SIGCONT)
        kill_group(holder)
        for w in waiters:
            assert w.wait(timeout=60) == 0
            assert "queued there again, in its place" in (w.stderr.read() if w.stderr else "")
        assert out.read_text().split() == ["1", "2"]
    finally:
        for w in waiters:
            try:
                os.kill(w.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            kill_group(w)
        kill_group(holder)
        daemon.stop()
