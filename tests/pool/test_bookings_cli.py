"""``gpusd reserve --at``, ``gpusd reservations`` (and ``--ics``), ``gpusd release`` of a booking, as a user
types them (docs/pool.md, "Time"): the CLI against a daemon on 127.0.0.1 reached with ``--peer``, the
booking signed with the user's own SSH key (a real account and agent)."""

from __future__ import annotations

import asyncio
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any

from conftest import REPO
from daemon_helpers import running_daemon, unique_session
from lan_helpers import secret_file
from user_keys import Accounts, accounts, needs_accounts  # noqa: F401

pytestmark = needs_accounts

TOKEN = secrets.token_hex(32)


def cli(args: list[str], env: dict[str, str]) -> Any:
    import subprocess

    return subprocess.run([sys.executable, "-m", "gpusd", *args], env=env, capture_output=True, text=True,
                          timeout=120)


async def test_reserve_at_lists_exports_and_cancels_a_booking(tmp_path: Path, accounts: Accounts,  # noqa: F811
                                                              monkeypatch: Any) -> None:
    alice = accounts.add("alice")
    state = tmp_path / "state-h1"
    state.mkdir(mode=0o700)
    monkeypatch.setenv("GPUSD_STATE_DIR", str(state))
    key = secret_file(tmp_path / "fleet.key", TOKEN)
    session = unique_session()
    async with running_daemon(tmp_path, session, token=TOKEN, simulate="2xA100-80GB", tls=False) as d:
        env = dict(os.environ, PYTHONPATH=str(REPO / "src"), GPUSD_INTERFACES="127.0.0.1", **alice.env())
        where = ["--token-file", str(key), "--session", session, "--interface", "127.0.0.1",
                 "--peer", f"127.0.0.1:{d.port}"]
        # bad input: one line, nothing booked
        for args, words in [(["--at", "+0s"], "in the past"), (["--at", "yesterday"], "not a moment"),
                            (["--at", "+1h", "--for", "0"], "longer than 0")]:
            r = await asyncio.to_thread(cli, ["reserve", "-n", "1", *args, *where], env)
            # one line (argparse's usage errors add their "see gpusd reserve --help")
            assert r.returncode == 2 and words in r.stderr.splitlines()[0] and "Traceback" not in r.stderr, r.stderr
            assert len([ln for ln in r.stderr.splitlines() if "--help" not in ln]) == 1, r.stderr
        assert d.bookings.book == {}
        start = time.time() + 3600
        r = await asyncio.to_thread(cli, ["reserve", "-n", "2", "--at", "+1h", "--for", "30m", "--note", "demo;x",
                                          *where], env)
        assert r.returncode == 0, r.stderr
        [booking] = d.bookings.book.values()
        assert booking.user == alice.name and abs(booking.start - start) < 60 and booking.end - booking.start == 1800
        assert f"booking {booking.booking_id}" in r.stdout and "booked GPU 0,1 on h1" in r.stdout
        # a second booking over the first is refused naming it (exit 4)
        r = await asyncio.to_thread(cli, ["reserve", "-n", "1", "--at", "+80m", "--for", "30m", *where], env)
        assert r.returncode == 4 and booking.booking_id in r.stderr, r.stderr
        r = await asyncio.to_thread(cli, ["reservations", *where], env)
        assert r.returncode == 0 and booking.booking_id in r.stdout and "START" in r.stdout, r.stdout
        assert "ahead" in r.stdout
        ics = tmp_path / "mine.ics"
        r = await asyncio.to_thread(cli, ["reservations", "--ics", str(ics), *where], env)
        assert r.returncode == 0, r.stderr
        text = ics.read_bytes().decode()
        assert text.startswith("BEGIN:VCALENDAR\r\n") and text.endswith("END:VCALENDAR\r\n")
        assert f"UID:{booking.booking_id}@h1" in text
        assert f"DTSTART:{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime(booking.start))}" in text
        assert "demo\\;x" in text  # RFC 5545's escapes
        r = await asyncio.to_thread(cli, ["release", booking.booking_id, *where], env)
        assert r.returncode == 0 and f"cancelled booking {booking.booking_id}" in r.stdout, r.stderr
        assert d.bookings.book == {}
