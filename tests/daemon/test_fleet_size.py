"""The fleet view's bound on followed hosts (issue 24, a fleet of 1,000): ``fleet_max_hosts`` (1,024 by
default, one descriptor a followed host), lowered where the open-file limit would run out first, and
said once in the log."""

from __future__ import annotations

import logging
import resource
from typing import Any

import pytest

from daemon_helpers import unique_session
from gpusd.daemon import fleet as fleet_mod
from gpusd.daemon.config import FD_RESERVE, DaemonConfig
from gpusd.daemon.fleet import Fleet, followed_cap


def limit(monkeypatch: pytest.MonkeyPatch, soft: int) -> None:
    monkeypatch.setattr(resource, "getrlimit", lambda which: (soft, 1 << 20))


def test_the_cap_is_the_configured_one_unless_descriptors_run_out(monkeypatch: pytest.MonkeyPatch) -> None:
    assert DaemonConfig().fleet_max_hosts == 1024  # a fleet of 1,000 hosts is followed by default
    limit(monkeypatch, 20000)
    assert followed_cap(1024) == 1024
    limit(monkeypatch, 1024)  # a common soft limit where the daemon could not raise it
    assert followed_cap(1024) == (1024 - FD_RESERVE) // 2 == 448  # the rest is for incoming connections
    limit(monkeypatch, 64)
    assert followed_cap(1024) == 16
    assert followed_cap(8) == 8  # never above what was configured


async def test_the_fleet_view_follows_at_most_the_cap_and_says_so(monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: Any) -> None:
    limit(monkeypatch, 512)
    cfg = DaemonConfig(session=unique_session(), interfaces=["127.0.0.1"], fleet="on", peers=[])
    fleet = Fleet(cfg, None, allow_loopback=True)
    with caplog.at_level(logging.INFO, logger=fleet_mod.log.name):
        try:
            await fleet.ensure_started(settle=0.1)
            assert fleet.client is not None and fleet.client.max_hosts == (512 - FD_RESERVE) // 2 == 192
        finally:
            await fleet.stop()
    lines = [r.getMessage() for r in caplog.records if r.name == fleet_mod.log.name]
    assert any("following at most 192 hosts, not 1024 (fleet_max_hosts)" in m for m in lines), lines
    assert any("fleet view started" in m and "following at most 192 hosts" in m for m in lines), lines
