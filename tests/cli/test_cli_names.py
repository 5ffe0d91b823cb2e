"""One display rule for a GPU's name, the same in every table, and --model/--filter globs that match
what the tables show (and the full NVML name)."""

from __future__ import annotations

import pytest

from gpusd.discovery.types import Device, Filters
from gpusd.model import GpuInfo, display_name, name_matches
from gpusd.views.top import HostView, TopState, arrange, render_text
from monitor_fakes import sim_host

NAMES = ["NVIDIA A100-SXM4-80GB", "NVIDIA GeForce RTX 4090", "Tesla T4", "NVIDIA H100 80GB HBM3", "NVIDIA RTX A6000"]
SHOWN = ["A100-SXM4-80GB", "RTX 4090", "T4", "H100 80GB HBM3", "RTX A6000"]


def test_display_name() -> None:
    assert [display_name(n) for n in NAMES] == SHOWN
    assert display_name(None) == display_name("") == "-"
    assert display_name("A100-SXM4-80GB") == "A100-SXM4-80GB"  # idempotent: TXT names are already short


@pytest.mark.parametrize("pattern, expected", [
    ("A100*", ["A100-SXM4-80GB"]),  # as shown: this matched nothing before
    ("a100*", ["A100-SXM4-80GB"]),
    ("NVIDIA A100*", ["A100-SXM4-80GB"]),  # in full
    ("nvidia*", ["A100-SXM4-80GB", "RTX 4090", "H100 80GB HBM3", "RTX A6000"]),
    ("RTX*", ["RTX 4090", "RTX A6000"]),
    ("*80GB*", ["A100-SXM4-80GB", "H100 80GB HBM3"]),
    ("t4", ["T4"]),  # substring
    ("geforce", ["RTX 4090"]),  # a substring of the full name
])
def test_model_filter_matches_what_is_shown_and_the_full_name(pattern: str, expected: list[str]) -> None:
    assert [display_name(n) for n in NAMES if name_matches(n, pattern)] == expected
    f = Filters(model=pattern)
    assert [display_name(n) for n in NAMES if f.device_ok(GpuInfo(index=0, uuid="GPU-x", name=n))] == expected


def fleet() -> list[HostView]:
    a = sim_host("node-a", "2xA100-80GB")
    b = sim_host("node-b", "1xH100-80GB,1xRTX4090,1xT4")
    return [HostView(s.hostname, s.node_id, s) for s in (a, b)]


def test_top_filter_glob_matches_what_is_shown() -> None:
    shown = [(h.hostname, g.index) for h, gs in arrange(fleet(), TopState(filter="A100*")) for g in gs]
    assert shown == [("node-a", 0), ("node-a", 1)]
    shown = [(h.hostname, g.index) for h, gs in arrange(fleet(), TopState(filter="rtx* node-b")) for g in gs]
    assert shown == [("node-b", 1)]


def _devices_table(snap) -> str:  # type: ignore[no-untyped-def]
    from gpusd.cli.table import render_host

    return render_host(snap)


def _list_table(snap) -> str:  # type: ignore[no-untyped-def]
    from gpusd.cli.discover import render_devices

    devs = [Device(hostname=snap.hostname, node_id=snap.node_id, session="s", gpu=g, url=None, source="gpusd",
                   live=True, simulated=True, host_key="k") for g in snap.gpus]
    return render_devices(devs, [])


def _watch_lines(snap) -> str:  # type: ignore[no-untyped-def]
    return "\n".join(str(Device(hostname=snap.hostname, node_id=snap.node_id, session="s", gpu=g, url=None,
                                source="gpusd", live=True, simulated=True, host_key="k")) for g in snap.gpus)


def _top_frame(snap) -> str:  # type: ignore[no-untyped-def]
    return render_text([HostView(snap.hostname, snap.node_id, snap)], TopState(), width=200)


@pytest.mark.parametrize("render", [_devices_table, _list_table, _watch_lines, _top_frame])
def test_every_table_shows_the_same_names(render) -> None:  # type: ignore[no-untyped-def]
    snap = sim_host("node-b", "1xA100-80GB,1xRTX4090,1xT4")
    text = render(snap)
    for shown in ("A100-SXM4-80GB", "RTX 4090", "T4"):
        assert shown in text
    assert "NVIDIA" not in text and "GeForce" not in text and "Tesla" not in text


def test_scan_inventory_uses_the_same_rule() -> None:
    from gpusd.cli.discover import _inventory

    assert _inventory([("GeForce RTX 4090", 24576), ("GeForce RTX 4090", 24576), ("A100-SXM4-80GB", None)]) == \
        "2x RTX 4090 (24.0GiB), 1x A100-SXM4-80GB"
