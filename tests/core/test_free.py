"""What "free" means is defined once (GpuInfo.is_free) and every consumer agrees: the TXT count, the
`gpusd list` STATE column, `gpusd top`'s header and the wire (the dashboard counts the sent value)."""

from __future__ import annotations

import json

import pytest

from gpusd.model import FREE_UTIL, GpuInfo, HostSnapshot, LeaseInfo, ProcessInfo

GiB = 2**30


def gpu(i: int, **kw: object) -> GpuInfo:
    base: dict[str, object] = dict(index=i, uuid=f"GPU-{i}", name="NVIDIA A100", memory_total=80 * GiB,
                                   memory_used=0, memory_free=80 * GiB, utilization_gpu=0.0)
    base.update(kw)
    return GpuInfo(**base)  # type: ignore[arg-type]


CASES = [
    (gpu(0), True),
    (gpu(1, utilization_gpu=None), False),  # no reading: gpusd cannot tell, so not free
    (gpu(2, utilization_gpu=FREE_UTIL - 0.1), True),
    (gpu(3, utilization_gpu=FREE_UTIL), False),
    (gpu(4, processes=[ProcessInfo(pid=7)]), False),
    (gpu(5, leases=[LeaseInfo(lease_id="x", pid=7)]), False),
    (gpu(6, healthy=False, error="GPU is lost"), False),
    (gpu(7, utilization_gpu=float("nan")), False),
]


@pytest.mark.parametrize("g, free", CASES, ids=[str(g.index) for g, _ in CASES])
def test_the_rule(g: GpuInfo, free: bool) -> None:
    assert g.is_free is free
    assert g.to_dict()["free"] is free  # sent on the wire


def _snap() -> HostSnapshot:
    return HostSnapshot(hostname="h", node_id="n", timestamp=1.0, gpus=[g for g, _ in CASES])


def test_txt_counts_by_the_rule() -> None:
    from gpusd.wire.txt import count_free

    assert count_free(_snap()) == sum(free for _, free in CASES) == 2


def test_top_header_counts_by_the_rule() -> None:
    from gpusd.views.top import HostView, _host_header

    text = _host_header(HostView("h", "n", _snap()), _snap().gpus, now=1.0, width=40).plain
    assert "8 GPUs, 2 free" in text


def test_list_state_follows_the_rule() -> None:
    from gpusd.cli.discover import render_devices
    from gpusd.discovery.types import Device

    devices = [Device(hostname="h", node_id="n", session="default", gpu=g) for g, _ in CASES]
    table = render_devices(devices, [])
    lines = table.splitlines()
    col = lines[0].index("STATE")
    states = [line[col:].strip() for line in lines[2:2 + len(CASES)]]
    shown_free = [s == "free" for s in states]
    assert shown_free == [free for _, free in CASES]
    assert "no reading" in table  # the GPU without a utilisation reading says why it is not free


def test_the_rule_survives_the_wire() -> None:
    again = HostSnapshot.from_json(_snap().to_json())
    assert [g.is_free for g in again.gpus] == [free for _, free in CASES]
    assert [g["free"] for g in json.loads(_snap().to_json())["gpus"]] == [free for _, free in CASES]
