"""Topology in the inventory: the fake NVML's topology calls as pynvml sees them, the NVML
backend's links, NUMA nodes and local CPUs, the simulator's defaults and scenario files, and the wire."""

from __future__ import annotations

import json

import pytest

from fakenvml import make_gpus, nvlink_pairs
from gpusd.errors import ConfigError, WireError
from gpusd.model import GpuInfo, GpuLink, HostSnapshot
from gpusd.topology import format_cpulist, label, link_between, parse_cpulist


def _pairs_box(n: int = 4):
    """n GPUs: NVLink pairs (0,1), (2,3)...; pairs share a PCIe switch; halves on two NUMA nodes."""
    gpus = make_gpus(n)
    for i, g in enumerate(gpus):
        g.numa_node, g.pcie_switch, g.host_bridge = i // (n // 2), i // 2, i // 2
        g.cpu_affinity = "0" if i < n // 2 else "1"
    nvlink_pairs(gpus, [(i, i + 1) for i in range(0, n, 2)], links=4)
    return gpus


def test_the_fake_answers_the_topology_calls_as_nvml_does(fake_nvml_inprocess):
    import pynvml

    gpus = _pairs_box()
    gpus[3].topology = {2: 20}  # an explicit level: PXB
    fake_nvml_inprocess.write(gpus)
    pynvml.nvmlInit()
    try:
        h = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(4)]
        assert pynvml.nvmlDeviceGetTopologyCommonAncestor(h[0], h[1]) == pynvml.NVML_TOPOLOGY_SINGLE
        assert pynvml.nvmlDeviceGetTopologyCommonAncestor(h[0], h[2]) == pynvml.NVML_TOPOLOGY_SYSTEM
        assert pynvml.nvmlDeviceGetTopologyCommonAncestor(h[2], h[3]) == pynvml.NVML_TOPOLOGY_MULTIPLE
        nv = pynvml.NVML_P2P_CAPS_INDEX_NVLINK
        assert pynvml.nvmlDeviceGetP2PStatus(h[0], h[1], nv) == pynvml.NVML_P2P_STATUS_OK
        assert pynvml.nvmlDeviceGetP2PStatus(h[0], h[2], nv) != pynvml.NVML_P2P_STATUS_OK
        assert [pynvml.nvmlDeviceGetNvLinkState(h[0], k) for k in range(6)] == [1, 1, 1, 1, 0, 0]
        bus = pynvml.nvmlDeviceGetNvLinkRemotePciInfo(h[0], 0).busId
        assert (bus.decode() if isinstance(bus, bytes) else bus) == gpus[1].pci_bus_id
        with pytest.raises(pynvml.NVMLError):
            pynvml.nvmlDeviceGetNvLinkState(h[0], 18)  # past the GPU's links
        assert list(pynvml.nvmlDeviceGetCpuAffinity(h[2], 1)) == [0b10]
        assert pynvml.nvmlDeviceGetNumaNodeId(h[3]) == 1
    finally:
        pynvml.nvmlShutdown()


def test_a_gpu_without_topology_lines_answers_not_supported(fake_nvml_inprocess):
    import pynvml

    fake_nvml_inprocess.write(make_gpus(2))
    pynvml.nvmlInit()
    try:
        h = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(2)]
        for call in (lambda: pynvml.nvmlDeviceGetTopologyCommonAncestor(h[0], h[1]),
                     lambda: pynvml.nvmlDeviceGetNvLinkState(h[0], 0),
                     lambda: pynvml.nvmlDeviceGetCpuAffinity(h[0], 1),
                     lambda: pynvml.nvmlDeviceGetNumaNodeId(h[0])):
            with pytest.raises(pynvml.NVMLError_NotSupported):
                call()
    finally:
        pynvml.nvmlShutdown()


def test_the_nvml_backend_reads_links_numa_nodes_and_local_cpus(fake_nvml_inprocess):
    from gpusd.inventory.nvml import NvmlBackend

    fake_nvml_inprocess.write(_pairs_box())
    with NvmlBackend(processes=False) as backend:
        snap = backend.snapshot(detail=False)  # what selection reads has the topology too
    g = snap.gpus
    assert [x.numa_node for x in g] == [0, 0, 1, 1]
    assert [x.local_cpus for x in g] == ["0", "0", "1", "1"]
    assert label(link_between(g[0], g[1])) == "NV4" and label(link_between(g[2], g[3])) == "NV4"
    assert label(link_between(g[0], g[2])) == "SYS" and link_between(g[0], g[2]).nvlink == 0
    assert not g[0].links  # the pairs travel as each GPU's topology (linear in the GPUs)
    assert [(x.peer, x.level, x.nvlink) for x in (link_between(g[0], h) for h in g[1:]) if x] == [
        (1, 10, 4), (2, 50, 0), (3, 50, 0)]


def test_gpus_on_an_nvswitch_are_all_nvlinked(fake_nvml_inprocess):
    from gpusd.inventory.nvml import NvmlBackend

    gpus = make_gpus(3)
    for g in gpus[:2]:
        g.nvlinks = [("00000000:F0:00.0", 6), ("00000000:F1:00.0", 6)]  # two NVSwitches, 12 links
        g.numa_node = 0
    gpus[2].numa_node = 0
    fake_nvml_inprocess.write(gpus)
    with NvmlBackend(processes=False) as backend:
        g = backend.snapshot().gpus
    assert label(link_between(g[0], g[1])) == "NV12"
    assert label(link_between(g[0], g[2])) == "NODE"


def test_a_host_without_topology_has_no_links(fake_nvml_inprocess):
    from gpusd.inventory.nvml import NvmlBackend

    fake_nvml_inprocess.write(make_gpus(2))
    with NvmlBackend(processes=False) as backend:
        g = backend.snapshot().gpus
    assert g[0].links == [] and g[0].numa_node is None and g[0].local_cpus is None
    assert label(link_between(g[0], g[1])) == "N/A"


def test_the_simulator_builds_the_usual_boxes():
    from gpusd.inventory.simulated import SimulatedBackend

    h100 = SimulatedBackend("8xH100-80GB").snapshot().gpus
    assert all(label(link_between(a, b)) == "NV18" for a in h100 for b in h100 if a is not b)
    assert [g.numa_node for g in h100] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert h100[5].local_cpus == "32-63"
    a6000 = SimulatedBackend("4xA6000").snapshot().gpus
    assert [label(link_between(a6000[0], g)) for g in a6000[1:]] == ["NV4", "SYS", "SYS"]
    l40s = SimulatedBackend("4xL40S").snapshot().gpus
    assert [label(link_between(l40s[0], g)) for g in l40s[1:]] == ["PIX", "SYS", "SYS"]


def test_a_scenario_describes_its_topology(tmp_path):
    from gpusd.inventory.simulated import SimulatedBackend

    path = tmp_path / "box.json"
    path.write_text(json.dumps({"gpus": [{"model": "H100-80GB"}] * 4, "topology": {
        "preset": "pcie", "nvlink": [[0, 2, 6]], "numa": [0, 0, 0, 1], "cpus": ["0-1", "0-1", "0", "1"]}}))
    g = SimulatedBackend(str(path)).snapshot().gpus
    assert label(link_between(g[0], g[2])) == "NV6"
    assert label(link_between(g[0], g[1])) == "PIX" and label(link_between(g[1], g[2])) == "NODE"
    assert label(link_between(g[2], g[3])) == "SYS"
    assert [x.local_cpus for x in g] == ["0-1", "0-1", "0", "1"]
    path.write_text(json.dumps({"gpus": [{"model": "T4"}] * 2, "topology": "pairs"}))
    g = SimulatedBackend(str(path)).snapshot().gpus
    assert label(link_between(g[0], g[1])) == "NV4"


@pytest.mark.parametrize("topology", ["mesh", {"nvlink": [[0, 0, 4]]}, {"nvlink": [[0, 5, 4]]},
                                      {"numa": [0]}, {"cpus": ["0-", "1"]}, {"preset": 3},
                                      {"cpus": [",".join(map(str, range(0, 400, 2))), "1"]}])  # too long for the wire
def test_a_bad_scenario_topology_is_one_clear_error(tmp_path, topology):
    from gpusd.inventory.simulated import SimulatedBackend

    path = tmp_path / "box.json"
    path.write_text(json.dumps({"gpus": [{"model": "A100-80GB"}] * 2, "topology": topology}))
    with pytest.raises(ConfigError, match="topology"):
        SimulatedBackend(str(path))


def test_links_go_on_the_wire_and_come_back():
    snap = HostSnapshot("h", "n", 1.0, gpus=[
        GpuInfo(0, "GPU-a", numa_node=0, local_cpus="0-3", links=[GpuLink(1, 10, 4)]),
        GpuInfo(1, "GPU-b", numa_node=1, links=[GpuLink(0, 10, 4)])])
    back = HostSnapshot.from_json(snap.to_json())
    assert back.gpus[0].links == [GpuLink(1, 10, 4)] and back.gpus[0].local_cpus == "0-3"
    assert back.schema == 1  # additive: an older reader ignores the new keys
    old = json.loads(snap.to_json())
    for g in old["gpus"]:
        del g["links"], g["numa_node"], g["local_cpus"]
    assert HostSnapshot.from_dict(old).gpus[0].links == []  # a 0.2 daemon's snapshot still reads


@pytest.mark.parametrize("bad", [{"peer": "1"}, {"peer": 1, "nvlink": True}, {"peer": 1, "level": 1.5}, []])
def test_a_malformed_link_from_the_network_is_refused(bad):
    d = HostSnapshot("h", "n", 1.0, gpus=[GpuInfo(0, "GPU-a")]).to_dict()
    d["gpus"][0]["links"] = [bad]
    with pytest.raises(WireError):
        HostSnapshot.from_dict(d)


def test_cpu_lists():
    assert parse_cpulist("0-3,8,10-11") == {0, 1, 2, 3, 8, 10, 11}
    assert format_cpulist({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11"
    for bad in ("a", "3-1", "1,,2", "-1", "0-99999999"):
        with pytest.raises(ValueError):
            parse_cpulist(bad)


def test_topology_calls_that_fail_leave_the_rest_of_the_snapshot(fake_nvml_inprocess):
    """A driver that fails the topology calls (or a GPU that is lost) costs the links, not the snapshot."""
    from gpusd.inventory.nvml import NvmlBackend

    gpus = _pairs_box()
    gpus[0].errors = {"nvmlDeviceGetTopologyCommonAncestor": 999, "nvmlDeviceGetNvLinkState": 15,
                      "nvmlDeviceGetCpuAffinity": 999}
    gpus[3].errors = {"*": 15}
    fake_nvml_inprocess.write(gpus)
    with NvmlBackend(processes=False) as backend:
        g = backend.snapshot().gpus
    assert [x.healthy for x in g] == [True, True, True, False]
    assert g[0].local_cpus is None and g[0].numa_node == 0
    assert link_between(g[0], g[1]).nvlink == 4  # GPU 1 still reports its NVLinks to GPU 0
    assert g[0].links == []  # it could tell nothing itself
    assert label(link_between(g[1], g[2])) == "SYS"
    assert link_between(g[2], g[3]) is None  # the lost GPU answers nothing, not even its PCI address


def test_a_cpu_list_too_long_for_the_wire_is_unknown_never_cut(fake_nvml_inprocess):
    """A GPU local to every other CPU (a BIOS that numbers the sockets' CPUs alternately: 0,2,4,...)
    has a CPU list longer than a wire string may be. Cut at 256 characters it named CPUs that are not
    local (``...,25`` for ``...,250``) and lost the rest, and ``run --bind-cpus`` bound the job there."""
    from gpusd.inventory.nvml import NvmlBackend

    gpus = _pairs_box()
    gpus[0].cpu_affinity = ",".join(str(c) for c in range(0, 400, 2))
    fake_nvml_inprocess.write(gpus)
    with NvmlBackend(processes=False) as backend:
        g = backend.snapshot(detail=False).gpus
    assert g[0].local_cpus is None or parse_cpulist(g[0].local_cpus) == frozenset(range(0, 400, 2))
    assert g[1].local_cpus == "0"
    HostSnapshot.from_json(HostSnapshot("h", "n", 0.0, gpus=g).to_json())  # still goes on the wire


def test_the_daemons_nvml_reads_topology_and_telemetry_of_the_same_gpus(fake_nvml_inprocess) -> None:
    """Issue 22's topology and issue 25's telemetry side by side: one NVML backend opened as the daemon
    opens it (telemetry) reads the NUMA node, local CPUs and NVLinks and the energy, clocks and XIDs."""
    from gpusd.inventory.nvml import NvmlBackend

    gpus = make_gpus(2, energy=5_000_000, clock_sm=1395, numa_node=1, cpu_affinity="0-3")
    gpus[0].nvlinks = [(str(gpus[1].pci_bus_id), 4)]
    gpus[1].nvlinks = [(str(gpus[0].pci_bus_id), 4)]
    fake_nvml_inprocess.write(gpus)
    b = NvmlBackend(telemetry=True)
    try:
        snap = b.snapshot()
    finally:
        b.close()
    for g in snap.gpus:
        other = snap.gpus[1 - g.index]
        assert (g.numa_node, g.local_cpus, link_between(g, other).nvlink) == (1, "0-3", 4)
        assert g.energy is not None and g.energy >= 5_000_000 and g.clock_sm == 1395 and g.xid_errors == 0


def _tree_host(n: int, fabric: bool) -> list:
    """``n`` GPUs: two NUMA nodes, host bridges of 4, switches of 2; NVSwitch-connected (18 links each)
    or NVLink-bridged in pairs.  Their links as a daemon before 0.4 sent them, a link per pair."""
    from gpusd.model import GpuInfo, GpuLink
    from gpusd.topology import HOSTBRIDGE, NODE, SINGLE, SYSTEM

    def level(a: int, b: int) -> int:
        if a // 2 == b // 2:
            return SINGLE
        if a // 4 == b // 4:
            return HOSTBRIDGE
        return NODE if a * 2 // n == b * 2 // n else SYSTEM

    def nvlink(a: int, b: int) -> int:
        return 18 if fabric else (4 if a // 2 == b // 2 else 0)

    return [GpuInfo(index=a, uuid=f"GPU-{a}", links=[GpuLink(peer=b, level=level(a, b), nvlink=nvlink(a, b))
                                                     for b in range(n) if b != a]) for a in range(n)]


@pytest.mark.parametrize("fabric", [False, True])
def test_the_compact_topology_says_what_every_pair_said(fabric: bool) -> None:
    import copy
    import json

    from gpusd.model import GpuInfo
    from gpusd.topology import compact

    for n in (8, 64):
        pairs = _tree_host(n, fabric)
        compacted = copy.deepcopy(pairs)
        compact(compacted)
        travelled = [GpuInfo.from_dict(json.loads(json.dumps(g.to_dict()))) for g in compacted]
        assert all(not g.links and g.topology is not None for g in travelled)
        for a in range(n):
            for b in range(n):
                if a != b:
                    want, got = link_between(pairs[a], pairs[b]), link_between(travelled[a], travelled[b])
                    assert (want.level, want.nvlink) == (got.level, got.nvlink), (a, b)
    sizes = {n: sum(len(json.dumps(g.to_dict())) for g in _compacted(n, fabric)) for n in (8, 64)}
    assert sizes[64] <= 10 * sizes[8], sizes


def _compacted(n: int, fabric: bool) -> list:
    from gpusd.topology import compact

    gpus = _tree_host(n, fabric)
    compact(gpus)
    return gpus


def test_a_topology_of_a_later_form_is_unknown_never_misread() -> None:
    gpus = _compacted(8, False)
    gpus[1].topology.version = 3
    assert link_between(gpus[0], gpus[1]) is None
    assert label(link_between(gpus[0], gpus[2])) == "PHB"
