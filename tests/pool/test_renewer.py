"""The background renewer of ``gpusd reserve`` (docs/pool.md) stops by itself once its leases can no
longer be renewed: a daemon that went away expires them after their TTL, so renewing on would be a
process left running forever (as the namespace tests once left them behind)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

from gpusd.pool.client import HostLease


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens there once the socket is closed


def test_a_renewer_whose_daemon_is_gone_stops_after_the_ttl() -> None:
    lease = HostLease(lease_id="abc123", hostname="gone", node_id="0123456789abcdef",
                      url=f"http://127.0.0.1:{_closed_port()}/api/v1", pin=None, devices=[], env={},
                      ttl=2.0, expires=time.time() + 2.0)
    job = {"secret": "a-fleet-secret-of-32-characters!", "until": time.time() + 3600,
           "leases": [lease.to_dict()]}
    env = dict(os.environ)
    proc = subprocess.Popen([sys.executable, "-m", "gpusd.pool.renewer"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
    try:
        out, _ = proc.communicate(json.dumps(job), timeout=60)  # generous: it gives up after ttl + ttl/3
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and out == "renewing\n"
