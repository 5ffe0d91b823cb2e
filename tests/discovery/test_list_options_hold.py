"""Issue 18, item 6: when ``gpusd list`` would answer from the local daemon's fleet view, the options the user
gave still hold: with the fleet secret, a daemon that cannot prove it holds it is not believed about which
hosts are verified (the client browses and checks each host itself, so strangers are marked [unverified]);
``--interface`` is checked (exit 2 for no such interface) and must be the daemon's; hosts beyond the link
(``--peer`` & co.) are looked for by the client."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest
from test_discovery import announce, good_txt, http_peer, snapshot_json, sse
from test_list_fast import OWN_NODE, fleet_host, gpusd_list, local_daemon

from daemon_helpers import fast_mdns, unique_session  # noqa: F401
from gpusd.wire.sse import format_event

pytestmark = pytest.mark.usefixtures("fast_mdns")
SECRET = "a-fleet-secret-of-32-characters!"


async def _run(state: Path, *args: str, **env: str) -> tuple[int, str, str]:
    full = dict(os.environ, GPUSD_STATE_DIR=str(state), GPUSD_INTERFACES="127.0.0.1", GPUSD_MDNS_FAST="1", **env)
    full.pop("GPUSD_TOKEN", None)
    full.update(env)
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gpusd", "list", *args, env=full,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_with_the_secret_a_token_less_local_daemon_is_not_believed(tmp_path: Path) -> None:
    session = unique_session()
    state = tmp_path / "state"

    async def events(request):  # an announced host that does not prove it holds the secret
        return await sse(request, format_event("snapshot", snapshot_json("bbbb0001", "stranger")), hold=10)

    hosts = [fleet_host(OWN_NODE, "here", session), fleet_host("fedcba9876543210", "far", session)]
    async with local_daemon(state, session, hosts), http_peer(events) as port, \
            announce("stranger-bbbb0001", good_txt("bbbb0001", "stranger", session), port):
        without = await gpusd_list(state, "--session", session)  # no secret: the fleet view, no claims
        assert {d["hostname"] for d in without} == {"here", "far"} and {d["verified"] for d in without} == {None}
        devices = await gpusd_list(state, "--session", session, GPUSD_TOKEN=SECRET)
        assert [(d["hostname"], d["verified"]) for d in devices] == [("stranger", False)]
        rc, out, _ = await _run(state, "--session", session, GPUSD_TOKEN=SECRET)
        assert rc == 0 and "[unverified]" in out


async def test_a_local_daemon_that_proves_the_secret_still_answers(tmp_path: Path) -> None:
    session = unique_session()
    state = tmp_path / "state"
    async with local_daemon(state, session, [fleet_host(OWN_NODE, "here", session)], secret=SECRET):
        devices = await gpusd_list(state, "--session", session, GPUSD_TOKEN=SECRET)
    assert [d["hostname"] for d in devices] == ["here"]


async def test_interface_is_checked_and_must_be_the_daemons(tmp_path: Path) -> None:
    session = unique_session()
    state = tmp_path / "state"
    hosts = [fleet_host(OWN_NODE, "here", session), fleet_host("fedcba9876543210", "far", session)]
    async with local_daemon(state, session, hosts):  # its interfaces: 127.0.0.1
        rc, out, err = await _run(state, "--session", session, "--interface", "eth9")
        assert rc == 2 and "--interface eth9: no such interface" in err and out == "", (rc, out, err)
        same = await gpusd_list(state, "--session", session, "--interface", "127.0.0.1")
        assert {d["hostname"] for d in same} == {"here", "far"}  # what the daemon sees there: its view
        other = await gpusd_list(state, "--session", session, "--interface", "127.0.0.1", "--interface", "lo")
        assert {d["hostname"] for d in other} == {"here", "far"}  # lo is 127.0.0.1: the same addresses


async def test_peers_asked_for_are_looked_for_by_the_client(tmp_path: Path) -> None:
    session = unique_session()
    state = tmp_path / "state"
    hosts = [fleet_host(OWN_NODE, "here", session), fleet_host("fedcba9876543210", "far", session)]
    async with local_daemon(state, session, hosts):
        rc, out, err = await _run(state, "--json", "--session", session, "--browse", "1", "--peer", "127.0.0.1:9")
        assert rc == 6 and out.strip() == "[]", (rc, out, err)  # browsed (nothing there), not the daemon's view
