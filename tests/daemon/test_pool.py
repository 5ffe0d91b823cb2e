"""Remote leases held by a daemon (docs/pool.md), in process on 127.0.0.1: bounds, renewal, expiry,
the lease record, and that local and remote allocation never overlap."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from pathlib import Path
from typing import Any

import pytest

from daemon_helpers import running_daemon, unique_session, wait_until

TOKEN = secrets.token_hex(32)


def node_of(url: str) -> str:
    """The node id of the daemon serving ``url`` (as discovery learns it), for signed writes."""
    from urllib.parse import urlsplit

    from gpusd.wire.http import fetch_json

    parts = urlsplit(url)
    return str(fetch_json(f"{parts.scheme}://{parts.netloc}/api/v1/host").data["node_id"])


def call(method: str, url: str, body: Any = None, token: str | None = TOKEN, node_id: str | None = None) -> Any:
    from gpusd.wire.http import request_json
    from gpusd.wire.signing import FleetKey

    return request_json(method, url, body, key=FleetKey(token) if token else None,
                        node_id=node_id or (node_of(url) if token else None))


async def acall(*a: Any, **kw: Any) -> Any:
    return await asyncio.to_thread(call, *a, **kw)


def base(d: Any) -> str:
    return f"http://127.0.0.1:{d.port}/api/v1"


def held_leases() -> list[Any]:
    from gpusd.alloc.leases import LeaseStore

    return LeaseStore().leases()


async def test_a_remote_lease_is_the_same_flock_lease_a_local_job_would_take(tmp_path: Path) -> None:
    from gpusd.alloc.api import LeaseRequest, allocate
    from gpusd.alloc.select import Constraints
    from gpusd.errors import NoGpuAvailable

    async with running_daemon(tmp_path, unique_session(), token=TOKEN, simulate="2xA100-80GB", tls=False) as d:
        r = await acall("POST", base(d) + "/leases", {"count": 1, "holder": "alice@laptop", "note": "nb", "ttl": 30})
        assert r.status == 201 and r.verified is True, r.data
        lease_id = r.data["lease_id"]
        assert r.data["env"]["CUDA_VISIBLE_DEVICES"] in ("0", "1") and r.data["env"]["GPUSD_LEASE"] == lease_id
        # the record in the lock directory names the holder, the note, the origin and the expiry; the holder
        # is who the daemon can tell (no user key here: the fleet member at that address), never the name the
        # request declared, which the answer keeps as "claimed"
        (le,) = held_leases()
        assert (le.lease_id, le.user, le.command, le.remote_from) == (lease_id, "fleet@127.0.0.1", "nb", "127.0.0.1")
        assert r.data["claimed"] == "alice@laptop" and r.data["user"] == "fleet@127.0.0.1"
        assert le.expires is not None and abs(le.expires - r.data["expires"]) < 0.01
        # a local job gets the other GPU, then none: the two ways never overlap
        sel = await asyncio.to_thread(allocate, LeaseRequest(Constraints(count=1), simulate="2xA100-80GB"))
        assert sel.uuids[0] != le.device
        with pytest.raises(NoGpuAvailable):
            await asyncio.to_thread(allocate, LeaseRequest(Constraints(count=1), simulate="2xA100-80GB"))
        # and the daemon answers 409, with the reason, when the local job holds the last GPU
        r2 = await acall("POST", base(d) + "/leases", {"count": 1, "holder": "bob"})
        assert r2.status == 409 and "no GPUs available" in r2.data["error"], r2.data
        sel.release()
        assert (await acall("DELETE", f"{base(d)}/leases/{lease_id}")).status == 200
        assert held_leases() == []
        # gpusd run --fleet names its job: the record (so gpusd leases, top, the dashboard) and the answer
        r = await acall("POST", base(d) + "/leases", {"count": 2, "holder": "alice@laptop", "job": "0123456789ab"})
        assert r.status == 201 and r.data["job"] == "0123456789ab", r.data
        assert [le.job for le in held_leases()] == ["0123456789ab"] * 2
        # and a renewal keeps it
        assert (await acall("POST", f"{base(d)}/leases/{r.data['lease_id']}/renew", {})).status == 200
        assert [le.job for le in held_leases()] == ["0123456789ab"] * 2
        assert (await acall("DELETE", f"{base(d)}/leases/{r.data['lease_id']}")).status == 200
        assert (await acall("DELETE", f"{base(d)}/leases/{lease_id}")).status == 404


async def test_renewal_moves_the_expiry_and_a_lease_not_renewed_expires(tmp_path: Path) -> None:
    async with running_daemon(tmp_path, unique_session(), token=TOKEN, simulate="2xA100-80GB", tls=False) as d:
        sub = d.events.subscribe()
        r = await acall("POST", base(d) + "/leases", {"count": 2, "holder": "alice", "ttl": 2})
        assert r.status == 201
        lease_id, first = r.data["lease_id"], r.data["expires"]
        await asyncio.sleep(0.3)
        r = await acall("POST", f"{base(d)}/leases/{lease_id}/renew", {})
        assert r.status == 200 and r.data["expires"] > first
        # the record was replaced, still locked: every device still leased, the new expiry written
        leases = held_leases()
        assert len(leases) == 2 and all(abs((le.expires or 0) - r.data["expires"]) < 0.01 for le in leases)
        deadline = time.monotonic() + 5
        while held_leases() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert held_leases() == []  # expired: the GPUs are free
        assert lease_id not in d.pool.held
        r = await acall("POST", f"{base(d)}/leases/{lease_id}/renew", {})
        assert r.status == 404
        # the event stream told it: granted, then expired (the lease under "leases": private fields redactable)
        names = []
        while True:
            try:
                msg = await asyncio.wait_for(sub.get(), 0.2)
            except asyncio.TimeoutError:
                break
            if msg is None:
                break
            head, _, data = msg.decode().partition("\ndata: ")
            if head.startswith("event: lease_"):
                names.append((head[7:], json.loads(data)["leases"][0]["lease_id"]))
        # ... and, its processes on this host stopped (none here), its GPUs free again (docs/pool.md, "Fencing")
        assert names == [("lease_granted", lease_id), ("lease_expired", lease_id), ("lease_fenced", lease_id)]
        d.events.unsubscribe(sub)


async def test_every_remote_grant_carries_a_greater_epoch(tmp_path: Path) -> None:
    """The fencing token (docs/pool.md, "Fencing"): in the grant answer, each device, the job's
    environment, GET /api/v1/leases and the lease record; the next grant of the GPU carries more."""
    async with running_daemon(tmp_path, unique_session(), token=TOKEN, simulate="1xA100-80GB", tls=False) as d:
        seen = []
        for _ in range(3):
            r = await acall("POST", base(d) + "/leases", {"count": 1, "holder": "alice", "ttl": 30})
            assert r.status == 201, r.data
            epoch = r.data["epoch"]
            assert type(epoch) is int and [x["epoch"] for x in r.data["devices"]] == [epoch], r.data
            assert r.data["env"]["GPUSD_LEASE_EPOCH"] == str(epoch)
            listed = (await acall("GET", base(d) + "/leases")).data["leases"]
            assert [x["epoch"] for x in listed] == [epoch]
            assert [le.epoch for le in held_leases()] == [epoch]
            r = await acall("DELETE", f"{base(d)}/leases/{r.data['lease_id']}")
            assert r.status == 200
            seen.append(epoch)
        assert seen == sorted(set(seen)), seen


@pytest.mark.parametrize("body, why", [
    ({"count": 1}, "holder"),
    ({"count": 1, "holder": "x" * 65}, "holder"),
    ({"count": 1, "holder": "a\x1b[2J"}, "holder"),
    ({"count": 1, "holder": "a", "ttl": 0.5}, "ttl"),
    ({"count": 1, "holder": "a", "ttl": 86400}, "ttl"),
    ({"count": 0, "holder": "a"}, "count"),
    ({"count": 1, "holder": "a", "note": "n" * 600}, "note"),
    ({"count": 1, "holder": "a", "max_util": "lots"}, "max_util"),
    ({"count": 1, "holder": "a", "job": "../../job-x"}, "job"),
    ({"count": 1, "holder": "a", "job": 12345678}, "job"),
    ([1, 2], "JSON object"),
    # issue 17, row 6: numbers are numbers of the right kind and range, and the answer names the field
    ({"count": 1, "holder": "a", "memory": -5}, "'memory'"),
    ({"count": -1, "holder": "a"}, "'count'"),
    ({"count": 1, "holder": "a", "ttl": 1e9}, "'ttl'"),
    ({"count": True, "holder": "a"}, "'count'"),
    ({"count": 1.5, "holder": "a"}, "'count'"),
    ({"count": 1, "holder": "a", "memory": 1.5}, "'memory'"),
    ({"count": 1, "holder": "a", "memory": True}, "'memory'"),
    ({"count": 1, "holder": "a", "memory": 2**60}, "'memory'"),
    ({"count": 1, "holder": "a", "min_free": -1}, "'min_free'"),
    ({"count": 1, "holder": "a", "max_util": -3}, "'max_util'"),
    ({"count": 1, "holder": "a", "max_processes": -1}, "'max_processes'"),
    ({"count": 1, "holder": "a", "ttl": -30}, "'ttl'"),
    ({"count": 1, "holder": "a", "ttl": True}, "'ttl'"),
    ({"count": 1, "holder": "a", "ttl": "30"}, "'ttl'"),
])
async def test_bad_requests_get_a_clear_400(tmp_path: Path, body: Any, why: str) -> None:
    async with running_daemon(tmp_path, unique_session(), token=TOKEN, simulate="2xA100-80GB", tls=False) as d:
        r = await acall("POST", base(d) + "/leases", body)
        assert r.status == 400 and why in r.data["error"], r.data
        assert r.data["code"] == ("bad_id" if why == "job" else "usage")  # docs/errors.md (since 0.3)
        assert held_leases() == []


def call_from(source: str, method: str, url: str, body: Any = None) -> tuple[int, Any]:
    """A signed request (for the daemon's node) sent from the local address ``source`` (another
    loopback address: another peer as far as the daemon can tell)."""
    import http.client
    from urllib.parse import urlsplit

    from gpusd.wire.signing import FleetKey

    payload = json.dumps(body).encode() if body is not None else b""
    headers, _ = FleetKey(TOKEN).sign_request(method, url, body=payload, node_id=node_of(url))
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port or 80, timeout=10,
                                      source_address=(source, 0))
    try:
        conn.request(method, parts.path, body=payload or None,
                     headers={**headers, "Host": parts.netloc, "Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"{}")
    finally:
        conn.close()


async def test_remote_leases_are_bounded_per_holder_and_body_size(tmp_path: Path) -> None:
    """Issue 17, row 5: the per-holder cap counts what the daemon can check (the signing key and the
    peer address): a new ``holder`` name per request does not get around it; another peer has its own."""
    async with running_daemon(tmp_path, unique_session(), token=TOKEN, simulate="8xA100-80GB", tls=False,
                              lease_max_per_holder=2) as d:
        for _ in range(2):
            assert (await acall("POST", base(d) + "/leases", {"count": 1, "holder": "greedy"})).status == 201
        r = await acall("POST", base(d) + "/leases", {"count": 1, "holder": "greedy"})
        assert r.status == 429 and "127.0.0.1" in r.data["error"], r.data
        for name in ("other", "greedy-2", "x"):  # a name per request: the same holder
            r = await acall("POST", base(d) + "/leases", {"count": 1, "holder": name})
            assert r.status == 429, r.data
        status, data = await asyncio.to_thread(call_from, "127.0.0.2", "POST", base(d) + "/leases",
                                               {"count": 1, "holder": "other"})
        assert status == 201, data
        r = await acall("POST", base(d) + "/leases", {"count": 1, "holder": "big", "note": "x" * 20000})
        assert r.status in (400, 413)
        assert len(held_leases()) == 3


async def test_the_lease_policy_bounds_ttl_lifetime_and_gpus_per_holder(tmp_path: Path) -> None:
    """Issue 17, row 5: ``ttl`` is granted up to the policy's ``lease_max_ttl``, renewals never carry a
    lease past ``lease_max_lifetime``, and one holder gets at most ``lease_max_gpus_per_holder`` GPUs."""
    async with running_daemon(tmp_path, unique_session(), token=TOKEN, simulate="8xA100-80GB", tls=False,
                              lease_max_ttl=2.0, lease_max_lifetime=3.0, lease_max_gpus_per_holder=3) as d:
        r = await acall("POST", base(d) + "/leases", {"count": 4, "holder": "all-of-it", "ttl": 3600})
        assert r.status == 429 and "3 per holder" in r.data["error"], r.data
        r = await acall("POST", base(d) + "/leases", {"count": 2, "holder": "a", "ttl": 3600})
        assert r.status == 201 and r.data["ttl"] == 2.0, r.data  # asked an hour, granted the policy's 2 s
        assert r.data["expires"] - r.data["started"] <= 2.01
        lease_id, started = r.data["lease_id"], r.data["started"]
        r2 = await acall("POST", base(d) + "/leases", {"count": 2, "holder": "b"})
        assert r2.status == 429, r2.data  # 2 + 2 > 3 for the same key and address
        assert (await acall("POST", base(d) + "/leases", {"count": 1, "holder": "b"})).status == 201
        # renewed as often as it likes: never past 3 s after the grant
        ends = []
        for _ in range(8):
            r = await acall("POST", f"{base(d)}/leases/{lease_id}/renew", {"ttl": 3600})
            if r.status != 200:
                break
            ends.append(r.data["expires"])
            assert r.data["expires"] <= started + 3.0 + 1e-6, r.data
            await asyncio.sleep(0.5)
        assert r.status == 404, r.data  # expired at its lifetime, although renewed every 0.5 s
        assert ends and max(ends) <= started + 3.0 + 1e-6


def test_the_lease_policy_is_validated() -> None:
    from gpusd.daemon.config import DaemonConfig
    from gpusd.errors import ConfigError

    for bad in ({"lease_max_ttl": 1e9}, {"lease_max_ttl": float("nan")}, {"lease_max_lifetime": 1.0},
                {"lease_max_gpus_per_holder": 0}, {"lease_max_gpus_per_holder": True},
                {"lease_max_per_holder": -1}, {"lease_max_total": 0}, {"reserved_connections": -1},
                {"max_subscribers_per_peer": 0}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            DaemonConfig(**bad).validate()  # type: ignore[arg-type]


async def test_unsigned_and_wrongly_signed_writes_are_refused(tmp_path: Path) -> None:
    async with running_daemon(tmp_path, unique_session(), token=TOKEN, simulate="2xA100-80GB", tls=False) as d:
        for token in (None, secrets.token_hex(32)):
            r = await acall("POST", base(d) + "/leases", {"count": 1, "holder": "mallory"}, token=token)
            assert r.status == 401, r.data
        assert held_leases() == []
        ok = await acall("POST", base(d) + "/leases", {"count": 1, "holder": "alice", "note": "secret plan"})
        lease_id = ok.data["lease_id"]
        for token in (None, secrets.token_hex(32)):
            assert (await acall("POST", f"{base(d)}/leases/{lease_id}/renew", {}, token=token)).status == 401
            assert (await acall("DELETE", f"{base(d)}/leases/{lease_id}", token=token)).status == 401
        assert len(held_leases()) == 1


async def test_the_idle_policy_can_release_a_remote_reservation(tmp_path: Path) -> None:
    async with running_daemon(tmp_path, unique_session(), token=TOKEN, simulate="2xA100-80GB", tls=False) as d:
        r = await acall("POST", base(d) + "/leases", {"count": 1, "holder": "alice"})
        (le,) = held_leases()
        assert d.recording.watch.releaser is d.pool
        assert d.pool.release(le, "idle for 15 minutes") is True
        assert r.data["lease_id"] not in d.pool.held  # forgotten at once; its GPUs freed a moment later
        await wait_until(lambda: held_leases() == [], timeout=10, what="the idle reservation's GPUs freed")
        assert d.pool.release(le, "again") is False  # not ours (any more): refused


def test_a_reservation_gives_an_engine_placement() -> None:
    from gpusd.pool.client import HostLease, Reservation
    from gpusd.wire.signing import FleetKey

    parts = [HostLease("a1", "node-1", "n1", "https://198.18.0.2:4781/api/v1", None,
                       [{"index": 2, "uuid": "GPU-1"}, {"index": 5, "uuid": "GPU-2"}], {}, 30, 0, ["198.18.0.2"]),
             HostLease("b2", "node-2", "n2", "https://198.18.0.3:4781/api/v1", None,
                       [{"index": 0, "uuid": "GPU-3"}], {}, 30, 0, ["198.18.0.3"])]
    p = Reservation(parts, FleetKey(TOKEN)).to_placement_dict("job-1")
    assert json.loads(json.dumps(p)) == {"job_id": "job-1", "hosts": [
        {"hostname": "node-1", "address": "198.18.0.2", "ssh_target": "node-1", "gpus": [2, 5],
         "uuids": ["GPU-1", "GPU-2"]},
        {"hostname": "node-2", "address": "198.18.0.3", "ssh_target": "node-2", "gpus": [0], "uuids": ["GPU-3"]}]}
    placement = Reservation(parts, FleetKey(TOKEN)).to_placement("job-1")
    assert [(h.hostname, list(h.gpus)) for h in placement.hosts] == [("node-1", [2, 5]), ("node-2", [0])]
    assert placement.hosts[0].cuda_env()["CUDA_VISIBLE_DEVICES"] == "2,5"


async def test_a_remote_lease_is_in_the_usage_history_from_its_grant_to_its_release(tmp_path: Path) -> None:
    """A reservation shorter than a sample (or granted just before the daemon dies) is in the history
    all the same: written at its grant, ended at its release, with its GPU and holder."""
    import sqlite3

    async with running_daemon(tmp_path, unique_session(), token=TOKEN, simulate="2xA100-80GB", tls=False) as d:
        r = await acall("POST", base(d) + "/leases", {"count": 1, "holder": "alice@laptop", "note": "nb", "ttl": 30})
        assert r.status == 201, r.data
        lease_id, uuid = r.data["lease_id"], r.data["devices"][0]["uuid"]
        assert (await acall("DELETE", base(d) + f"/leases/{lease_id}")).status == 200
        db = Path(d.state_dir) / "history.sqlite"

        def row() -> Any:
            with sqlite3.connect(db) as conn:
                return conn.execute("SELECT user, gpus, start, ended FROM jobs WHERE key LIKE ?",
                                    (f"l:{lease_id}@%",)).fetchone()

        got = await wait_until(lambda: row() is not None and row()[3] is not None, timeout=10,
                               what="the lease's record, ended")
        user, gpus, start, ended = row()
        assert user == r.data["user"] and json.loads(gpus) == [uuid] and ended >= start  # the holder it shows
        assert got


async def test_a_process_started_under_a_lease_that_had_ended_is_stopped_before_its_gpu_is_granted_again(
        tmp_path: Path) -> None:
    """A user who starts work by hand with the variables of a reservation that has already expired (after
    its fence found nothing to stop): the daemon stops that process, and the next grant of the GPU
    waits for it to be gone -- never a GPU granted while a process of an ended lease runs on this host."""
    import os
    import subprocess
    import sys

    async with running_daemon(tmp_path, unique_session(), token=TOKEN, simulate="1xA100-80GB", tls=False) as d:
        r = await acall("POST", base(d) + "/leases", {"count": 1, "holder": "alice", "ttl": 2})
        assert r.status == 201, r.data
        lease_id = r.data["lease_id"]
        await wait_until(lambda: lease_id not in d.pool.held and not d.pool.fencing, timeout=15)
        late = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                                env={**os.environ, "GPUSD_LEASE": lease_id})
        bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                                     env={**os.environ, "GPUSD_LEASE": "0123456789ab"})
        try:
            r = await acall("POST", base(d) + "/leases", {"count": 1, "holder": "bob", "ttl": 30})
            assert r.status == 201, r.data
            assert late.poll() == -9  # stopped before the grant answered
            assert bystander.poll() is None  # a process of another lease is not touched
        finally:
            for p in (late, bystander):
                if p.poll() is None:
                    p.kill()
                p.wait()
