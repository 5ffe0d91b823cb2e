"""The typed fleet view (gpusd.wire.fleet): what GET /api/v1/fleet serves and every reader decodes."""

from __future__ import annotations

import dataclasses
import json

import pytest

from gpusd.model import MAX_NAME
from gpusd.wire.fleet import FLEET_SCHEMA, MAX_FLEET_HOSTS, FleetView, HostRecord
from model_samples import _sample, _snapshot


def test_every_field_of_a_fleet_host_round_trips() -> None:
    host = _sample(HostRecord)
    assert isinstance(host, HostRecord)
    host.snapshot = _snapshot()  # a real snapshot (the sampler makes a minimal one)
    d = json.loads(json.dumps(host.to_dict(), allow_nan=False))
    assert {f.name for f in dataclasses.fields(HostRecord)} == set(d)
    assert HostRecord.from_dict(d) == host


def _answer(*hosts: object) -> dict[str, object]:
    return {"schema": FLEET_SCHEMA, "session": "s", "hosts": list(hosts)}


def _host(name: str, **kw: object) -> dict[str, object]:
    d: dict[str, object] = {"hostname": name, "node_id": f"id-{name}", "url": f"http://{name}:4780/api/v1",
                            "alive": True, "snapshot": _snapshot().to_dict()}
    d.update(kw)
    return d


def test_a_bad_host_is_skipped_and_counted_the_good_ones_kept() -> None:
    view = FleetView.from_dict(_answer(
        _host("good"),
        "junk",
        _host("long", hostname="h" * (MAX_NAME + 1)),
        _host("typed", alive="yes"),
        _host("nan", last_seen=float("nan")),
        {"hostname": "no-node-id"},
    ))
    assert [h.hostname for h in view.hosts] == ["good"]
    assert view.skipped == 5


def test_a_host_with_a_bad_snapshot_is_listed_without_one() -> None:
    bad = _snapshot().to_dict()
    bad["gpus"][0]["utilization_gpu"] = "high"
    view = FleetView.from_dict(_answer(_host("a", snapshot=bad)))
    assert view.hosts[0].hostname == "a" and view.hosts[0].snapshot is None


@pytest.mark.parametrize("answer, message", [
    ([], "object"),
    ({"session": "s"}, "hosts"),
    ({"hosts": {}}, "hosts"),
    ({"schema": 2, "hosts": []}, "schema"),
    ({"session": "s" * 1000, "hosts": []}, "session"),
    ({"hosts": [{}] * (MAX_FLEET_HOSTS + 1)}, "more than"),
])
def test_a_bad_envelope_is_refused(answer: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FleetView.from_dict(answer)


def test_a_0_1_answer_without_schema_still_reads() -> None:
    view = FleetView.from_dict({"session": "s", "hosts": [{"node_id": "1", "hostname": "a", "session": "s",
                                                           "source": "gpusd", "url": None, "alive": False,
                                                           "snapshot": None}]})
    assert view.hosts[0].alive is False and view.hosts[0].verified is None  # 0.1 sent no verified flag


def test_readers_use_the_model() -> None:
    from gpusd.errors import SourceError
    from gpusd.views.sd import daemons_from_fleet
    from gpusd.views.sources import hosts_from_fleet

    answer = _answer(_host("a"), _host("b", alive=False), _host("c", hostname=["c"]))
    assert [h.hostname for h in hosts_from_fleet(answer)] == ["a", "b"]
    assert [d.hostname for d in daemons_from_fleet(answer)] == ["a"]
    for reader in (hosts_from_fleet, daemons_from_fleet):
        with pytest.raises(SourceError, match="schema"):
            reader({"schema": 99, "hosts": []})
