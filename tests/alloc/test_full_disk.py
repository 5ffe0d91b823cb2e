"""A full disk under the lock or state directory: a one-line error naming the directory and ENOSPC, on
every command and over HTTP (507), and no temporary file left behind (issue 31, item 5).

The disk is a small tmpfs in a private mount namespace (``unshare -m``) that the test fills: nothing
outside the namespace sees it, and it goes with the namespace's last process.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent.parent

DRIVER = r'''
import asyncio, json, os, secrets, subprocess, sys
from pathlib import Path

mnt = Path(sys.argv[1])
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], check=True)
locks, state = mnt / "locks", mnt / "state"
os.environ.update(GPUSD_LOCK_DIR=str(locks), GPUSD_STATE_DIR=str(state))
gpusd = [sys.executable, "-m", "gpusd"]
out = {}


def fill():
    fd = os.open(mnt / "fill", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        while True:
            os.write(fd, b"\0" * 512)
    except OSError:
        pass
    finally:
        os.close(fd)


def cli(name, args, **env):
    r = subprocess.run([*gpusd, *args], env=dict(os.environ, **env), capture_output=True, text=True, timeout=60)
    out[name] = [r.returncode, r.stderr]


# the lock directory itself, without a daemon (simulated GPUs)
off = dict(GPUSD_LEASE_SOCKET="off", GPUSD_SIMULATE="2xA100-80GB")
cli("warm", ["run", "--", "true"], **off)  # the directory and its lock files exist
fill()
cli("run", ["run", "--", "true"], **off)
cli("wait", ["run", "--wait", "--timeout", "5", "--", "true"], **off)
cli("select", ["select"], **off)  # takes no lease, writes nothing: still works

# through the daemon's lease socket (the lease authority, root)
sys.path.insert(0, sys.argv[2])
from authority_helpers import ServerThread
os.environ["GPUSD_LEASE_SOCKET"] = str(mnt.parent / "lease.sock")
server = ServerThread(simulate="2xA100-80GB")
try:
    cli("daemon_run", ["run", "--", "true"])
finally:
    server.stop()
del os.environ["GPUSD_LEASE_SOCKET"]

# over HTTP: a remote lease request
from daemon_helpers import running_daemon, unique_session
from gpusd.wire.http import fetch_json, request_json
from gpusd.wire.signing import FleetKey

token = secrets.token_hex(32)


async def http():
    async with running_daemon(mnt.parent, unique_session(), token=token, simulate="2xA100-80GB", tls=False) as d:
        url = f"http://127.0.0.1:{d.port}/api/v1"
        node = await asyncio.to_thread(lambda: fetch_json(url + "/host").data["node_id"])
        r = await asyncio.to_thread(request_json, "POST", url + "/leases", {"count": 1, "holder": "x", "ttl": 30},
                                    key=FleetKey(token), node_id=node)
        out["http"] = [r.status, r.data]

asyncio.run(http())
out["left"] = sorted(str(p.relative_to(mnt)) for p in mnt.rglob("*") if p.name.endswith(".tmp"))
print(json.dumps(out))
'''


@pytest.fixture
def full_disk(tmp_path):
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("mounting a small tmpfs needs root and unshare(1)")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent / "src"), str(TESTS)]))
    r = subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, str(driver), str(mnt),
                        str(TESTS)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not any(mnt.iterdir())  # the tmpfs went with its namespace
    return json.loads(r.stdout.strip().splitlines()[-1])


def _one_line_enospc(rc_err, directory):
    rc, err = rc_err
    lines = err.strip().splitlines()
    assert rc == 1 and len(lines) == 1, err
    assert "ENOSPC" in lines[0] and directory in lines[0] and "Traceback" not in err and "internal error" not in err
    return lines[0]


def test_a_full_disk_is_one_line_naming_the_directory_and_leaves_no_temporary_file(full_disk):
    out = full_disk
    assert out["warm"][0] == 0, out["warm"]
    _one_line_enospc(out["run"], "/locks")
    _one_line_enospc(out["wait"], "/locks")
    assert out["select"][0] == 0, out["select"]
    _one_line_enospc(out["daemon_run"], "/locks/authority")
    status, body = out["http"]
    assert status == 507 and body["code"] == "disk_full" and body["reason"] == "disk_full", body
    assert "ENOSPC" in body["error"] and "/locks" in body["error"], body
    assert out["left"] == [], out["left"]


def test_the_pool_client_says_a_hosts_disk_is_full_not_that_no_gpu_is_free(monkeypatch):
    """``gpusd reserve`` against hosts that all answered 507: their reason, not "no verified host has
    1 GPU(s) free"."""
    from gpusd.errors import DiskFull
    from gpusd.pool import client as pool

    def full(hosts, c, n, key, holder, note, ttl, host, model, job, reasons):
        reasons.append((507, "h1: cannot write lease-x.json in /var/lib/gpusd/locks: no space left on the device "
                             "(ENOSPC)"))
        return None

    class Fleet:
        listening, hosts = True, []

        def register_event_handler(self, *a):
            pass

        unregister_event_handler = register_event_handler

    monkeypatch.setattr(pool, "_try_once", full)
    with pytest.raises(DiskFull, match=r"h1: .*ENOSPC"):
        pool.reserve(1, token="x" * 64, client=Fleet())


def test_a_renewal_on_a_full_disk_keeps_the_lease_and_says_its_record_is_stale() -> None:
    """The holder renewed in time: a record the daemon cannot rewrite (a full disk) must not cost it
    its GPUs (the lease expired at its old deadline, and its GPU was granted while its job ran)."""
    import time
    from types import SimpleNamespace

    from gpusd.daemon import pool as dpool
    from gpusd.daemon.config import DaemonConfig
    from gpusd.errors import DiskFull

    now = time.monotonic()
    held = dpool.Held("ab12", SimpleNamespace(env=lambda: {}, release=lambda: None, lease=None), "me", None, None,
                      4.0, time.time(), now, now + 4.0)
    p = dpool.Pool(SimpleNamespace(hostname="h", node_id="n", config=DaemonConfig()))  # type: ignore[arg-type]

    def full(*_: object) -> None:
        raise DiskFull.of("/var/lib/gpusd/locks/authority", OSError(28, "No space left on device"), "lease-ab12.json")

    p._renew = full  # type: ignore[method-assign]
    p.held["ab12"] = held
    try:
        status, out = asyncio.run(p.renew("ab12", {"ttl": 4.0}))
        assert status == 200 and out["reason"] == "disk_full" and "ENOSPC" in out["warning"], out
        assert held.deadline > now + 4.0 and p.held.get("ab12") is held  # renewed: not ending at its old deadline
    finally:
        p.executor.shutdown()
        p.keeping.shutdown()
