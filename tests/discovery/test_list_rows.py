"""``gpusd list --json`` from a daemon's fleet view writes its devices straight from the answer's JSON
(:func:`gpusd.discovery.fleetview.fleet_rows`): the output must be byte for byte what the model path
(:func:`~gpusd.discovery.fleetview.parse_fleet`, then ``Device.to_dict``) prints, on a varied fleet and on
hostile records alike, and a plain answer must build no GPU object on the way."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from gpusd import model
from gpusd.cli.discover import json_list
from gpusd.discovery.fleetview import QUICK, LocalFleetView, Reading, fleet_rows, parse_fleet
from gpusd.discovery.types import Filters
from gpusd.inventory.simulated import SimulatedBackend
from gpusd.model import (
    BookingInfo,
    GpuInfo,
    GpuTopology,
    LeaseInfo,
    MigInstance,
    ProcessInfo,
)

OWN = "own0000000000000"
SESSION = "lab"
GiB = 2**30


def _host(i: int, spec: str, session: str = SESSION) -> dict[str, Any]:
    node = OWN if i == 0 else f"node{i:012d}"
    with SimulatedBackend(spec, host=f"gpu-{i % 3}", node=node) as backend:  # names repeat: the sort's ties
        snap = backend.snapshot()
    g0 = snap.gpus[0]
    if i % 2:
        g0.processes = [ProcessInfo(pid=100 + i, used_memory=3 * GiB, user="alice", command="python train.py",
                                    container="c1", container_owner="bob")]
        g0.leases = [LeaseInfo(lease_id=f"l{i}", pid=100 + i, user="alice", memory=40 * GiB, command="note")]
    if i % 3 == 1 and len(snap.gpus) > 1:
        snap.gpus[1].mig_mode = True
        snap.gpus[1].mig_instances = [MigInstance(index=0, uuid=f"MIG-{i}", profile="1g.10gb",
                                                  memory_total=10 * GiB, memory_used=GiB)]
        snap.gpus[1].healthy = False
        snap.gpus[1].error = "Xid 79 \x1b[31mfallen off the bus"
    if i % 4 == 2:
        snap.bookings = [BookingInfo(booking_id="b1", start=1.0e9, end=4.0e9, indices=[0], user="carol")]
        g0.topology = GpuTopology(pcie=[0, 0, 0, 0, 0])
        g0.name = "NVIDIA \u202eevil\x07 name"
    return {"hostname": snap.hostname, "node_id": node, "session": session, "source": "gpusd",
            "url": f"http://198.18.0.{i + 1}:4780/api/v1", "alive": True, "last_seen": 1.7e9 + i,
            "verified": None, "via": "mdns" if i % 2 else "peer", "snapshot": snap.to_dict()}


def fleet() -> dict[str, Any]:
    """A varied answer, as the daemon sends it (through JSON): NVIDIA, AMD and Intel hosts, processes,
    leases, MIG, an unhealthy GPU, bookings, hosts of another session and repeated names."""
    specs = ["2xH100-80GB", "1xMI300X,1xA100-80GB", "2xA100-80GB", "1xMax1550", "3xH100-80GB", "1xRTX4090"]
    hosts = [_host(i, specs[i % len(specs)]) for i in range(8)]
    hosts.append(_host(8, "1xA100-80GB", session="other"))
    return json.loads(json.dumps({"schema": 1, "session": SESSION, "hosts": hosts, "hosts_dropped": 0}))


def both(data: Any, filters: Filters, own: str = OWN, private: bool = False) -> tuple[Any, Any]:
    """(the new path's output and host count, the model path's), or None for a path that gives none."""
    fast = fleet_rows(copy.deepcopy(data), filters, own, private)
    slow = parse_fleet(copy.deepcopy(data), filters, own, private)
    return ((json_list(fast[0]), fast[1]) if fast is not None else None,
            (json_list([d.to_dict() for d in slow.devices]), len(slow.hosts)) if slow is not None else None)


FILTERS = [
    Filters(session=SESSION),
    Filters(session=None),
    Filters(session=SESSION, hostname="GPU-1*"),
    Filters(session=SESSION, model="h100"),
    Filters(session=SESSION, model="*MI300*"),
    Filters(session=SESSION, min_free_memory=60 * GiB),  # a lease's reserved memory counts
    Filters(session="nobody"),
]


@pytest.mark.parametrize("filters", FILTERS, ids=lambda f: repr(f))
@pytest.mark.parametrize("private", [False, True])
def test_rows_are_the_model_paths_output_byte_for_byte(filters: Filters, private: bool) -> None:
    fast, slow = both(fleet(), filters, private=private)
    assert fast is not None
    assert fast == slow


def test_other_hosts_private_fields_are_hidden_without_the_secret() -> None:
    rows = fleet_rows(fleet(), Filters(session=SESSION), OWN, private=False)
    assert rows is not None
    procs = {(r["node_id"] == OWN, p.get("user"), "container_owner" in p)
             for r in rows[0] for p in r["gpu"]["processes"]}
    assert procs == {(False, None, False)}  # the own host (node 0) runs none; the others' are blank
    shown = fleet_rows(fleet(), Filters(session=SESSION), OWN, private=True)
    assert shown is not None
    assert {p["user"] for r in shown[0] for p in r["gpu"]["processes"]} == {"alice"}


def test_a_plain_answer_builds_no_gpu_object(monkeypatch: pytest.MonkeyPatch) -> None:
    data = fleet()
    built: list[Any] = []
    real = GpuInfo.__init__

    def counting(self: GpuInfo, *args: Any, **kwargs: Any) -> None:
        built.append(self)
        real(self, *args, **kwargs)

    monkeypatch.setattr(GpuInfo, "__init__", counting)
    rows = fleet_rows(data, Filters(session=SESSION), OWN, private=False)
    assert rows is not None and len(rows[0]) == 15
    assert built == []
    parse_fleet(data, Filters(session=SESSION), OWN, private=False)
    assert len(built) == 16  # the count does see the model path's objects (the other session's too)


def _set(data: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    obj: Any = data
    for step in path[:-1]:
        obj = obj[step]
    if value is _DELETE:
        del obj[path[-1]]
    else:
        obj[path[-1]] = value


_DELETE = object()
H1 = ("hosts", 1)
G = (*H1, "snapshot", "gpus", 0)
HOSTILE: list[tuple[str, tuple[Any, ...], Any]] = [
    ("index a string", (*G, "index"), "0"),
    ("index a bool", (*G, "index"), True),
    ("index beyond 64 bits", (*G, "index"), 2**70),
    ("utilisation an int", (*G, "utilization_gpu"), 5),
    ("utilisation a string", (*G, "utilization_gpu"), "5"),
    ("memory a float", (*G, "memory_total"), 1.5e10),
    ("healthy null", (*G, "healthy"), None),
    ("healthy an int", (*G, "healthy"), 1),
    ("vendor missing (an older daemon)", (*G, "vendor"), _DELETE),
    ("leases missing", (*G, "leases"), _DELETE),
    ("a huge name", (*G, "name"), "N" * 100_000),
    ("a name of control bytes", (*G, "name"), "\x1b]0;pwned\x07\x00\x9b2J\u202e"),
    ("a long error, at its bound", (*G, "error"), "e" * model.MAX_TEXT),
    ("a long error, beyond", (*G, "error"), "e" * (model.MAX_TEXT + 1)),
    ("the GPU not an object", G, [1, 2]),
    ("gpus not a list", (*H1, "snapshot", "gpus"), {"0": {}}),
    ("gpus null", (*H1, "snapshot", "gpus"), None),
    ("too many GPUs", (*H1, "snapshot", "gpus"), [{"index": 0, "uuid": "x"}] * 257),
    ("a process pid a string", (*G, "processes"), [{"pid": "1"}]),
    ("a process with control bytes", (*G, "processes"), [{"pid": 1, "user": "\x1b[2Jroot", "command": "\x00rm"}]),
    ("a process's owner a number", (*G, "processes"), [{"pid": 1, "container_owner": 5}]),
    ("a lease without an id", (*G, "leases"), [{"pid": 1}]),
    ("a topology not an object", (*G, "topology"), "flat"),
    ("a topology with too many groups", (*G, "topology"), {"pcie": [0] * 6}),
    ("MIG entries not objects", (*G, "mig_instances"), ["x"]),
    ("an unknown key", (*G, "quantum"), {"qubits": 9}),
    ("a telemetry field null", (*G, "clock_sm"), None),
    ("a telemetry field a bool", (*G, "clock_sm"), False),
    ("gfx busy with an int", (*G, "gfx_busy_xcc"), [1, 2.0]),
    ("uuid a number", (*G, "uuid"), 7),
    ("a duplicate uuid", (*H1, "snapshot", "gpus", 1, "uuid"), None),
    ("snapshot schema 2", (*H1, "snapshot", "schema"), 2),
    ("simulated a string", (*H1, "snapshot", "simulated"), "yes"),
    ("simulated without a backend", (*H1, "snapshot", "backend"), _DELETE),
    ("a booking's user a list", (*H1, "snapshot", "bookings"), [{"booking_id": "b", "start": 1.0, "end": 2.0,
                                                                 "user": ["x"]}]),
    ("a snapshot's node id too long", (*H1, "snapshot", "node_id"), "n" * 300),
    ("the snapshot null", (*H1, "snapshot"), None),
    ("the snapshot a list", (*H1, "snapshot"), []),
    ("an hwsd host", (*H1, "source"), "hwsd"),
    ("no session", (*H1, "session"), None),
    ("a host name with a newline", (*H1, "hostname"), "gpu\n-1"),
    ("a host name too long", (*H1, "hostname"), "h" * 257),
    ("a URL a number", (*H1, "url"), 80),
    ("last seen a string", (*H1, "last_seen"), "now"),
    ("via missing", (*H1, "via"), _DELETE),
    ("the host not an object", H1, "gpu-1"),
    ("no hosts", ("hosts",), []),
    ("hosts not a list", ("hosts",), {}),
    ("fleet schema 2", ("schema",), 2),
]


@pytest.mark.parametrize("path,value", [(p, v) for _, p, v in HOSTILE], ids=[name for name, _, _ in HOSTILE])
@pytest.mark.parametrize("private", [False, True])
def test_hostile_records_give_what_the_model_path_gives(path: tuple[Any, ...], value: Any, private: bool) -> None:
    data = fleet()
    if value is None and path[-1] == "uuid":
        value = data["hosts"][1]["snapshot"]["gpus"][0]["uuid"]  # the duplicate: the first one's
    _set(data, path, value)
    fast, slow = both(data, Filters(session=SESSION), private=private)
    assert fast == slow


def test_a_daemon_that_does_not_answer_is_waited_for_once() -> None:
    """``list --json`` asks whether the daemon answered, then the listing asks again: the second
    question must not wait a second time before browsing."""
    waits: list[float | None] = []

    class Silent(Reading):
        def wait(self, timeout: float | None = None) -> bool:
            waits.append(timeout)
            return False

    reading = Silent(LocalFleetView(lambda: None, Filters(session=SESSION)))
    assert reading.arrived() is False and reading.arrived() is False
    assert waits == [QUICK]
