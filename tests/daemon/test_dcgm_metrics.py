"""Grafana out of the box: /metrics also carries NVIDIA DCGM exporter names, so the community DCGM
dashboard shows a gpusd fleet unchanged, and gpusd's own dashboard (docs/grafana-gpusd.json) queries only
metrics that exist.  Every scrape is read with prometheus_client's text-format parser."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from daemon_helpers import FakeBackend, make_snapshot, running_daemon, unique_session
from gpusd.daemon.metrics import render_snapshots
from gpusd.model import GpuInfo, HostSnapshot
from tests_paths import REPO

MiB = 2**20
DOCS = REPO / "docs"


def _snapshot(hostname: str = "gpu-node-1") -> HostSnapshot:
    g0 = GpuInfo(index=0, uuid="GPU-aaa", name="NVIDIA A100-SXM4-80GB", pci_bus_id="00000000:07:00.0",
                 memory_total=80 * 1024 * MiB, memory_used=20 * 1024 * MiB, memory_free=60 * 1024 * MiB,
                 utilization_gpu=45.0, utilization_memory=30.0, temperature=61, power_draw=250.5)
    g1 = GpuInfo(index=1, uuid="GPU-bbb", name="NVIDIA A100-SXM4-80GB", healthy=False, error="GPU is lost")
    return HostSnapshot(hostname=hostname, node_id="0123456789abcdef", timestamp=1700000000.0, gpus=[g0, g1],
                        driver_version="550.54", cuda_version="12.4")


def _series(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, dict(s.labels), s.value) for fam in text_string_to_metric_families(text) for s in fam.samples]


def test_dcgm_series_with_dcgm_units_and_labels() -> None:
    series = _series(render_snapshots([_snapshot()], dcgm=True).decode())
    dcgm = {name: (labels, value) for name, labels, value in series
            if name.startswith("DCGM_") and labels["UUID"] == "GPU-aaa"}
    assert {k: v[1] for k, v in dcgm.items()} == {
        "DCGM_FI_DEV_GPU_UTIL": 45, "DCGM_FI_DEV_MEM_COPY_UTIL": 30, "DCGM_FI_DEV_FB_USED": 20480,
        "DCGM_FI_DEV_FB_FREE": 61440, "DCGM_FI_DEV_GPU_TEMP": 61, "DCGM_FI_DEV_POWER_USAGE": 250.5}
    # integers where DCGM's fields are integers (the parser reads "45" as an int, "45.0" as a float)
    assert all(type(v[1]) is int for k, v in dcgm.items() if k != "DCGM_FI_DEV_POWER_USAGE")
    # dcgm-exporter's labels; `hostname` in lower case, as the exporter writes it since May 2026
    assert dcgm["DCGM_FI_DEV_GPU_TEMP"][0] == {
        "gpu": "0", "UUID": "GPU-aaa", "device": "nvidia0", "modelName": "NVIDIA A100-SXM4-80GB",
        "hostname": "gpu-node-1", "pci_bus_id": "00000000:07:00.0", "DCGM_FI_DRIVER_VERSION": "550.54"}
    # a lost GPU reports nothing: no DCGM series for it rather than zeros
    assert [n for n, labels, _ in series if n.startswith("DCGM_") and labels["UUID"] == "GPU-bbb"] == []
    # gpusd's own names are still there
    assert any(n == "gpusd_gpu_temperature_celsius" for n, _, _ in series)


def test_dcgm_names_can_be_switched_off() -> None:
    text = render_snapshots([_snapshot()], dcgm=False).decode()
    assert "DCGM_" not in text and "gpusd_gpu_utilization_ratio" in text


def test_hostile_model_names_stay_inside_their_label() -> None:
    snap = _snapshot()
    snap.gpus[0].name = 'x"} DCGM_FI_DEV_GPU_TEMP{gpu="9"} 999\n#'
    series = _series(render_snapshots([snap], dcgm=True).decode())
    temps = [(labels["gpu"], v) for n, labels, v in series if n == "DCGM_FI_DEV_GPU_TEMP"]
    assert temps == [("0", 61.0)]


# -- scraping real daemons, as Prometheus does (one target per daemon) ---------------------------------------
async def _scrape(daemons: list[Any]) -> list[tuple[str, dict[str, str], float]]:
    """Every daemon's /metrics, parsed, with the ``instance`` label Prometheus adds to each target."""
    out = []
    async with aiohttp.ClientSession() as s:
        for d in daemons:
            instance = f"127.0.0.1:{d.port}"
            async with s.get(f"http://{instance}/metrics") as r:
                assert r.status == 200
                text = await r.text()
            for name, labels, value in _series(text):
                out.append((name, {**labels, "instance": instance, "job": "gpusd"}, value))
    return out


def _host(n: int, hostname: str) -> HostSnapshot:
    snap = make_snapshot(n, hostname=hostname, util=30.0, used=MiB)
    for g in snap.gpus:
        g.power_draw, g.utilization_memory, g.pci_bus_id = 100.0 + g.index, 5.0, f"00000000:{g.index + 7:02x}:00.0"
        g.clock_sm = 1410
    return snap


async def _two_daemons(tmp_path: Path, **kw: Any) -> Any:
    session = unique_session("dcgm")
    a = running_daemon(tmp_path, session, "node-a", backend=FakeBackend(_host(2, "node-a")), **kw)
    b = running_daemon(tmp_path, session, "node-b", backend=FakeBackend(_host(3, "node-b")), **kw)
    return a, b


def _select(series: list[tuple[str, dict[str, str], float]], expr: str, variables: dict[str, str]) -> list[Any]:
    """The series an instant vector selector ``NAME{label=~"re", ...}`` (inside any function) selects,
    with Grafana's variables substituted (All = ".*"); PromQL anchors regexes."""
    for var, value in variables.items():
        expr = expr.replace(f"${{{var}}}", value).replace(f"${var}", value)
    m = re.search(r"([A-Za-z_:][A-Za-z0-9_:]*)\{([^}]*)\}", expr)
    assert m, expr
    name, matchers = m.group(1), m.group(2)
    wanted = re.findall(r'(\w+)\s*=~\s*"([^"]*)"', matchers)
    return [s for s in series if s[0] == name and all(re.fullmatch(rx, s[1].get(lbl, "")) for lbl, rx in wanted)]


# The community "NVIDIA DCGM Exporter Dashboard" (grafana.com dashboard 12239, as shipped by NVIDIA's
# dcgm-exporter repository, grafana/dcgm-exporter-dashboard.json): its variables and panel queries.
COMMUNITY_VARIABLES = {"instance": ("DCGM_FI_DEV_GPU_TEMP", "instance"), "gpu": ("DCGM_FI_DEV_GPU_TEMP", "gpu")}
COMMUNITY_PANELS = {
    "GPU Temperature": 'DCGM_FI_DEV_GPU_TEMP{instance=~"${instance}", gpu=~"${gpu}"}',
    "GPU Avg. Temp": 'avg(DCGM_FI_DEV_GPU_TEMP{instance=~"${instance}", gpu=~"${gpu}"})',
    "GPU Power Usage": 'DCGM_FI_DEV_POWER_USAGE{instance=~"${instance}", gpu=~"${gpu}"}',
    "GPU Power Total": 'sum(DCGM_FI_DEV_POWER_USAGE{instance=~"${instance}", gpu=~"${gpu}"})',
    "GPU Utilization": 'DCGM_FI_DEV_GPU_UTIL{instance=~"${instance}", gpu=~"${gpu}"}',
    "GPU Framebuffer Mem Used": 'DCGM_FI_DEV_FB_USED{instance=~"${instance}", gpu=~"${gpu}"}',
    "GPU SM Clocks": 'DCGM_FI_DEV_SM_CLOCK{instance=~"${instance}", gpu=~"${gpu}"} * 1000000',
}
# Its other panel reads a profiling counter that only DCGM itself measures (docs/monitoring.md):
COMMUNITY_NOT_SERVED = {"Tensor Core Utilization": "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"}


async def test_community_dcgm_dashboard_queries_select_every_daemons_gpus(tmp_path: Path) -> None:
    a, b = await _two_daemons(tmp_path)
    async with a as da, b as db:
        series = await _scrape([da, db])
    instances = {f"127.0.0.1:{da.port}": 2, f"127.0.0.1:{db.port}": 3}
    # the dashboard's variables: label_values(DCGM_FI_DEV_GPU_TEMP, instance) / (..., gpu)
    values = {var: {s[1][label] for s in series if s[0] == metric} for var, (metric, label) in
              COMMUNITY_VARIABLES.items()}
    assert values["instance"] == set(instances) and values["gpu"] == {"0", "1", "2"}
    for title, expr in COMMUNITY_PANELS.items():
        everything = _select(series, expr, {"instance": ".*", "gpu": ".*"})
        assert len(everything) == 5, title  # every GPU of both daemons
        for instance, count in instances.items():  # one host picked in the dashboard's drop-down
            assert len(_select(series, expr, {"instance": re.escape(instance), "gpu": ".*"})) == count, title
        assert len(_select(series, expr, {"instance": ".*", "gpu": "2"})) == 1, title
    assert not any(s[0] in COMMUNITY_NOT_SERVED.values() for s in series)


async def test_no_dcgm_metrics_flag_in_the_daemon(tmp_path: Path) -> None:
    a, _ = await _two_daemons(tmp_path, dcgm_metrics=False)
    async with a as da:
        series = await _scrape([da])
    assert series and not any(name.startswith("DCGM_") for name, _, _ in series)


# label lists of PromQL's modifiers (``group_left (user, gpusd_job)``): label names, not metrics
_LABEL_LISTS = re.compile(r"\b(?:on|ignoring|by|without|group_left|group_right)\s*\([^)]*\)")


def _dashboard_metrics(dashboard: dict[str, Any]) -> set[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["query"] for v in dashboard["templating"]["list"] if v.get("type") == "query"]
    names = set()
    for expr in exprs:
        names |= set(re.findall(r"\b((?:gpusd|DCGM)_[A-Za-z0-9_]+)\b", _LABEL_LISTS.sub("", expr)))
    return names


async def test_our_grafana_dashboard_queries_only_metrics_that_exist(tmp_path: Path) -> None:
    dashboard = json.loads((DOCS / "grafana-gpusd.json").read_text())
    wanted = _dashboard_metrics(dashboard)
    assert len(wanted) >= 10
    session = unique_session("dash")
    async with running_daemon(tmp_path, session, "node-a", thresholds=["temperature>85"], user_metrics=True) as d:
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{d.port}/metrics") as r:
            text = await r.text()
    families = {fam.name for fam in text_string_to_metric_families(text)}
    samples = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    counters = {f"{fam.name}_total" for fam in text_string_to_metric_families(text) if fam.type == "counter"}
    assert sorted(wanted - families - samples - counters) == []
    # every selector in it filters by the variables Prometheus and the dashboard provide
    for p in dashboard["panels"]:
        for t in p["targets"]:
            for sel in re.findall(r"gpusd_\w+(\{[^}]*\})?", _LABEL_LISTS.sub("", t["expr"])):
                assert sel == '{instance=~"$instance", host=~"$host"}', t["expr"]


@pytest.mark.parametrize("flag,expected", [([], True), (["--no-dcgm-metrics"], False), (["--dcgm-metrics"], True)])
def test_start_flag(flag: list[str], expected: bool) -> None:
    from gpusd.cli import build_parser

    args = build_parser("start").parse_args(["start", *flag])
    assert args.dcgm_metrics is expected


def test_a_simulated_fleet_feeds_the_dcgm_series_too() -> None:
    """``gpusd start --simulate`` (a demo of the dashboards) makes up the telemetry consistently: the
    energy counter grows with the power drawn, Hoppers have the profiling series, lost GPUs none."""
    from gpusd.inventory.simulated import SimulatedBackend

    now = [1000.0]
    b = SimulatedBackend("1xA100-80GB,1xH100-80GB", clock=lambda: now[0])

    def read() -> dict[str, dict[str, float]]:
        fams = text_string_to_metric_families(render_snapshots([b.snapshot()], dcgm=True).decode())
        return {f.name: {s.labels["gpu"]: s.value for s in f.samples} for f in fams if f.name.startswith("DCGM_")}

    first = read()
    now[0] += 10.0
    second = read()
    energy0, energy1 = first["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"], second["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"]
    assert all(energy1[g] > energy0[g] for g in ("0", "1"))
    assert set(second["DCGM_FI_DEV_SM_CLOCK"]) == {"0", "1"}
    assert set(second["DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"]) == {"1"}  # the H100 only


def test_every_dcgm_series_is_nvidias_only_and_counts_the_cuda_number() -> None:
    """On a host with GPUs of several vendors, the DCGM names (issue 25's new counters too) are served
    for the NVIDIA GPUs alone, numbered as CUDA counts them (``device_index``); the AMD GPU gets AMD's
    exporter names, and a simulated AMD GPU makes up none of NVML's own telemetry (its energy and clocks
    are amdsmi's, served under AMD's names)."""
    from gpusd.inventory.simulated import SimulatedBackend

    snap = SimulatedBackend("1xMI300X,1xH100-80GB", host="mixed-2").snapshot()
    amd, nvidia = snap.gpus
    assert (amd.vendor, nvidia.vendor, nvidia.index, nvidia.device_index) == ("amd", "nvidia", 1, 0)
    assert amd.xid_errors is None and amd.gpm_graphics_util is None and amd.memory_reserved is None
    text = render_snapshots([snap], dcgm=True).decode()
    series = _series(text)
    # by family (a counter's samples come back from the parser named ..._total)
    dcgm = [(f.name, dict(s.labels)) for f in text_string_to_metric_families(text) if f.name.startswith("DCGM_")
            for s in f.samples]
    assert {n for n, _ in dcgm} >= {"DCGM_FI_DEV_SM_CLOCK", "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
                                    "DCGM_FI_DEV_XID_ERRORS", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"}
    assert {labels["UUID"] for _, labels in dcgm} == {nvidia.uuid}
    assert {(labels["gpu"], labels["device"]) for _, labels in dcgm} == {("0", "nvidia0")}
    assert {labels["gpu_uuid"] for n, labels, _ in series if n == "gpu_gfx_activity"} == {amd.uuid}
    # gpusd's own energy series covers every vendor that reads it (its dashboard's energy panel: AMD hosts too)
    assert {labels["uuid"] for n, labels, _ in series if n == "gpusd_gpu_energy_joules_total"} == {
        nvidia.uuid, amd.uuid}
