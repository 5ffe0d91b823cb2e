"""Bookings where people look (docs/pool.md, "Time"): each booked GPU's row in ``gpusd list``, the host's
line in ``gpusd top``, both from the host's snapshot (``bookings``, added in 0.4); a hostile booker name
is shown without its control bytes."""

from __future__ import annotations

import time

from gpusd.cli.discover import booking_note
from gpusd.model import BookingInfo, HostSnapshot
from gpusd.views.top import HostView, TopState, render_text
from monitor_fakes import sim_host


def _at(hh: int, mm: int) -> float:
    t = time.localtime()
    return time.mktime((t.tm_year, t.tm_mon, t.tm_mday, hh, mm, 0, 0, 0, -1))


def test_a_booked_gpu_says_when_and_for_whom_in_gpusd_list() -> None:
    now = _at(9, 0)
    b = [BookingInfo("aaaaaaaaaaaa", _at(14, 0), _at(16, 0), [0, 1], "alice\x1b[31m"),
         BookingInfo("bbbbbbbbbbbb", _at(10, 0), _at(11, 0), [1], None, held=True)]
    assert booking_note(b, 0, now) == " [booked alice 14:00-16:00]"  # the escape sequence stripped
    assert booking_note(b, 1, now) == " [held for 10:00-11:00]"  # the sooner; no name for an unverified reader
    assert booking_note(b, 2, now) == ""
    assert booking_note(b, 0, _at(17, 0)) == ""  # over


def test_the_snapshot_carries_bookings_and_top_shows_the_next() -> None:
    snap = sim_host("gpu-node-1", "2xA100-80GB")
    snap.bookings = [BookingInfo("aaaaaaaaaaaa", time.time() + 3600, time.time() + 7200, [0, 1], "alice")]
    again = HostSnapshot.from_dict(snap.to_dict())
    assert again.bookings == snap.bookings
    text = render_text([HostView(again.hostname, again.node_id, again)], TopState(), width=140, color=False)
    header = next(ln for ln in text.splitlines() if "gpu-node-1" in ln)
    assert "booked GPU 0,1 " in header, header
    older = {k: v for k, v in snap.to_dict().items() if k != "bookings"}  # an older daemon's snapshot
    assert HostSnapshot.from_dict(older).bookings == []
