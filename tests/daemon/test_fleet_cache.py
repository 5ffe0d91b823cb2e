"""GET /api/v1/fleet is assembled from bytes kept per host: a host's snapshot is encoded once (when it
comes, while answers are asked for), never once per answer; the answer is the document encoding afresh
gives, byte for byte, and redaction holds for the bytes kept."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from daemon_helpers import make_snapshot
from gpusd.daemon import fleet as fleet_mod
from gpusd.daemon.config import DaemonConfig
from gpusd.daemon.fleet import Fleet
from gpusd.discovery.types import RemoteHost
from gpusd.model import HostSnapshot, ProcessInfo
from gpusd.wire import fleet as wire_fleet
from gpusd.wire.fleet import FleetView
from gpusd.wire.txt import TxtRecord


class _Client:
    """What the fleet view reads of its discovery client."""

    def __init__(self, hosts: list[RemoteHost]) -> None:
        self.hosts = hosts
        self.dropped_hosts = 2

    def host_list(self, catch_up: bool = True) -> list[RemoteHost]:
        return sorted(self.hosts, key=lambda h: (h.hostname, h.node_id))


def _host(i: int, util: float = 10.0, user: str | None = None) -> RemoteHost:
    txt = TxtRecord(node_id=f"node{i:04d}", hostname=f"host-{i:04d}", session="s", count=2)
    h = RemoteHost(key=f"host-{i:04d}._gpusd._tcp.local.", txt=txt, url=f"http://198.18.0.{i % 250 + 1}:4780/api/v1",
                   snapshot=_snap(i, util, user), alive=True, verified=True, via="mdns")
    h.heard()
    return h


def _snap(i: int, util: float, user: str | None = None) -> HostSnapshot:
    snap = make_snapshot(2, hostname=f"host-{i:04d}", node_id=f"node{i:04d}", util=util)
    if user is not None:
        snap.gpus[0].processes = [ProcessInfo(pid=42, user=user, command="python train.py --secret")]
    return snap


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Each snapshot the fleet view encodes, by node."""
    calls: list[str] = []
    original = wire_fleet.snapshot_bytes

    def counting(snap: HostSnapshot) -> bytes:
        calls.append(snap.node_id)
        return original(snap)

    monkeypatch.setattr(wire_fleet, "snapshot_bytes", counting)
    return calls


def _fleet(hosts: list[RemoteHost]) -> Fleet:
    fleet = Fleet(DaemonConfig(session="s", interfaces=["127.0.0.1"], fleet="on", peers=[]), None)
    fleet.client = _Client(hosts)  # type: ignore[assignment]
    return fleet


def _afresh(hosts: list[RemoteHost]) -> bytes:
    view = FleetView(session="s", hosts=[h.record() for h in sorted(hosts, key=lambda h: h.hostname)],
                     hosts_dropped=2)
    return view.to_json()


def _util(body: bytes, i: int) -> float:
    [host] = [h for h in json.loads(body)["hosts"] if h["node_id"] == f"node{i:04d}"]
    return float(host["snapshot"]["gpus"][0]["utilization_gpu"])


def test_answers_encode_each_snapshot_once_not_once_per_answer(counted: list[str]) -> None:
    hosts = [_host(i) for i in range(100)]
    fleet = _fleet(hosts)
    first = fleet.answer()
    assert len(counted) == 100
    assert first == _afresh(hosts)
    for _ in range(5):
        for h in hosts:
            h.heard()  # heartbeats: the heads' times change, the snapshots do not
        counted.clear()
        again = fleet.answer()
        assert counted == []  # not one snapshot encoded again
        assert again == _afresh(hosts)


def test_a_new_snapshot_is_encoded_when_it_comes_and_the_answer_only_joins(counted: list[str]) -> None:
    hosts = [_host(i) for i in range(50)]
    fleet = _fleet(hosts)
    fleet.answer()
    counted.clear()
    for h in hosts[:10]:  # ten hosts sample anew (the discovery client calls on_snapshot)
        h.snapshot = _snap(int(h.node_id[4:]), 80.0)
        fleet._snapshot_came(h)
    assert len(counted) == 10  # on arrival: the answers were asked for a moment ago
    counted.clear()
    body = fleet.answer()
    assert counted == []
    assert body == _afresh(hosts)
    assert _util(body, 0) == 80.0 and _util(body, 20) == 10.0


def test_nobody_asking_no_snapshot_is_encoded_and_the_kept_bytes_go(counted: list[str],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    hosts = [_host(i) for i in range(20)]
    fleet = _fleet(hosts)
    fleet.answer()
    counted.clear()
    monkeypatch.setattr(fleet_mod, "WARM", 0.0)  # the last answer is too old now
    hosts[0].snapshot = _snap(0, 60.0)
    fleet._snapshot_came(hosts[0])
    assert counted == [] and fleet._kept[False] == {}
    body = fleet.answer()  # the next answer encodes what it needs
    assert len(counted) == 20
    assert _util(body, 0) == 60.0 and body == _afresh(hosts)


def test_kept_bytes_keep_each_reader_level_private_or_not(counted: list[str]) -> None:
    hosts = [_host(i, user="alice") for i in range(3)]
    fleet = _fleet(hosts)
    for _ in range(2):  # the first builds, the second is served from what is kept
        public = fleet.answer(redact=True).decode()
        own = fleet.answer(only_own="node0001", redact=True).decode()
        private = fleet.answer().decode()
        assert "alice" not in public and "--secret" not in public
        owners = [h["snapshot"]["gpus"][0]["processes"][0]["user"] for h in json.loads(own)["hosts"]]
        assert owners == [None, "alice", None]  # this host's own reader sees its own host's owners
        assert private.count("alice") == 3
    for h in hosts:  # new samples, encoded on arrival for both levels
        h.snapshot = _snap(int(h.node_id[4:]), 70.0, user="bob")
        fleet._snapshot_came(h)
    public = fleet.answer(redact=True).decode()
    assert "bob" not in public and '"utilization_gpu":70.0' in public
    assert fleet.answer().decode().count("bob") == 3
    assert json.loads(fleet.answer(only_own="node0002", redact=True))["hosts"][2]["snapshot"]["gpus"][0][
        "processes"][0]["user"] == "bob"


def test_a_host_that_goes_is_gone_from_the_answer_and_its_bytes_too() -> None:
    hosts = [_host(i) for i in range(5)]
    fleet = _fleet(hosts)
    fleet.answer()
    gone = hosts.pop(2)
    body = fleet.answer()
    assert gone.node_id.encode() not in body and body == _afresh(hosts)
    assert all(entry[0] is not gone for entry in fleet._kept[False].values())


def test_a_host_without_a_snapshot_yet_is_listed_with_none(counted: list[str]) -> None:
    hosts = [_host(i) for i in range(3)]
    hosts[1].snapshot = None
    fleet = _fleet(hosts)
    body: Any = json.loads(fleet.answer())
    assert [h["snapshot"] is None for h in body["hosts"]] == [False, True, False]


def test_a_new_stream_replays_messages_kept_per_host_with_the_time_of_now(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a new fleet stream starts with (host_added, device_added for every GPU) is kept formatted per
    host until the host changes; each replay writes only its ts anew."""
    from gpusd.discovery.types import DEVICE_ADDED, HOST_ADDED, DiscoveryEvent, Filters
    from gpusd.wire.sse import format_event

    hosts = [_host(i) for i in range(4)]
    fleet = _fleet(hosts)
    fleet.client.filters = Filters()  # type: ignore[union-attr]
    formatted: list[str] = []

    def counting(event: str, data: Any) -> bytes:
        formatted.append(event)
        return format_event(event, data)

    monkeypatch.setattr(fleet_mod, "format_event", counting)

    def documents(messages: list[bytes]) -> list[dict[str, Any]]:
        out = []
        for m in messages:
            event, data = m.decode().split("\n")[:2]
            out.append({"event": event.removeprefix("event: "), **json.loads(data.removeprefix("data: "))})
        return out

    def expected() -> list[dict[str, Any]]:  # formatted afresh, as before messages were kept
        out: list[bytes] = []
        for h in hosts:
            out.append(format_event(HOST_ADDED, DiscoveryEvent(HOST_ADDED, h).to_dict()))
            out += [format_event(DEVICE_ADDED, DiscoveryEvent(DEVICE_ADDED, h, device=d).to_dict())
                    for d in h.devices()]
        return [{k: v for k, v in d.items() if k != "ts"} for d in documents(out)]

    before = time.time()
    first = documents(fleet.replay())
    assert len(formatted) == 4 * 3  # a host_added and two device_added a host
    assert [{k: v for k, v in d.items() if k != "ts"} for d in first] == expected()
    formatted.clear()
    second = documents(fleet.replay())
    assert formatted == []  # nothing changed: nothing formatted again
    assert [{k: v for k, v in d.items() if k != "ts"} for d in second] == expected()
    assert all(d["ts"] >= before for d in first + second) and second[0]["ts"] >= first[0]["ts"]

    hosts[1].snapshot = _snap(1, 90.0)  # a host's new sample, and another's new proof
    hosts[2].verified = False
    third = documents(fleet.replay())
    assert len(formatted) == 2 * 3  # those two hosts' messages, the others' kept
    assert [{k: v for k, v in d.items() if k != "ts"} for d in third] == expected()
