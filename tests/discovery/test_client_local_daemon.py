"""``gpusd.Client().list_devices()`` takes the fleet source ``gpusd list`` takes (gpusd.discovery.fleetsource):
this host's own daemon's fleet view where a daemon of the client's session runs here, a browse otherwise.
Daemons on 127.0.0.1 only, each with the test's own state directory and a session of its own."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_list_fast import OWN_NODE, fleet_host, local_daemon

import gpusd
from daemon_helpers import fast_mdns, unique_session  # noqa: F401
from gpusd.discovery import fleetsource
from gpusd.discovery.options import DiscoveryOptions
from gpusd.identity import state_dir
from waiting import wait_until_sync

pytestmark = pytest.mark.usefixtures("fast_mdns")


def gpusd_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, GPUSD_INTERFACES="127.0.0.1", GPUSD_MDNS_FAST="1")  # the test's state directory
    for var in ("GPUSD_TOKEN", "GPUSD_TOKEN_FILE", "GPUSD_PEERS", "GPUSD_PEERS_FILE", "GPUSD_DNS_SD_DOMAIN"):
        env.pop(var, None)
    return subprocess.run([sys.executable, "-m", "gpusd", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def _daemons_view_ready(session: str) -> bool:
    """The running daemon's fleet view lists the daemon itself (a daemon just started may not yet)."""
    reading = fleetsource.ask_for(DiscoveryOptions(session=session, interfaces=["127.0.0.1"]))
    return reading is not None and reading.wait(5) and reading.result() is not None


def test_client_and_gpusd_list_take_the_local_daemons_view_and_browse_without_one() -> None:
    session = unique_session("cl")
    r = gpusd_cli("start", "--simulate", "2xA100-80GB", "--interface", "127.0.0.1", "--port", "0",
                  "--session", session, "--hostname", "client-host")
    assert r.returncode == 0, r.stderr
    try:
        wait_until_sync(lambda: _daemons_view_ready(session), 20)
        client = gpusd.Client(session=session, interfaces=["127.0.0.1"], daemon_thread=True)
        devices = client.list_devices()
        assert not client.listening  # the daemon's view was taken: nothing browsed, no thread left listening
        assert [(d.hostname, d.index, d.simulated) for d in devices] == [("client-host", 0, True),
                                                                         ("client-host", 1, True)]
        # gpusd list reads the same view: the same GPUs
        r = gpusd_cli("list", "--json", "--session", session)
        assert r.returncode == 0, r.stderr
        assert [(d["hostname"], d["gpu"]["index"], d["gpu"]["uuid"]) for d in json.loads(r.stdout)] == [
            (d.hostname, d.index, d.uuid) for d in devices]
        # another session's client does not take this daemon's view (it browses, and nothing announces that one)
        other = gpusd.Client(session=unique_session("cl-other"), interfaces=["127.0.0.1"], daemon_thread=True)
        try:
            assert other.list_devices(timeout=1.5) == []
            assert other.listening  # it browsed
        finally:
            other.stop_listening()
    finally:
        r = gpusd_cli("stop")
    assert r.returncode == 0, r.stderr
    # no daemon here any more: the client browses, and finds the GPUs nothing announces now: none
    client = gpusd.Client(session=session, interfaces=["127.0.0.1"], daemon_thread=True)
    try:
        assert client.list_devices(timeout=1.5) == []
        assert client.listening
    finally:
        client.stop_listening()


async def test_client_lists_hosts_only_the_daemons_view_knows(tmp_path: Path) -> None:
    """A host the local daemon follows but nothing announces on the link (one beyond it) is in the client's
    list: it is the daemon's view, not a browse."""
    session = unique_session()
    hosts = [fleet_host(OWN_NODE, "here", session, 2), fleet_host("fedcba9876543210", "far", session, 1)]
    async with local_daemon(state_dir(), session, hosts):
        client = gpusd.Client(session=session, interfaces=["127.0.0.1"], daemon_thread=True)
        devices = await asyncio.to_thread(client.list_devices)
        assert [(d.hostname, d.index) for d in devices] == [("far", 0), ("here", 0), ("here", 1)]
        assert not client.listening
        # its filters hold for the daemon's view as for a browse
        only_far = gpusd.Client(session=session, interfaces=["127.0.0.1"], hostname="fa*", daemon_thread=True)
        assert [d.hostname for d in await asyncio.to_thread(only_far.list_devices)] == ["far"]


@pytest.mark.parametrize("options", [
    {"all_sessions": True},  # a daemon's view is of its own session
    {"peers": ["198.18.0.1:4780"]},  # hosts beyond the link asked for: the daemon's view has its own
    {"interfaces": ["127.0.0.2"]},  # the daemon browses elsewhere
], ids=["all-sessions", "peers", "other-interface"])
async def test_a_client_asking_for_what_the_daemons_view_is_not_browses(tmp_path: Path,
                                                                        options: dict[str, Any]) -> None:
    session = unique_session()
    seen: list[Any] = []
    async with local_daemon(state_dir(), session, [fleet_host(OWN_NODE, "here", session, 1)], seen=seen):
        opts = DiscoveryOptions(**{"session": session, "interfaces": ["127.0.0.1"], **options})
        reading = fleetsource.ask_for(opts)
        if reading is not None:  # asked, but the daemon's record says it is not what was asked for
            assert await asyncio.to_thread(reading.wait, 5) and reading.result() is None
        assert seen == []  # nothing was asked of the daemon
        # the same options as they are, with this daemon's interface: its view
        reading = fleetsource.ask_for(DiscoveryOptions(session=session, interfaces=["127.0.0.1"]))
        assert reading is not None and await asyncio.to_thread(reading.wait, 5)
        assert [h.hostname for h in reading.result().hosts] == ["here"]  # type: ignore[union-attr]
