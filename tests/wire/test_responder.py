"""RFC 6762 §6.7: answers to legacy unicast queries (source port not 5353) carry TTLs of at most ten
seconds.  The rewrite alone (no network), then a real daemon asked by a simple resolver (dnspython,
from an ephemeral port) in a namespace LAN (tests/netns.py): this second test fails if the installed
python-zeroconf stops sending its unicast answers through ``Zeroconf.async_send``."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
import time

import dns.exception
import dns.flags
import dns.message
import dns.rdataclass
import pytest
import zeroconf

from fakenvml import make_gpus
from gpusd.wire.responder import (
    ConformingZeroconf,
    is_legacy_unicast_answer,
    legacy_unicast_response,
    local_networks,
    on_link,
)
from netns import Lan, lan, netns_ok  # noqa: F401

IN, UNIQUE = 1, 0x8000
PTR, TXT, SRV, A = 12, 16, 33, 1


def zeroconf_style_answer() -> zeroconf.DNSOutgoing:
    """A unicast answer as python-zeroconf builds one for a legacy query: question echoed, records
    with their real TTLs (cache-flush bit set on the unique ones)."""
    from zeroconf import (
        DNSAddress,
        DNSNsec,
        DNSOutgoing,
        DNSPointer,
        DNSQuestion,
        DNSService,
        DNSText,
    )

    out = DNSOutgoing(0x8400, False, 4242)
    out.add_question(DNSQuestion("_gpusd._tcp.local.", PTR, IN))
    name = "node-1-7b676f27._gpusd._tcp.local."
    out.add_answer_at_time(DNSPointer("_gpusd._tcp.local.", PTR, IN, 4500, name), 0)
    out.add_additional_answer(DNSService(name, SRV, IN | UNIQUE, 120, 0, 0, 4780, "node-1-7b676f27.local."))
    out.add_additional_answer(DNSText(name, TXT, IN | UNIQUE, 4500, b"\x03v=1"))
    out.add_additional_answer(DNSAddress("node-1-7b676f27.local.", A, IN | UNIQUE, 120, socket.inet_aton("198.18.0.2")))
    # "no AAAA": its next-name is compressed, as mDNS allows and unicast DNS does not
    out.add_additional_answer(DNSNsec("node-1-7b676f27.local.", 47, IN | UNIQUE, 120, "node-1-7b676f27.local.", [A]))
    return out


def test_legacy_unicast_answers_are_capped_to_ten_seconds() -> None:
    out = zeroconf_style_answer()
    assert is_legacy_unicast_answer(out, "198.18.0.9", 40000)
    assert not is_legacy_unicast_answer(out, "198.18.0.9", 5353)  # a normal mDNS querier: full TTLs
    assert not is_legacy_unicast_answer(out, None, 40000)
    with pytest.raises(dns.exception.FormError):  # python-zeroconf's own answer: refused by a resolver
        dns.message.from_wire(out.packets()[0])
    [packet] = legacy_unicast_response(out).packets()
    msg = dns.message.from_wire(packet)
    assert msg.id == 4242 and msg.flags & dns.flags.QR and msg.flags & dns.flags.AA
    assert [(q.name.to_text(), q.rdtype) for q in msg.question] == [("_gpusd._tcp.local.", PTR)]
    records = [rr for section in (msg.answer, msg.additional) for rr in section]
    assert sorted(rr.rdtype for rr in records) == [A, PTR, TXT, SRV]  # NSEC left out
    assert all(rr.ttl <= 10 and rr.rdclass == dns.rdataclass.IN for rr in records)  # no cache-flush bit
    srv = next(rr for rr in records if rr.rdtype == SRV)[0]
    assert srv.port == 4780 and srv.target.to_text() == "node-1-7b676f27.local."
    # the records in python-zeroconf's registry and cache keep their TTLs
    assert [rec.ttl for rec, _ in out.answers] == [4500]


def test_only_on_link_legacy_answers_are_rewritten_and_off_link_ones_dropped() -> None:
    import ipaddress

    sent: list[tuple[zeroconf.DNSOutgoing, str | None, int]] = []

    class Probe(ConformingZeroconf):
        def __init__(self) -> None:  # no sockets: only the send path is exercised
            self._networks = [ipaddress.ip_network("198.18.0.0/15")]
            self._networks_at = time.monotonic()

    def record(self: object, out: zeroconf.DNSOutgoing, addr: str | None = None, port: int = 5353,
               *rest: object) -> None:
        sent.append((out, addr, port))

    original = zeroconf.Zeroconf.async_send
    zeroconf.Zeroconf.async_send = record  # type: ignore[method-assign]
    try:
        probe = Probe()
        out = zeroconf_style_answer()
        probe.async_send(out, "198.18.0.9", 5353)  # an mDNS querier (QU): as python-zeroconf built it
        probe.async_send(out, "198.18.0.9", 40000)  # a simple resolver: TTLs capped
        probe.async_send(out, "203.0.113.5", 40000)  # off the link (RFC 6762 §5.5): nothing
        probe.async_send(out, "203.0.113.5", 5353)
        probe.async_send(out)  # multicast: untouched
    finally:
        zeroconf.Zeroconf.async_send = original  # type: ignore[method-assign]
    assert [(a, p) for _, a, p in sent] == [("198.18.0.9", 5353), ("198.18.0.9", 40000), (None, 5353)]
    assert sent[0][0] is out and sent[1][0] is not out and sent[2][0] is out
    assert max(rec.ttl for rec in sent[1][0].additionals) == 10


def test_on_link() -> None:
    import ipaddress

    nets = [ipaddress.ip_network("192.0.2.0/24"), ipaddress.ip_network("fd00::/64")]
    assert on_link("192.0.2.77", nets) and on_link("fd00::5", nets) and on_link("fe80::1%eth0", nets)
    assert not on_link("198.51.100.1", nets) and not on_link("fd01::5", nets) and not on_link("junk", nets)
    assert any(on_link("127.0.0.1", [n]) for n in local_networks())  # loopback is ours


DIG = textwrap.dedent('''
    import json, sys
    import dns.message, dns.query

    server = sys.argv[1]

    def ask(name, rdtype):
        q = dns.message.make_query(name, rdtype)
        r = dns.query.udp(q, server, port=5353, timeout=3)  # from an ephemeral port: legacy unicast
        rrs = [rr for s in (r.answer, r.authority, r.additional) for rr in s]
        print(json.dumps({"q": [name, rdtype], "id_ok": r.id == q.id, "question": [x.to_text() for x in r.question],
                          "rrs": [[rr.name.to_text(), rr.rdtype, rr.rdclass, rr.ttl, [x.to_text() for x in rr]]
                                  for rr in rrs]}), flush=True)
        return rrs

    ptr = ask("_gpusd._tcp.local.", "PTR")
    instance = next(rr for rr in ptr if rr.rdtype == 12)[0].target.to_text()
    srv = ask(instance, "SRV")
    ask(instance, "TXT")
    ask(next(rr for rr in srv if rr.rdtype == 33)[0].target.to_text(), "A")
''')


def test_a_simple_resolver_gets_ttls_of_at_most_ten_seconds(lan: Lan) -> None:
    host = lan.add_gpu_host("node-1", make_gpus(1), fast=True)
    client = lan.add_node("client")
    host.start()
    r = lan.run(client, [sys.executable, "-c", DIG, host.ip], timeout=60)
    answers = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(answers) == 4, r.stderr + host.log_tail()
    seen = set()
    for a in answers:
        assert a["id_ok"] and len(a["question"]) == 1, a
        assert a["rrs"], a
        for name, rdtype, rdclass, ttl, _ in a["rrs"]:
            seen.add(rdtype)
            assert ttl <= 10, (a["q"], name, rdtype, ttl)
            assert rdclass == 1, (name, rdtype, rdclass)  # no cache-flush bit in a legacy answer
    assert {PTR, SRV, TXT, A} <= seen


SQUATTER = textwrap.dedent('''
    import asyncio, sys
    from zeroconf import ServiceInfo
    from zeroconf.asyncio import AsyncZeroconf

    async def main():
        ip, host_name = sys.argv[1], sys.argv[2]
        zc = AsyncZeroconf(interfaces=[ip])
        info = ServiceInfo("_squat._tcp.local.", "squatter._squat._tcp.local.", port=9, server=host_name,
                           parsed_addresses=[ip])
        await (await zc.async_register_service(info, cooperating_responders=True))  # no probing: just announce
        print("announced", flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
''')

ASK = textwrap.dedent('''
    import json, sys
    import dns.message, dns.query, dns.exception

    server, name, rdtype = sys.argv[1], sys.argv[2], sys.argv[3]
    try:
        r = dns.query.udp(dns.message.make_query(name, rdtype), server, port=5353, timeout=1.5)
        print(json.dumps([x.to_text() for s in r.answer for x in s]))
    except dns.exception.Timeout:
        print(json.dumps(None))
''')

NODE_ID = "00000000cafe0001"
INSTANCE = "node-1-00000000"


def ask(lan: Lan, node: object, server: str, name: str, rdtype: str) -> list[str] | None:
    r = lan.run(node, [sys.executable, "-c", ASK, server, name, rdtype], timeout=30)  # type: ignore[arg-type]
    return json.loads(r.stdout)  # type: ignore[no-any-return]


def test_a_taken_host_name_is_probed_and_avoided(lan: Lan) -> None:
    from netns import read_lines

    host = lan.add_gpu_host("node-1", make_gpus(1), fast=True)
    (host.state_dir / "node-id").write_text(NODE_ID + "\n")
    squatter, client = lan.add_node("squatter"), lan.add_node("client")
    p = lan.popen(squatter, [sys.executable, "-c", SQUATTER, squatter.ip, f"{INSTANCE}.local."],
                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout is not None and read_lines(p.stdout.fileno(), 1, 30) == ["announced"]
    host.start()
    # the daemon's SRV record points to a name of its own, with its own address only
    [srv] = ask(lan, client, host.ip, f"{INSTANCE}._gpusd._tcp.local.", "SRV") or [""]
    assert srv.endswith(f" 4780 {INSTANCE}-2.local."), srv + host.log_tail()
    assert ask(lan, client, host.ip, f"{INSTANCE}-2.local.", "A") == [host.ip]
    # and it never claims the squatter's name
    assert ask(lan, client, host.ip, f"{INSTANCE}.local.", "A") is None


def test_a_host_name_conflict_after_the_announcement_moves_to_a_new_name(lan: Lan) -> None:
    from netns import read_lines

    host = lan.add_gpu_host("node-1", make_gpus(1), fast=True)
    (host.state_dir / "node-id").write_text(NODE_ID + "\n")
    squatter, client = lan.add_node("squatter"), lan.add_node("client")
    host.start()
    [srv] = ask(lan, client, host.ip, f"{INSTANCE}._gpusd._tcp.local.", "SRV") or [""]
    assert srv.endswith(f" 4780 {INSTANCE}.local."), srv
    p = lan.popen(squatter, [sys.executable, "-c", SQUATTER, squatter.ip, f"{INSTANCE}.local."],
                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout is not None and read_lines(p.stdout.fileno(), 1, 30) == ["announced"]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        [srv] = ask(lan, client, host.ip, f"{INSTANCE}._gpusd._tcp.local.", "SRV") or [""]
        if srv.endswith(f" 4780 {INSTANCE}-2.local."):
            break
        time.sleep(0.2)
    assert srv.endswith(f" 4780 {INSTANCE}-2.local."), srv + host.log_tail()
    assert ask(lan, client, host.ip, f"{INSTANCE}-2.local.", "A") == [host.ip]
    assert "is taken by another host" in host.log_tail()


class FakeZc:
    """What HostNameGuard uses of python-zeroconf: listeners, sending, the cache."""

    def __init__(self) -> None:
        self.sent: list[zeroconf.DNSOutgoing] = []
        self.listeners: list[object] = []
        self.cache = zeroconf.DNSCache()

    def async_add_listener(self, listener: object, question: object) -> None:
        self.listeners.append(listener)

    def async_remove_listener(self, listener: object) -> None:
        self.listeners.remove(listener)

    def async_send(self, out: zeroconf.DNSOutgoing, *rest: object) -> None:
        self.sent.append(out)


def foreign_a(name: str, ip: str = "198.18.0.66", ttl: int = 120) -> zeroconf.RecordUpdate:
    from zeroconf import DNSAddress

    return zeroconf.RecordUpdate(DNSAddress(name, A, IN | UNIQUE, ttl, socket.inet_aton(ip)), None)


async def test_host_name_guard_probes_renames_and_is_not_flooded(monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    from gpusd.wire.responder import HostNameGuard

    monkeypatch.setenv("GPUSD_MDNS_FAST", "1")
    zc = FakeZc()
    conflicts: list[str] = []
    guard = HostNameGuard(zc, "node-1-00000000", ["198.18.0.2"], on_conflict=conflicts.append)  # type: ignore[arg-type]
    # probing: three probes, QU questions ANY and A, our address as authority without cache-flush bit
    assert await guard.probe() == "node-1-00000000.local." and len(zc.sent) == 3
    msg = dns.message.from_wire(zc.sent[0].packets()[0])
    assert [(q.rdtype, q.rdclass) for q in msg.question] == [(255, 0x8001), (A, 0x8001)]
    assert [(rr.rdtype, rr.rdclass, rr[0].address) for rr in msg.authority] == [(A, IN, "198.18.0.2")]
    # a taken name during probing: the next one
    task = asyncio.ensure_future(guard.probe(rename=False))
    await asyncio.sleep(0.05)
    guard.async_update_records(zc, 0, [foreign_a("node-1-00000000.local.")])  # type: ignore[arg-type]
    assert await task == "node-1-00000000-2.local."
    # after the announcement: our own records and goodbyes are no conflict; a flood of foreign
    # records for our name is reported once
    guard.async_update_records(zc, 0, [foreign_a("node-1-00000000-2.local.", "198.18.0.2")])  # type: ignore[arg-type]
    guard.async_update_records(zc, 0, [foreign_a("node-1-00000000-2.local.", ttl=0)])  # type: ignore[arg-type]
    guard.async_update_records(zc, 0, [foreign_a("other.local.")])  # type: ignore[arg-type]
    assert conflicts == []
    for _ in range(1000):
        guard.async_update_records(zc, 0, [foreign_a("node-1-00000000-2.local.")])  # type: ignore[arg-type]
    assert conflicts == ["node-1-00000000-2.local."]
    # the goodbye for a given-up name: our address, TTL 0, no cache-flush bit
    zc.sent.clear()
    guard.goodbye("node-1-00000000-2.local.")
    [rr] = dns.message.from_wire(zc.sent[0].packets()[0]).answer
    assert rr.ttl == 0 and rr.rdclass == IN and rr[0].address == "198.18.0.2"
    guard.close()
    assert zc.listeners == []
