"""The choice of a multi-GPU set (gpusd.alloc.placement): the tolerance, the link ranking, nvlink,
hosts without topology, and many GPUs (the greedy path)."""

from __future__ import annotations

import pytest

from gpusd.alloc.placement import MAX_SETS, TOL_MEMORY, TOL_UTIL
from gpusd.alloc.select import Constraints, choose, explain
from gpusd.errors import ConfigError, NoGpuAvailable
from gpusd.model import GpuInfo, GpuLink, HostSnapshot

GiB = 2**30


def _host(utils, nvlink_pairs=((0, 1), (2, 3)), mem=None, level=40, topology=True):
    n = len(utils)
    pairs = {frozenset(p) for p in nvlink_pairs}
    gpus = []
    for i, u in enumerate(utils):
        used = (mem[i] if mem else 0) * GiB
        links = [GpuLink(j, level, 4 if frozenset((i, j)) in pairs else 0) for j in range(n) if j != i]
        gpus.append(GpuInfo(i, f"GPU-{i}", memory_total=80 * GiB, memory_used=used, memory_free=80 * GiB - used,
                            utilization_gpu=float(u), links=links if topology else []))
    return HostSnapshot("h", "n", 0.0, gpus=gpus)


def _ids(snap, **kw):
    return [c.gpu.index for c in choose(snap, Constraints.build(**kw), leases=[], env={})]


def test_the_tolerance_in_utilisation_points():
    # least-loaded set (0, 2): busiest 3 %. The pair (2, 3) is in while GPU 3 <= 3 + 10 points.
    assert sorted(_ids(_host([1, 50, 3, 3 + TOL_UTIL]), count=2)) == [2, 3]
    assert sorted(_ids(_host([1, 50, 3, 3 + TOL_UTIL + 1]), count=2)) == [0, 2]


def test_the_tolerance_in_memory():
    utils = [1, 50, 3, 3]
    limit = int(TOL_MEMORY * 80)  # GiB above the least-loaded set's fullest (0 here)
    assert sorted(_ids(_host(utils, mem=[0, 0, 0, limit]), count=2)) == [2, 3]
    assert sorted(_ids(_host(utils, mem=[0, 0, 0, limit + 2]), count=2)) == [0, 2]


def test_a_better_pcie_level_wins_within_the_tolerance_too():
    snap = _host([0, 5, 1, 2], nvlink_pairs=())
    for g in snap.gpus:  # (1, 3) share a switch, the rest across sockets
        for link in g.links:
            link.level = 10 if {g.index, link.peer} == {1, 3} else 50
    assert sorted(_ids(snap, count=2)) == [1, 3]


def test_any_is_the_load_order_and_nvlink_requires_nvlink():
    snap = _host([1, 30, 3, 60])
    assert _ids(snap, count=2, topology="any") == [0, 2]
    assert sorted(_ids(snap, count=2, topology="nvlink")) == [0, 1]
    with pytest.raises(NoGpuAvailable, match="NVLink"):
        _ids(_host([1, 30, 3, 60], nvlink_pairs=()), count=2, topology="nvlink")
    with pytest.raises(ConfigError):
        Constraints.build(count=2, topology="ring")


def test_a_host_without_topology_gets_the_load_order():
    snap = _host([1, 30, 3, 5], topology=False)
    assert _ids(snap, count=2) == [0, 2]
    with pytest.raises(NoGpuAvailable, match="no topology"):
        _ids(snap, count=2, topology="nvlink")


def test_one_gpu_is_the_least_loaded_whatever_the_topology():
    assert _ids(_host([9, 30, 3, 60]), count=1) == [2]


def test_the_explanation_names_the_sets():
    why = explain(_host([1, 30, 3, 5]), Constraints.build(count=2), leases=[], env={})
    d = why.to_dict()
    assert d["chosen"] == ["2", "3"] and d["least_loaded"] == ["0", "2"] and d["sets_considered"] == 6
    assert any(a["gpus"] == ["0", "1"] and a["within_tolerance"] is False for a in d["alternatives"])


def test_many_gpus_take_the_greedy_path_and_still_find_the_nvlink_group():
    # 24 GPUs in three NVSwitch groups of 8; the idlest GPUs are spread over the groups, group 1 is idle
    # enough: C(24, 8) sets are too many to compare, each GPU seeds one.
    utils = [2 if i % 8 == 0 else 20 for i in range(24)]
    utils[8:16] = [5] * 8
    groups = [(a, b) for g in range(3) for a in range(8 * g, 8 * g + 8) for b in range(a + 1, 8 * g + 8)]
    snap = _host(utils, nvlink_pairs=groups, level=50)
    from math import comb

    assert comb(24, 8) > MAX_SETS
    assert sorted(_ids(snap, count=8)) == list(range(8, 16))


def test_launch_per_host_placement_follows_the_same_rule():
    """``launch``/``reserve --per-host``: each host's GPUs are chosen by the pool's ranking, which is
    local selection's (``rank_hosts``): an idle NVLink pair within the tolerance over the two idlest
    split GPUs, on every host; the host's snapshot came over the wire, links included."""
    from gpusd.discovery.types import RemoteHost, SignedIdentity
    from gpusd.pool.client import rank_hosts
    from gpusd.wire.txt import TxtRecord

    hosts = []
    for name, utils in (("node-a", [1, 30, 3, 5]), ("node-b", [1, 30, 3, 60])):
        snap = HostSnapshot.from_json(_host(utils).to_json())  # as a daemon serves it
        host = RemoteHost(key=name, txt=TxtRecord(node_id=name, hostname=name, session="default", count=4),
                          url="http://198.18.0.9:4780/api/v1", snapshot=snap, alive=True, verified=True)
        host.identity = SignedIdentity(name, name, ("198.18.0.9",))  # what the daemon signed
        hosts.append(host)
    ranked = rank_hosts(hosts, Constraints.build(count=2))
    chosen = {h.hostname: sorted(c.gpu.index for c in cands) for _, h, cands in ranked}
    assert chosen == {"node-a": [2, 3], "node-b": [0, 2]}
    ranked = rank_hosts(hosts, Constraints.build(count=2, topology="nvlink"))
    assert {h.hostname: sorted(c.gpu.index for c in cands) for _, h, cands in ranked} == {
        "node-a": [2, 3], "node-b": [0, 1]}


def test_the_lease_requests_carry_the_topology():
    """The lease socket's and the pool's requests say --topology; the daemon validates it."""
    from gpusd.alloc.authority import request
    from gpusd.daemon.leasereq import constraints

    req = request(Constraints.build(count=2, topology="nvlink"))
    assert req["topology"] == "nvlink"
    assert Constraints.build(**{k: v for k, v in constraints(req).items()
                                if k not in ("wait", "timeout", "command", "visible")}).topology == "nvlink"
    old = dict(req)
    del old["topology"]  # a 0.2 client
    assert constraints(old)["topology"] == "auto"
    for bad in (3, ["nvlink"]):
        with pytest.raises(ConfigError):
            constraints(dict(req, topology=bad))
    with pytest.raises(ConfigError):
        Constraints.build(count=2, topology=constraints(dict(req, topology="ring"))["topology"])


def test_the_greedy_path_keeps_the_least_loaded_set_when_no_grown_set_is_within_the_tolerance():
    # Three NVSwitch groups of 8: the 8 idle GPUs are spread over them, every other GPU is at 90 %.
    # Each set grown greedily stays inside one group (90 %: beyond the tolerance); the least-loaded
    # set is always within it, so it is chosen (it was a traceback: min() of no sets).
    idle = {0, 1, 2, 8, 9, 10, 16, 17}
    utils = [0 if i in idle else 90 for i in range(24)]
    groups = [(a, b) for g in range(3) for a in range(8 * g, 8 * g + 8) for b in range(a + 1, 8 * g + 8)]
    snap = _host(utils, nvlink_pairs=groups, level=50)
    from math import comb

    assert comb(24, 8) > MAX_SETS
    assert sorted(_ids(snap, count=8)) == sorted(idle)


def test_a_large_host_compares_each_pair_of_gpus_a_bounded_number_of_times(monkeypatch):
    # 128 GPUs (a scenario may have that many; a verified peer's snapshot too), 64 asked: the greedy
    # path must not look links up once per set and member (that took a minute of a daemon thread).
    import gpusd.alloc.placement as placement

    n = 128
    groups = [(a, b) for g in range(n // 8) for a in range(8 * g, 8 * g + 8) for b in range(a + 1, 8 * g + 8)]
    snap = _host([i % 7 for i in range(n)], nvlink_pairs=groups, level=50)
    calls = 0
    real = placement.link_between

    def counting(a, b):
        nonlocal calls
        calls += 1
        return real(a, b)

    monkeypatch.setattr(placement, "link_between", counting)
    assert len(_ids(snap, count=64)) == 64
    assert calls <= 2 * n * n
