"""The keeper (gpusd.daemon.keeper, docs/pool.md "Failure cases"): it serves only its own user, and
lets go of a lease whose record is gone or expired on the boot-time clock, so a lease no daemon takes
back still ends on time."""

from __future__ import annotations

import array
import json
import os
import socket
import threading
from pathlib import Path

from other_user import MALLORY, AsUser, needs_root


def _keeper(state: Path) -> tuple[object, socket.socket]:
    from gpusd.daemon.keeper import SOCKET_NAME, Keeper

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(state / SOCKET_NAME))
    listener.listen(4)
    return Keeper(state, listener), listener


def _held_file(path: Path) -> int:
    path.write_text("")
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC)


@needs_root
def test_another_user_gets_no_descriptor_from_the_keeper(shared_tmp: Path) -> None:
    state = shared_tmp / "state"
    state.mkdir(mode=0o755)
    keeper, listener = _keeper(state)
    os.chmod(state / "keeper.sock", 0o777)  # as if its mode were wrong: the peer's uid still decides
    keeper.held["lease-0123456789ab"] = [_held_file(shared_tmp / "lock")]  # type: ignore[attr-defined]

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            keeper.serve_one(conn)  # type: ignore[attr-defined]

    server = threading.Thread(target=serve, daemon=True)
    server.start()

    def ask() -> str:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect(str(state / "keeper.sock"))
        s.sendall(json.dumps({"op": "give", "name": "lease-0123456789ab"}).encode() + b"\n")
        msg, anc, _, _ = s.recvmsg(4096, socket.CMSG_SPACE(16 * array.array("i").itemsize))
        return f"{len(msg)} bytes, {len(anc)} descriptors"

    try:
        mallory = AsUser(MALLORY, ask)
        server.join(10)
        assert mallory.result == "ok 0 bytes, 0 descriptors"
        assert list(keeper.held) == ["lease-0123456789ab"]  # type: ignore[attr-defined]
    finally:
        listener.close()
        for fds in keeper.held.values():  # type: ignore[attr-defined]
            for fd in fds:
                os.close(fd)


def test_the_keeper_lets_go_of_a_lease_whose_record_expired_or_went(tmp_path: Path) -> None:
    from gpusd.daemon import poolstate

    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    keeper, listener = _keeper(state)
    try:
        now = poolstate.boottime()
        for lease_id, expires in (("aaaaaaaaaaaa", now + 600), ("bbbbbbbbbbbb", now - 60)):
            assert poolstate.write(state, lease_id, {"lease_id": lease_id, "boot_id": poolstate.boot_id(),
                                                     "expires_boot": expires})
        for name in ("aaaaaaaaaaaa", "bbbbbbbbbbbb", "cccccccccccc"):  # the last one has no record
            keeper.held[f"lease-{name}"] = [_held_file(tmp_path / name)]  # type: ignore[attr-defined]
        keeper.sweep()  # type: ignore[attr-defined]
        assert list(keeper.held) == ["lease-aaaaaaaaaaaa"]  # type: ignore[attr-defined]
        # a record of another boot (read after a reboot, were the keeper still there) counts as none
        poolstate.write(state, "aaaaaaaaaaaa", {"lease_id": "aaaaaaaaaaaa", "boot_id": "0" * 8 + "-0000",
                                                "expires_boot": now + 600})
        keeper.sweep()  # type: ignore[attr-defined]
        assert keeper.held == {}  # type: ignore[attr-defined]
    finally:
        listener.close()


def test_the_keeper_keeps_an_expired_lease_while_a_process_of_it_runs(tmp_path: Path) -> None:
    """With no daemon to fence it, an expired lease whose job still runs (GPUSD_LEASE in its
    environment) keeps its GPUs; the keeper lets go once that process is gone."""
    import subprocess

    from gpusd.daemon import poolstate

    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    keeper, listener = _keeper(state)
    job = subprocess.Popen(["sleep", "60"], env=dict(os.environ, GPUSD_LEASE="dddddddddddd"))
    try:
        assert poolstate.write(state, "dddddddddddd", {"lease_id": "dddddddddddd", "boot_id": poolstate.boot_id(),
                                                       "expires_boot": poolstate.boottime() - 60})
        keeper.held["lease-dddddddddddd"] = [_held_file(tmp_path / "d")]  # type: ignore[attr-defined]
        keeper.sweep()  # type: ignore[attr-defined]
        assert list(keeper.held) == ["lease-dddddddddddd"]  # type: ignore[attr-defined]
        job.kill()
        job.wait()
        keeper.sweep()  # type: ignore[attr-defined]
        assert keeper.held == {}  # type: ignore[attr-defined]
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
        listener.close()
        for fds in keeper.held.values():  # type: ignore[attr-defined]
            for fd in fds:
                os.close(fd)
