"""A lease-socket client that never reads its answers (issue 19: the review's timed reproduction, made a
test): it is marked deaf once an answer cannot be sent, keeps its lease, and holds up no one — the others
are still answered, and the daemon's stop (the hand-over of everyone's leases) completes."""

from __future__ import annotations

import json
import socket
import time

import pytest

from authority_helpers import ServerThread
from fakenvml import make_gpus
from waiting import wait_until_sync


def _deaf_client(n: int) -> socket.socket:
    """A protocol-2 client that takes a lease, then sends bad requests and never reads the answers."""
    from gpusd.alloc.authority import socket_path

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(str(socket_path()))
    s.sendall(json.dumps({"op": "lease", "v": 2, "count": 1, "command": f"deaf{n}"}).encode() + b"\n")
    s.settimeout(30)
    s.recv(65536)  # the grant
    s.setblocking(False)
    bad = b'{"op": "nope", "' + b"x" * 200 + b'": 1}\n'
    for _ in range(4000):  # answers pile up unread
        try:
            s.send(bad)
        except BlockingIOError:
            time.sleep(0.01)
    return s


def test_clients_that_never_read_keep_their_leases_and_hold_up_no_one(
        fake_nvml_inprocess, cli_env, monkeypatch: pytest.MonkeyPatch) -> None:
    import gpusd.daemon.leaseconn as leaseconn
    from gpusd.alloc.leases import LeaseStore

    monkeypatch.setattr(leaseconn, "SEND_TIMEOUT", 0.5)  # the daemon gives up on an unread answer sooner
    fake_nvml_inprocess.write(make_gpus(4))
    server = ServerThread()
    deaf = [_deaf_client(i) for i in range(2)]
    try:
        wait_until_sync(lambda: len(server.server.held) == 2 and all(c.deaf for c in server.server.held), 30)
        held = {le.command for le in LeaseStore().leases()}
        assert {"deaf0", "deaf1"} <= held  # deaf, but still holding their GPUs

        from gpusd.alloc.authority import socket_path

        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as other:  # someone else is still answered
            other.settimeout(30)
            other.connect(str(socket_path()))
            other.sendall(json.dumps({"op": "lease", "v": 2, "count": 1, "command": "reader"}).encode() + b"\n")
            assert b'"ok": true' in other.recv(65536).replace(b'"ok":true', b'"ok": true')
            server.stop()  # within ServerThread's bound, deaf clients or not
    finally:
        for s in deaf:
            s.close()
