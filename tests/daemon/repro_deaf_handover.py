"""Review reproduction (timed, so not collected as a test): run with
    python3 -m pytest -s tests/daemon/repro_deaf_handover.py -p no:cacheprovider \
        -o "python_functions=repro_*" -o "python_files=repro_*.py"
A protocol-2 client that never reads must not delay the daemon's stop (the
hand-over of everyone else's leases)."""
from __future__ import annotations

import json
import socket
import time

from authority_helpers import ServerThread
from fakenvml import make_gpus


def _deaf_client(n: int) -> socket.socket:
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


def repro_clients_that_never_read_do_not_hold_up_the_daemons_stop(fake_nvml_inprocess, cli_env):
    fake_nvml_inprocess.write(make_gpus(4))
    server = ServerThread()
    deaf = [_deaf_client(i) for i in range(4)]
    try:
        time.sleep(12)  # SEND_TIMEOUT: the daemon marks them deaf
        t0 = time.monotonic()
        server.stop()
        took = time.monotonic() - t0
        print(f"stop took {took:.1f}s with {len(deaf)} deaf clients")
        assert took < 2.0, took  # sketch: a figure, not a unit-test bound
    finally:
        for s in deaf:
            s.close()
