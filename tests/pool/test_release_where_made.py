"""Issue 18, item 4: a reservation remembers where it was made, so ``gpusd release ID`` (the hint ``reserve``
prints) ends a reservation on a host found with ``--peer`` without being given ``--peer`` again, and its
renewer stops (docs/pool.md).  Two namespace LANs joined by a router (tests/netns.py ``join``): mDNS does not
cross it.  Skipped (with the reason) without root or ``ip netns``."""

from __future__ import annotations

import json
import os
import secrets
import signal
from pathlib import Path
from typing import Any

import pytest

from fakenvml import make_gpus
from lan_helpers import secret_file
from netns import Lan, lans, netns_ok  # noqa: F401
from waiting import wait_until_sync


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _leases(lan: Lan, host: Any) -> list[dict[str, Any]]:
    r = lan.gpusd(host.node, ["devices", "--json"], env=host.env)
    assert r.returncode == 0, r.stderr
    return [le for g in json.loads(r.stdout)["gpus"] for le in g.get("leases") or []]


@pytest.mark.timeout(240)
def test_release_finds_a_reservation_made_through_peer_without_peer(lans: tuple[Lan, Lan], tmp_path: Path) -> None:
    a, b = lans
    key = secret_file(tmp_path / "fleet.key", secrets.token_hex(32))
    hb = b.add_gpu_host("node-b", make_gpus(2), fast=True, args=["--token-file", str(key)],
                        extra_env={"GPUSD_LEASE_SOCKET": str(b.workdir / "hb-lease.sock")})
    hb.start()
    client = a.add_node("client")
    env = a.base_env(client, GPUSD_MDNS_FAST="1")
    tok = ["--token-file", str(key)]
    r = a.gpusd(client, ["reserve", "-n", "1", "--ttl", "3", "--for", "1h", "--peer", f"{hb.ip}:4780", *tok],
                env=env)
    assert r.returncode == 0, r.stderr
    lease_id = r.stdout.split("lease ", 1)[1].split()[0]
    renewer = int(r.stdout.split("renewed by pid ", 1)[1].split(";")[0])
    hint = r.stdout.split("; ", 1)[1].split(" to end it)")[0]  # names the secret and where it looked (item 5)
    assert hint.startswith(f"gpusd release {lease_id} --token-file ") and f"--peer {hb.ip}:4780" in hint, hint
    try:
        assert [le["lease_id"] for le in _leases(b, hb)] == [lease_id]
        r = a.gpusd(client, ["release", lease_id, *tok], env=env)  # no --peer: mDNS alone cannot see node-b
        assert r.returncode == 0, r.stderr
        assert f"released {lease_id} on node-b" in r.stdout
        assert _leases(b, hb) == []  # at once, not after --for
        wait_until_sync(lambda: not _alive(renewer), timeout=30, what="the renewer to stop")
        r = a.gpusd(client, ["release", lease_id, *tok], env=env)  # a second time: nothing left
        assert r.returncode == 1 and "no reservation" in r.stderr and "Traceback" not in r.stderr
    finally:
        try:
            os.kill(renewer, signal.SIGKILL)
        except ProcessLookupError:
            pass
