"""Remote leases survive a daemon restart (docs/pool.md, "Failure cases"): written down in the state
directory, their locks co-held by the keeper process or by systemd's file descriptor store (played
here by the test: a $NOTIFY_SOCKET that keeps what FDSTORE=1 sends, handed back through LISTEN_FDS);
dropped after a reboot (another boot id)."""

from __future__ import annotations

import array
import fcntl
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from daemon_helpers import unique_session
from netns import read_lines
from waiting import wait_until_sync

GPUSD = [sys.executable, "-m", "gpusd"]
SIMULATE = "2xA100-80GB"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the pool's leases are the lease authority's (root)")


class Daemon:
    """``gpusd start --foreground`` in a subprocess, on loopback, with a fleet secret."""

    def __init__(self, tmp: Path, env: dict[str, str] | None = None) -> None:
        self.tmp = tmp
        self.state = tmp / "state"
        self.token = tmp / "token"
        if not self.token.exists():
            self.token.write_text(secrets.token_hex(32))
            self.token.chmod(0o600)
        self.session = unique_session("restart")
        self.env = dict(os.environ, GPUSD_STATE_DIR=str(self.state), GPUSD_INTERFACES="127.0.0.1",
                        GPUSD_MDNS_FAST="1", **(env or {}))
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.node = ""

    def argv(self, ready_fd: int) -> list[str]:
        return [*GPUSD, "start", "--foreground", "--port", "0", "--session", self.session, "--simulate", SIMULATE,
                "--token-file", str(self.token), "--ready-fd", str(ready_fd)]

    def start(self, launcher: list[str] | None = None, pass_fds: tuple[int, ...] = ()) -> None:
        r, low = os.pipe()
        w = fcntl.fcntl(low, fcntl.F_DUPFD, 100)  # above the descriptors a launcher puts from 3 on
        os.close(low)
        with open(self.tmp / "log", "ab") as log:
            self.proc = subprocess.Popen([*(launcher or []), *self.argv(w)], env=self.env, pass_fds=(w, *pass_fds),
                                         stdout=subprocess.DEVNULL, stderr=log)
        os.close(w)
        try:
            lines = read_lines(r, 1, 60)
            assert lines and lines[0], (self.tmp / "log").read_text()[-3000:]
            info = json.loads(lines[0])
            self.port, self.node = info["port"], info["node_id"]
        finally:
            os.close(r)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def call(self, method: str, path: str, body: Any = None) -> Any:
        from gpusd.wire.http import request_json
        from gpusd.wire.signing import FleetKey

        return request_json(method, f"http://127.0.0.1:{self.port}/api/v1{path}", body,
                            key=FleetKey(self.token.read_text().strip()), node_id=self.node)

    def record(self, lease_id: str) -> dict[str, Any]:
        return json.loads((self.state / "remote-leases" / f"{lease_id}.json").read_text())

    def log(self) -> str:
        return (self.tmp / "log").read_text(errors="replace")


def _free(store_dir: str, uuid: str) -> bool:
    """Whether the GPU's lock can be taken now (taken and given back at once)."""
    from gpusd.alloc.leases import LeaseStore

    lease = LeaseStore(Path(store_dir), private=Path(store_dir).name == "authority").acquire([uuid])
    if lease is None:
        return False
    lease.release()
    return True


def _machine_leases() -> list[Any]:
    from gpusd.alloc.leases import LeaseStore

    return [le for le in LeaseStore().leases() if not le.unleased]


def _keeper_names(state: Path) -> list[str] | None:
    from gpusd.daemon.keeper import KeeperClient

    try:
        return KeeperClient(state).names()
    except OSError:
        return None


def _kill_keeper(state: Path) -> None:
    from gpusd.daemon.keeper import KeeperClient

    k = KeeperClient(state)
    if k.running() and k.pid:
        os.kill(k.pid, signal.SIGKILL)


def _grant(d: Daemon, ttl: float = 30) -> tuple[str, str, str]:
    r = d.call("POST", "/leases", {"count": 1, "holder": "alice@laptop", "ttl": ttl})
    assert r.status == 201, r.data
    from gpusd.alloc.leases import LeaseStore

    # a root daemon serving the lease socket takes leases in its own directory of the lock directory
    return r.data["lease_id"], r.data["devices"][0]["uuid"], str(LeaseStore.authority().dir)


def test_a_remote_lease_survives_kill_9_of_the_daemon_through_the_keeper(tmp_path: Path) -> None:
    d = Daemon(tmp_path)
    d.start()
    try:
        lease_id, uuid, store = _grant(d)
        expires = d.call("GET", "/leases").data["leases"][0]["expires"]
        wait_until_sync(lambda: f"lease-{lease_id}" in (_keeper_names(d.state) or []), 30, what="the keeper holds it")
        d.kill()
        assert not _free(store, uuid)  # the keeper holds its lock while no daemon runs
        d.start()
        r = d.call("POST", f"/leases/{lease_id}/renew", {})  # the holder's next heartbeat
        assert r.status == 200, r.data
        [listed] = d.call("GET", "/leases").data["leases"]
        assert listed["lease_id"] == lease_id and listed["devices"][0]["uuid"] == uuid
        # and every view of this machine's leases (`gpusd leases`, devices, snapshots) shows it again
        assert [(le.lease_id, le.device) for le in _machine_leases()] == [(lease_id, uuid)]
        assert "took back remote lease" in d.log()
        # the same GPU is not granted to anyone else
        other = d.call("POST", "/leases", {"count": 2, "holder": "bob@desk", "ttl": 30})
        assert other.status == 409, other.data
        assert d.call("DELETE", f"/leases/{lease_id}").status == 200
        assert _free(store, uuid)  # released: the daemon's copies and the keeper's are closed
        wait_until_sync(lambda: _keeper_names(d.state) is None, 30, what="the keeper exits, holding nothing")
        assert abs(expires - listed["expires"]) < 30  # sanity: the restart neither reset nor stretched it much
    finally:
        d.stop()
        _kill_keeper(d.state)


def test_a_clean_restart_keeps_the_remote_leases_too(tmp_path: Path) -> None:
    """`gpusd stop` (SIGTERM) then a start, as `systemctl restart` does: the lease is left to the keeper."""
    d = Daemon(tmp_path)
    d.start()
    try:
        lease_id, uuid, store = _grant(d)
        wait_until_sync(lambda: f"lease-{lease_id}" in (_keeper_names(d.state) or []), 30, what="the keeper holds it")
        d.stop()
        assert "left to the keeper" in d.log()
        assert not _free(store, uuid)
        d.start()
        assert d.call("POST", f"/leases/{lease_id}/renew", {}).status == 200
    finally:
        d.stop()
        _kill_keeper(d.state)


def test_the_outage_counts_against_the_lease(tmp_path: Path) -> None:
    """The remaining time is kept across the restart, on the boot-time clock: not reset to the TTL."""
    d = Daemon(tmp_path)
    d.start()
    try:
        lease_id, _uuid, _store = _grant(d, ttl=300)
        before = d.record(lease_id)["expires_boot"]
        wait_until_sync(lambda: f"lease-{lease_id}" in (_keeper_names(d.state) or []), 30, what="the keeper holds it")
        d.kill()
        d.start()
        wait_until_sync(lambda: "took back remote lease" in d.log(), 30, what="the lease taken back")
        assert d.record(lease_id)["expires_boot"] == pytest.approx(before, abs=0.5)
    finally:
        d.stop()
        _kill_keeper(d.state)


def test_after_a_reboot_the_lease_is_dropped_and_said(tmp_path: Path) -> None:
    d = Daemon(tmp_path)
    d.start()
    try:
        lease_id, uuid, store = _grant(d)
        wait_until_sync(lambda: f"lease-{lease_id}" in (_keeper_names(d.state) or []), 30, what="the keeper holds it")
        d.kill()
        path = d.state / "remote-leases" / f"{lease_id}.json"
        rec = json.loads(path.read_text())
        path.write_text(json.dumps({**rec, "boot_id": "00000000-0000-0000-0000-000000000000"}))  # another boot
        d.start()
        r = d.call("POST", f"/leases/{lease_id}/renew", {})
        assert r.status == 404, r.data
        assert "before this machine rebooted" in d.log()
        wait_until_sync(lambda: _free(store, uuid), 30, what="the GPU free again")
        assert not path.exists()
    finally:
        d.stop()
        _kill_keeper(d.state)


def test_a_damaged_record_costs_that_lease_only(tmp_path: Path) -> None:
    d = Daemon(tmp_path)
    d.start()
    try:
        first, _, _ = _grant(d)
        second, _, _ = _grant(d)
        wait_until_sync(lambda: {f"lease-{first}", f"lease-{second}"} <= set(_keeper_names(d.state) or []), 30,
                        what="the keeper holds both")
        d.kill()
        (d.state / "remote-leases" / f"{first}.json").write_bytes(b"\x00junk{")
        d.start()
        assert d.call("POST", f"/leases/{second}/renew", {}).status == 200
        assert d.call("POST", f"/leases/{first}/renew", {}).status == 404
        assert "damaged record" in d.log()
    finally:
        d.stop()
        _kill_keeper(d.state)


def test_a_dead_keeper_takes_no_lease_with_it_while_the_daemon_runs(tmp_path: Path) -> None:
    d = Daemon(tmp_path)
    d.start()
    try:
        lease_id, uuid, store = _grant(d)
        wait_until_sync(lambda: f"lease-{lease_id}" in (_keeper_names(d.state) or []), 30, what="the keeper holds it")
        _kill_keeper(d.state)
        assert not _free(store, uuid)  # the daemon co-holds
        # the daemon sees its keeper gone and hands the lease to a new one: it survives the daemon again
        wait_until_sync(lambda: f"lease-{lease_id}" in (_keeper_names(d.state) or []), 30, what="a new keeper")
        d.kill()
        assert not _free(store, uuid)
        d.start()
        assert d.call("POST", f"/leases/{lease_id}/renew", {}).status == 200
    finally:
        d.stop()
        _kill_keeper(d.state)


class FakeSystemd:
    """The part of systemd a Type=notify service talks to: $NOTIFY_SOCKET, with its descriptor store."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.path = path
        self.store: dict[str, list[int]] = {}
        self.lock = threading.Lock()
        self.running = True
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        size = array.array("i").itemsize
        while self.running:
            try:
                msg, anc, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(253 * size))
            except OSError:
                continue
            fds = array.array("i")
            for level, kind, data in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.frombytes(data[: len(data) - len(data) % size])
            fields = dict(line.split("=", 1) for line in msg.decode().split("\n") if "=" in line)
            with self.lock:
                name = fields.get("FDNAME", "stored")
                if fields.get("FDSTORE") == "1":
                    self.store.setdefault(name, []).extend(fds)
                    continue
                for fd in fds:  # descriptors with any other message are closed, as systemd does
                    os.close(fd)
                if fields.get("FDSTOREREMOVE") == "1":
                    for fd in self.store.pop(name, []):
                        os.close(fd)

    def names(self) -> list[str]:
        with self.lock:
            return sorted(self.store)

    def handed(self) -> tuple[list[str], list[int]]:
        """What a restarted service is given: LISTEN_FDNAMES and the descriptors, in order."""
        with self.lock:
            names, fds = [], []
            for name, got in self.store.items():
                for fd in got:
                    names.append(name)
                    fds.append(fd)
            return names, fds

    def close(self) -> None:
        self.running = False
        self.thread.join(5)
        self.sock.close()
        for got in self.store.values():
            for fd in got:
                os.close(fd)


# Starts the daemon as systemd does after a restart: the stored descriptors from 3 on (they come in
# above 200, out of the way), LISTEN_PID its pid (exec keeps it), LISTEN_FDS, LISTEN_FDNAMES.
LAUNCH = """
import os, sys
src = [int(x) for x in sys.argv[1].split(",")]
for i, fd in enumerate(src):
    os.dup2(fd, 3 + i)
for fd in src:
    os.close(fd)
os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS=str(len(src)), LISTEN_FDNAMES=sys.argv[2])
os.execv(sys.argv[3], sys.argv[3:])
"""


def test_a_remote_lease_survives_kill_9_through_systemds_descriptor_store(tmp_path: Path) -> None:
    systemd = FakeSystemd(tmp_path / "notify.sock")
    d = Daemon(tmp_path, env={"NOTIFY_SOCKET": str(tmp_path / "notify.sock"), "FDSTORE": "16"})
    try:
        d.start()
        lease_id, uuid, store = _grant(d)
        wait_until_sync(lambda: f"lease-{lease_id}" in systemd.names(), 30, what="the store holds it")
        d.kill()
        assert not _free(store, uuid)  # systemd's copies keep the lock
        names, fds = systemd.handed()
        moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, 200) for fd in fds]
        try:
            d.start(launcher=[sys.executable, "-c", LAUNCH, ",".join(map(str, moved)), ":".join(names)],
                    pass_fds=tuple(moved))
        finally:
            for fd in moved:
                os.close(fd)
        assert d.call("POST", f"/leases/{lease_id}/renew", {}).status == 200
        assert "took back remote lease" in d.log()
        assert not (d.state / "keeper.sock").exists()  # systemd kept them: no keeper
        assert d.call("DELETE", f"/leases/{lease_id}").status == 200
        wait_until_sync(lambda: f"lease-{lease_id}" not in systemd.names(), 30, what="FDSTOREREMOVE")
        assert _free(store, uuid)
    finally:
        d.stop()
        systemd.close()


def test_a_lease_that_expires_while_the_daemon_is_down_is_fenced_before_its_gpu_is_free(tmp_path: Path) -> None:
    """The holder is cut off and the daemon is killed: the lease expires while no daemon runs. Its GPU
    stays held while a process of the lease (GPUSD_LEASE in its environment) runs — the keeper does
    not let go — and the restarted daemon takes the lease back and fences it (SIGTERM) before the GPU
    is free. Before, the keeper let go at the expiry and the restarted daemon dropped the lease: the
    GPU was granted while the job still ran (a double grant in the fault campaign)."""
    d = Daemon(tmp_path, env={"GPUSD_FENCE_GRACE": "2", "GPUSD_FENCE_DELAY": "2"})
    d.start()
    job = None
    try:
        lease_id, uuid, store = _grant(d, ttl=2)
        job = subprocess.Popen(["sleep", "120"], env=dict(os.environ, GPUSD_LEASE=lease_id))
        wait_until_sync(lambda: f"lease-{lease_id}" in (_keeper_names(d.state) or []), 30, what="the keeper holds it")
        d.kill()
        import time

        time.sleep(6)  # past its expiry and the keeper's grace: nobody renews it
        assert job.poll() is None and not _free(store, uuid)  # held while its job runs
        d.start()
        wait_until_sync(lambda: job.poll() is not None, 30, what="the lease's job stopped by the fence")
        assert job.returncode == -signal.SIGTERM
        wait_until_sync(lambda: _free(store, uuid), 30, what="the GPU free once its job is gone")
        assert "expired while the daemon was down: ends now" in d.log()
    finally:
        if job is not None and job.poll() is None:
            job.kill()
            job.wait()
        d.stop()
        _kill_keeper(d.state)
