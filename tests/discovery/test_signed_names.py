"""A host is what it proved (issue 17, attack 1; docs/security.md, "What a client believes, and from
whom"): a stranger without the secret re-announces a real daemon's TXT under another service name and
a host name of its choosing.  The real daemon answers the proof, but the proof carries the daemon's own
name: the copy is listed as an unverified copy, never ranked or placed, and a copy that agrees with
the signed name is one host with the real one.  Daemons and clients are bound to 127.0.0.1 only."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from daemon_helpers import LOOPBACK, fast_mdns, running_daemon, unique_session  # noqa: F401
from gpusd.wire.signing import FleetKey, Headers, Request, Response

SECRET = "9e1f0a2d4e6f8091a2b3c4d5e6f70817"
HOSTILE_NAMES = ["aaa-evil.example.com", "attacker@198.18.0.2", "ssh://victim@198.18.0.2:2222"]


async def _announce_copy(d: Any, name: str, label: str) -> tuple[Any, Any]:
    """Announce ``d``'s own TXT (node id, ports, certificate fingerprint) under the service ``label``
    with ``host=name``, pointing at ``d``'s address: what a stranger copies off the LAN."""
    from zeroconf import ServiceInfo

    from gpusd.wire.mdns import open_zeroconf
    from gpusd.wire.txt import SERVICE_TYPE

    props = dict(d.announcer.txt, host=name)
    zc = await open_zeroconf(list(LOOPBACK))
    info = ServiceInfo(SERVICE_TYPE, f"{label}.{SERVICE_TYPE}", port=d.port, properties=props,
                       server=f"{label}.local.", parsed_addresses=list(LOOPBACK))
    await (await zc.async_register_service(info))
    return zc, info


async def _settled_hosts(client: Any, want: int, timeout: float = 12.0) -> list[Any]:
    deadline = asyncio.get_running_loop().time() + timeout
    await client.wait_settled(8)
    while len([h for h in client.hosts if h.snapshot is not None]) < want:
        if asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.1)
    return list(client.hosts)


@pytest.mark.timeout(90)
async def test_a_copied_announcement_is_listed_as_an_unverified_copy_and_never_ranked(tmp_path, fast_mdns):  # noqa: F811
    from gpusd.alloc.select import Constraints
    from gpusd.discovery.client import AsyncClient
    from gpusd.pool.client import rank_hosts

    session = unique_session("names")
    async with running_daemon(tmp_path, session, "real-node", token=SECRET) as d:
        copies = [await _announce_copy(d, name, f"copy{i}-{d.node_id[:8]}") for i, name in enumerate(HOSTILE_NAMES)]
        client = AsyncClient(session=session, interfaces=LOOPBACK, key=FleetKey(SECRET))
        try:
            hosts = await _settled_hosts(client, 1 + len(HOSTILE_NAMES))
            by_name = {h.hostname: h for h in hosts}
            assert set(by_name) == {"real-node", *HOSTILE_NAMES}, by_name.keys()
            # the daemon answered each copy's proof, yet no copy is verified under its own name
            assert {name: by_name[name].verified for name in HOSTILE_NAMES} == dict.fromkeys(HOSTILE_NAMES, False)
            for name in HOSTILE_NAMES:  # shown as what it is: a copy of the verified host's announcement
                copy = by_name[name]
                assert copy.identity is None and copy.copy_of == "real-node" and copy.signed_addresses == [], name
            real = by_name["real-node"]
            assert real.verified is True and real.identity is not None
            assert (real.identity.hostname, real.identity.node_id) == ("real-node", d.node_id)
            assert real.signed_addresses == ["127.0.0.1"]
            listed = {(dev.hostname, dev.verified, dev.copy_of) for dev in client.list_devices()}
            assert ("real-node", True, None) in listed
            assert {v for n, v, _ in listed if n in HOSTILE_NAMES} == {False}
            # ranked (and so reserved, placed, ssh-ed to) only under the signed name, whatever sorts first
            ranked = rank_hosts(hosts, Constraints(count=1))
            assert [h.hostname for _, h, _ in ranked] == ["real-node"]
        finally:
            await client.stop_listening()
            for zc, info in copies:
                await (await zc.async_unregister_service(info))
                await zc.async_close()


@pytest.mark.timeout(90)
async def test_two_services_claiming_one_node_with_its_signed_name_are_one_host(tmp_path, fast_mdns):  # noqa: F811
    from gpusd.discovery.client import AsyncClient

    session = unique_session("twins")
    async with running_daemon(tmp_path, session, "real-node", token=SECRET) as d:
        zc, info = await _announce_copy(d, "real-node", f"twin-{d.node_id[:8]}")
        client = AsyncClient(session=session, interfaces=LOOPBACK, key=FleetKey(SECRET))
        try:
            await client.wait_settled(8)
            await asyncio.sleep(1.0)  # both services followed, both streams proved
            hosts = client.hosts
            assert [(h.hostname, h.verified) for h in hosts] == [("real-node", True)], hosts
            assert len(client.list_devices()) == 2  # its 2 GPUs, once
        finally:
            await client.stop_listening()
            await (await zc.async_unregister_service(info))
            await zc.async_close()


def test_the_signed_name_and_addresses_are_covered_by_the_answers_signature() -> None:
    key = FleetKey(SECRET)
    req = Request("GET", "http://198.18.0.2:4780/api/v1/events", Headers())
    resp = Response(200, req, Headers())
    key.sign_response(resp, "n0nce", "0123456789abcdef", host="node-1",
                      addresses=["198.18.0.2", "bad", "10.0.0.1", "0.0.0.0"])
    assert resp.headers["Gpusd-Host"] == "node-1" and resp.headers["Gpusd-Addrs"] == "198.18.0.2,10.0.0.1,0.0.0.0"
    proof = key.response_proof(resp, "n0nce", "0123456789abcdef")
    assert proof is not None and (proof.host, proof.addresses) == ("node-1", ("198.18.0.2", "10.0.0.1"))  # no 0.0.0.0
    # a relay that rewrites the name or the addresses breaks the proof
    for header, value in (("Gpusd-Host", "aaa-evil.example.com"), ("Gpusd-Addrs", "198.18.0.66")):
        forged = Response(200, req, Headers({**resp.headers, header: value}))
        assert key.response_proof(forged, "n0nce", "0123456789abcdef") is None
    # any name travels as one printable header value, and comes back as it was
    odd = Response(200, req, Headers())
    key.sign_response(odd, "n0nce", "0123456789abcdef", host="Büro Rechner\t1")
    assert odd.headers["Gpusd-Host"].isascii() and " " not in odd.headers["Gpusd-Host"]
    got = key.response_proof(odd, "n0nce", "0123456789abcdef")
    assert got is not None and got.host is None  # a tab is no host name: not believed
    plain = Response(200, req, Headers())
    key.sign_response(plain, "n0nce", "0123456789abcdef", host="Büro-1")
    got = key.response_proof(plain, "n0nce", "0123456789abcdef")
    assert got is not None and got.host == "Büro-1" and got.addresses == ()


def test_an_old_daemons_proof_names_no_host() -> None:
    """A gpusd 0.2 daemon's answer (no Gpusd-Host): a proof of the secret, but of no name."""
    key = FleetKey(SECRET)
    req = Request("GET", "http://198.18.0.2:4780/api/v1/events", Headers())
    resp = Response(200, req, Headers())
    key.sign_response(resp, "n0nce", "0123456789abcdef")
    proof = key.response_proof(resp, "n0nce", "0123456789abcdef")
    assert proof is not None and proof.host is None and "Gpusd-Host" not in resp.headers


@pytest.mark.timeout(120)
async def test_a_copy_that_renames_itself_later_is_checked_again(tmp_path, fast_mdns):  # noqa: F811
    """A stranger copies the announcement with the real name first (one host with the real one), then
    updates its TXT to a name of its own: the new name is checked against the signed one again."""
    from zeroconf import ServiceInfo

    from gpusd.discovery.client import AsyncClient

    session = unique_session("rename")
    async with running_daemon(tmp_path, session, "real-node", token=SECRET) as d:
        zc, info = await _announce_copy(d, "real-node", f"later-{d.node_id[:8]}")
        client = AsyncClient(session=session, interfaces=LOOPBACK, key=FleetKey(SECRET))
        try:
            await client.wait_settled(8)
            renamed = ServiceInfo(info.type, info.name, port=info.port, server=info.server,
                                  properties=dict(info.decoded_properties, host="aaa-evil.example.com"),
                                  parsed_addresses=list(LOOPBACK))
            await (await zc.async_update_service(renamed))
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 40
            want = {"real-node": (True, None), "aaa-evil.example.com": (False, "real-node")}
            while loop.time() < deadline:
                seen = {h.hostname: (h.verified, h.copy_of) for h in client.hosts if h.snapshot is not None}
                if seen == want:
                    break
                await asyncio.sleep(0.2)
            assert seen == want
        finally:
            await client.stop_listening()
            await (await zc.async_unregister_service(info))
            await zc.async_close()


def test_the_addresses_a_client_acts_on_are_signed_ones_the_reached_one_first() -> None:
    from gpusd.discovery.types import RemoteHost, SignedIdentity
    from gpusd.wire.txt import TxtRecord

    txt = TxtRecord(node_id="0123456789abcdef", hostname="node-1", session="default", count=1)
    host = RemoteHost(key="k", txt=txt, addresses=["198.18.0.66", "198.18.0.2"], url="http://198.18.0.2:4780/api/v1")
    assert host.signed_addresses == []  # announced addresses are never acted on
    host.identity = SignedIdentity("0123456789abcdef", "node-1", ("10.0.0.1", "198.18.0.2"))
    assert host.signed_addresses == ["198.18.0.2", "10.0.0.1"] and host.hostname == "node-1"
    host.url = "http://198.18.0.66:4780/api/v1"  # reached somewhere it did not sign: not acted on
    assert host.signed_addresses == ["10.0.0.1", "198.18.0.2"]
