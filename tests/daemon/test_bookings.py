"""Bookings (gpusd reserve --at, docs/pool.md "Time"): a daemon keeps them, lends the booked GPUs before
WHEN only to jobs that end in time (backfill), holds them for the booker from WHEN, and keeps them across
a restart; bad bookings are refused with one line and change nothing.  In process on 127.0.0.1, with real
accounts and SSH keys (a booking belongs to the account of the key that signed it)."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO, gpusd_cli
from daemon_helpers import running_daemon, unique_session
from user_keys import Accounts, accounts, needs_accounts  # noqa: F401
from waiting import wait_until

pytestmark = needs_accounts

TOKEN = secrets.token_hex(32)
SIM = "2xA100-80GB"


def call(method: str, url: str, body: Any = None, user: Any = None) -> Any:
    from urllib.parse import urlsplit

    from gpusd.wire.http import fetch_json, request_json
    from gpusd.wire.signing import FleetKey

    parts = urlsplit(url)
    node = str(fetch_json(f"{parts.scheme}://{parts.netloc}/api/v1/host").data["node_id"])
    return request_json(method, url, body, key=FleetKey(TOKEN), node_id=node, user=user)


async def acall(*a: Any, **kw: Any) -> Any:
    return await asyncio.to_thread(call, *a, **kw)


def base(d: Any) -> str:
    return f"http://127.0.0.1:{d.port}/api/v1"


def lease_local(time_limit: float | None = None, user: str | None = None) -> Any:
    """What a local `gpusd run` asks (the lock directory, the same simulated GPUs): the lease, or the
    refusal's message."""
    from gpusd.alloc.api import LeaseRequest, allocate
    from gpusd.alloc.handle import Holder
    from gpusd.alloc.select import Constraints
    from gpusd.errors import NoGpuAvailable

    c = Constraints.build(count=1, time_limit=time_limit)
    try:
        return allocate(LeaseRequest(c, simulate=SIM, holder=Holder(user=user)))
    except NoGpuAvailable as exc:
        return str(exc)


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The daemon's state directory, where lease requests read its bookings (as for root's daemon)."""
    d = tmp_path / "state-h1"
    d.mkdir(mode=0o700)
    monkeypatch.setenv("GPUSD_STATE_DIR", str(d))
    return d


async def test_a_booking_lends_its_gpus_only_to_jobs_done_in_time_then_holds_them_across_a_restart(
        tmp_path: Path, state: Path, accounts: Accounts) -> None:  # noqa: F811
    alice = accounts.add("alice")
    start = time.time() + 20.0
    async with running_daemon(tmp_path, unique_session(), token=TOKEN, simulate=SIM, tls=False) as d:
        r = await acall("POST", base(d) + "/bookings", {"count": 2, "start": start, "duration": 40.0, "note": "demo"},
                        user=alice.signer())
        assert r.status == 201, r.data
        booking = r.data["booking_id"]
        assert r.data["user"] == alice.name and r.data["indices"] == [0, 1] and r.data["end"] == start + 40.0
        # before WHEN: a job without a limit is refused, naming the booking and when
        refused = await asyncio.to_thread(lease_local)
        assert isinstance(refused, str) and f"booking {booking}" in refused and alice.name in refused, refused
        assert "--wait waits past the booking" in refused
        # a limit that runs into the booking is refused too; a short one runs (backfill)
        assert isinstance(await asyncio.to_thread(lease_local, 3600.0), str)
        short = await asyncio.to_thread(lease_local, 2.0)
        assert not isinstance(short, str), short
        short.release()
        # the same as a user types it: gpusd run without --time is refused (exit 4), with a short one it runs
        env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
        r = await asyncio.to_thread(gpusd_cli, ["run", "--simulate", SIM, "--", "true"], env)
        assert r.returncode == 4 and f"booking {booking}" in r.stderr and "Traceback" not in r.stderr, r.stderr
        r = await asyncio.to_thread(gpusd_cli, ["run", "--simulate", SIM, "--time", "1s", "--grace", "0", "--",
                                                "sh", "-c", "echo ran"], env)
        assert r.returncode == 0 and "ran" in r.stdout, r.stderr
        # all of it before WHEN (else the refusals above would prove nothing)
        assert time.time() < start, f"the steps before WHEN took {time.time() - start + 20:.1f} s of its 20 s"
    # a restart in between: the booking is still there
    async with running_daemon(tmp_path, unique_session(), token=TOKEN, simulate=SIM, tls=False) as d:
        r = await acall("GET", base(d) + "/bookings")
        assert [b["booking_id"] for b in r.data["bookings"]] == [booking]
        # from WHEN every GPU is held for the booker, by the daemon (alice's machine need not run)
        await wait_until(lambda: d.bookings.book[booking].lease is not None, timeout=60)
        assert time.time() >= start - 0.5  # not before WHEN (its deadline, on this process's clocks)
        r = await acall("GET", base(d) + "/leases")
        [hold] = r.data["leases"]
        assert hold["user"] == alice.name and hold["command"] == f"booking {booking}"
        assert sorted(x["index"] for x in hold["devices"]) == [0, 1]
        assert isinstance(await asyncio.to_thread(lease_local, 1.0), str)  # nobody else gets one
        # alice's own request through the pool gets the booked GPUs (the hold lets go for her)
        r = await acall("POST", base(d) + "/leases", {"count": 2, "ttl": 10, "holder": "alice"}, user=alice.signer())
        assert r.status == 201 and r.data["user"] == alice.name, r.data
        assert isinstance(await asyncio.to_thread(lease_local, 1.0), str)  # still nobody else's
        r = await acall("DELETE", f"{base(d)}/leases/{r.data['lease_id']}", user=alice.signer())
        assert r.status == 200
        # released by her: still booked, nobody else gets them until the booking's end
        assert isinstance(await asyncio.to_thread(lease_local, 1.0), str)


async def test_bad_bookings_get_one_line_and_change_nothing(tmp_path: Path, state: Path,
                                                           accounts: Accounts, monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:  # noqa: F811
    alice, bob = accounts.add("alice"), accounts.add("bob")
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"bookings": {"horizon_days": 1, "max_hours": 2, "max_per_user": 1}}))
    policy.chmod(0o644)
    monkeypatch.setenv("GPUSD_POLICY", str(policy))
    now = time.time()
    async with running_daemon(tmp_path, unique_session(), token=TOKEN, simulate=SIM, tls=False) as d:
        url = base(d) + "/bookings"
        for body, words in [({"count": 1, "start": now - 60, "duration": 60}, "in the past"),
                            ({"count": 1, "start": now + 60, "duration": 0}, "longer than 0"),
                            ({"count": 1, "start": now + 3 * 86400, "duration": 60}, "beyond the policy's horizon"),
                            ({"count": 1, "start": now + 60, "duration": 3 * 3600}, "at most 2 hour"),
                            ({"count": 0, "start": now + 60, "duration": 60}, "count")]:
            r = await acall("POST", url, body, user=alice.signer())
            assert r.status == 400 and words in r.data["error"] and "\n" not in r.data["error"], r.data
        r = await acall("POST", url, {"count": 1, "start": now + 60, "duration": 60})  # no user key
        assert r.status == 401 and r.data["reason"] == "user_key"
        assert (await acall("GET", url)).data["bookings"] == []
        assert not (state / "bookings").exists() or list((state / "bookings").iterdir()) == []
        # a conflict names the booking it conflicts with
        r = await acall("POST", url, {"count": 2, "start": now + 60, "duration": 600}, user=alice.signer())
        assert r.status == 201, r.data
        first = r.data["booking_id"]
        r = await acall("POST", url, {"count": 1, "start": now + 300, "duration": 60}, user=bob.signer())
        assert r.status == 409 and first in r.data["error"] and r.data["conflicts"] == [first], r.data
        r = await acall("POST", url, {"count": 1, "start": now + 2000, "duration": 60}, user=alice.signer())
        assert r.status == 429 and "max_per_user" in r.data["error"], r.data  # one per user
        # only the booker cancels it
        r = await acall("DELETE", f"{url}/{first}", user=bob.signer())
        assert r.status == 403
        r = await acall("DELETE", f"{url}/{first}", user=alice.signer())
        assert r.status == 200 and (await acall("GET", url)).data["bookings"] == []
        assert lease_local() is not None and not isinstance(lease_local(), str)


def test_a_damaged_booking_record_costs_that_record(tmp_path: Path, state: Path) -> None:
    from gpusd.alloc.bookings import Booking
    from gpusd.daemon import poolstate
    from gpusd.daemon.bookings import DIR_NAME, Bookings

    class Daemon:
        state_dir = state
        hostname, node_id = "h1", "n1"

        def publish(self, event: str, data: Any) -> None:
            pass

    good = Booking("aaaaaaaaaaaa", "alice", ("GPU-1",), time.time() + 60, time.time() + 120, (0,))
    assert poolstate.write(state, good.booking_id, good.to_dict(), DIR_NAME)
    (state / DIR_NAME / "bbbbbbbbbbbb.json").write_text('{"format": 1, "booking_id": "bbbbbbbbbbbb", "user": 3}')
    (state / DIR_NAME / "cccccccccccc.json").write_bytes(b"\x00garbage")
    book = Bookings(Daemon(), None)
    book.load()
    assert list(book.book) == [good.booking_id]
    assert sorted(p.name for p in (state / DIR_NAME).iterdir()) == ["aaaaaaaaaaaa.json"]
    os.chmod(state, 0o700)


def test_a_bookings_file_anyone_else_could_write_is_not_believed(tmp_path: Path) -> None:
    """A local user cannot keep others off GPUs with a bookings.json of their own: only the daemon's
    (root's, or one's own daemon's) file in a directory only it can write counts; a bad entry costs itself."""
    from gpusd.alloc.bookings import Booking, current, write_summary

    good = Booking("aaaaaaaaaaaa", "alice", ("GPU-1",), time.time() + 60, time.time() + 120, (0,))
    d = tmp_path / "state"
    d.mkdir(mode=0o700)
    write_summary(d, [good])
    assert current(d) == [good]
    raw = json.loads((d / "bookings.json").read_text())
    raw["bookings"].append({"booking_id": "../../x", "user": "mallory", "devices": ["GPU-1"], "start": 1, "end": 2})
    raw["bookings"].append({"booking_id": "bbbbbbbbbbbb", "user": "m", "devices": ["GPU-1"], "start": 9, "end": 1})
    (d / "bookings.json").write_text(json.dumps(raw))
    assert current(d) == [good]  # the damaged entries are left out, never the rest
    d.chmod(0o777)  # a directory others can write: its file could be anyone's
    assert current(d) == []
    d.chmod(0o700)
    (d / "bookings.json").chmod(0o666)
    assert current(d) == []
    (d / "bookings.json").chmod(0o644)
    os.chown(d / "bookings.json", 12345, 12345)  # another user's file
    assert current(d) == []
    os.unlink(d / "bookings.json")
    os.symlink(tmp_path / "elsewhere.json", d / "bookings.json")
    (tmp_path / "elsewhere.json").write_text(json.dumps(raw))
    assert current(d) == []  # never through a link


async def test_the_policys_caps_apply_at_when(tmp_path: Path, state: Path, accounts: Accounts,  # noqa: F811
                                              monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
                                              ) -> None:
    """A booking is no way around max_gpus_per_user: its hold is a lease like any other, refused by the cap
    at WHEN (said in the log, tried again), never granted past it."""
    import logging

    from gpusd.alloc.leases import LeaseStore

    alice = accounts.add("alice")
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"max_gpus_per_user": 1}))
    policy.chmod(0o644)
    monkeypatch.setenv("GPUSD_POLICY", str(policy))
    caplog.set_level(logging.WARNING, logger="gpusd.bookings")
    async with running_daemon(tmp_path, unique_session(), token=TOKEN, simulate=SIM, tls=False) as d:
        r = await acall("POST", base(d) + "/bookings", {"count": 2, "start": time.time() + 2, "duration": 60},
                        user=alice.signer())
        assert r.status == 201, r.data
        await wait_until(lambda: "cannot be held yet" in caplog.text, timeout=30)
        assert "max_gpus_per_user 1" in caplog.text
        assert LeaseStore().leases() == [] and d.bookings.book[r.data["booking_id"]].lease is None


async def test_a_waiting_job_without_a_limit_gets_the_gpus_once_the_booking_is_over(
        tmp_path: Path, state: Path, accounts: Accounts) -> None:  # noqa: F811
    from gpusd.alloc.api import LeaseRequest, allocate
    from gpusd.alloc.select import Constraints

    alice = accounts.add("alice")
    async with running_daemon(tmp_path, unique_session(), token=TOKEN, simulate=SIM, tls=False) as d:
        r = await acall("POST", base(d) + "/bookings", {"count": 2, "start": time.time() + 3, "duration": 4},
                        user=alice.signer())
        assert r.status == 201, r.data
        end = r.data["end"]
        sel = await asyncio.to_thread(allocate, LeaseRequest(Constraints.build(count=2), simulate=SIM, wait=True,
                                                             timeout=60, poll=0.2))
        try:
            assert time.time() >= end  # --wait waited past the booking
            assert d.bookings.holds == 1  # which was held for alice meanwhile, the waiter queued or not
        finally:
            sel.release()
