"""A real Prometheus (Debian's ``prometheus``) discovers two gpusd daemons through a daemon's http_sd
endpoint, scrapes them, and every query of both dashboards — gpusd's docs/grafana-gpusd.json and NVIDIA's
DCGM exporter dashboard (vendored in tests/daemon/grafana/) — returns data, the queries extracted from
the JSON files.  Prometheus listens on loopback only, with its own config and data directory, for at most
the test's timeout, and is stopped by its pid."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from daemon_helpers import FakeBackend, make_snapshot, running_daemon, unique_session
from gpusd.model import HostSnapshot, LeaseInfo, MigInstance, ProcessInfo
from tests_paths import REPO

GiB = 2**30
DASHBOARDS = {"gpusd": REPO / "docs" / "grafana-gpusd.json",
              "dcgm": Path(__file__).parent / "grafana" / "dcgm-exporter-dashboard.json"}
# The panels NVML cannot feed.  DCGM's profiling counters (Tensor Core Utilization) need DCGM itself,
# or NVML's GPM on Hopper and newer: node-b has H100s, so none is left (docs/monitoring.md).
NOT_FROM_NVML: set[tuple[str, str]] = set()
# Grafana's variables, as a dashboard set to "All" (and a range) sends them.
VARIABLES = {"instance": ".*", "gpu": ".*", "host": ".*", "__range": "5m", "__rate_interval": "1m",
             "__interval": "15s", "datasource": "prometheus"}

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None,
                                reason="no prometheus binary (apt-get install prometheus; .ci/run does)")


def _host(hostname: str, n: int, hopper: bool = False) -> HostSnapshot:
    snap = make_snapshot(n, hostname=hostname, util=30.0, used=GiB,
                         name="NVIDIA H100 80GB HBM3" if hopper else "NVIDIA A100-SXM4-80GB")
    for g in snap.gpus:
        g.pci_bus_id = f"00000000:{g.index + 7:02X}:00.0"
        g.power_draw, g.power_limit, g.utilization_memory = 100.0 + g.index, 400.0, 5.0
        g.clock_sm, g.clock_memory, g.memory_temperature, g.memory_reserved = 1410, 1593, 50, 512 * 2**20
        g.energy, g.pcie_replays, g.utilization_encoder, g.utilization_decoder = 10**9, 0, 0, 0
        g.xid_last, g.xid_errors, g.nvlink_bytes = 0, 0, 0
        g.remapped_rows_correctable, g.remapped_rows_uncorrectable, g.row_remap_failure = 0, 0, False
        if hopper:  # what NVML's GPM measures (the backend reads it; here the fake backend says it)
            g.gpm_graphics_util, g.gpm_tensor_util, g.gpm_dram_util = 60.0, 35.0, 20.0
            g.pcie_tx_rate, g.pcie_rx_rate = 1e8, 5e7
    snap.gpus[0].processes = [ProcessInfo(pid=4242, user="alice", command="python train.py")]
    snap.gpus[-1].leases = [LeaseInfo(lease_id="l1", pid=4243, user="bob")]
    snap.gpus[-1].mig_mode = True
    snap.gpus[-1].mig_instances = [MigInstance(index=0, uuid="MIG-1", profile="3g.40gb", memory_total=40 * GiB,
                                               memory_used=GiB, gpu_instance_id=1)]
    return snap


def _queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every panel target and every templating query of ``dashboard``."""
    out = [(p.get("title", "?"), t["expr"]) for p in dashboard.get("panels", []) for t in p.get("targets", [])
           if t.get("expr")]
    for v in dashboard.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            m = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\s*\)\s*", q)  # Grafana's: the series, one label
            out.append((f"variable {v['name']}", m.group(1) if m else q))
    return out


def _substitute(expr: str) -> str:
    for name, value in sorted(VARIABLES.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace("${" + name + "}", value).replace("$" + name, value)
    return expr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_prometheus(tmp: Path, sd_url: str, rules: Path | None = None) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    config = tmp / "prometheus.yml"
    rule_files = f"rule_files: [{json.dumps(str(rules))}]" if rules is not None else ""
    config.write_text(f"""
global:
  scrape_interval: 1s
  evaluation_interval: 1s
{rule_files}
scrape_configs:
  - job_name: gpusd
    scrape_interval: 1s
    http_sd_configs:
      - url: {sd_url}
        refresh_interval: 1s
    relabel_configs:          # docs/monitoring.md: keep the stable facts of discovery
      - source_labels: [__meta_gpusd_node_id]
        target_label: node_id
      - source_labels: [__meta_gpusd_session]
        target_label: gpusd_session
      - source_labels: [__meta_gpusd_session]   # AMD's dashboards pick hosts by cluster_name
        target_label: cluster_name
""")
    (tmp / "prom-data").mkdir()
    log = open(tmp / "prometheus.log", "wb")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(
        ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp / 'prom-data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h",
         "--web.console.templates=/nonexistent", "--web.console.libraries=/nonexistent"],
        cwd=tmp, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    return proc, f"http://127.0.0.1:{port}"


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # by its pid
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


async def _query(s: aiohttp.ClientSession, prom: str, expr: str) -> list[Any]:
    async with s.get(f"{prom}/api/v1/query", params={"query": expr}) as r:
        body = await r.json()
    assert body.get("status") == "success", (expr, body)
    result = body["data"]["result"]
    return result if isinstance(result, list) else [result]


async def _until(what: str, check: Any, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = await check()
            if last:
                return last
        except (aiohttp.ClientError, OSError, AssertionError) as exc:
            last = exc
        await asyncio.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}: {last!r}")


@pytest.mark.timeout(240)
async def test_prometheus_discovers_the_daemons_and_both_dashboards_have_data(tmp_path: Path) -> None:
    session = unique_session("prom")
    a = running_daemon(tmp_path, session, "node-a", backend=FakeBackend(_host("node-a", 2)), user_metrics=True,
                       thresholds=["temperature>85"])
    b = running_daemon(tmp_path, session, "node-b", backend=FakeBackend(_host("node-b", 3, hopper=True)),
                       user_metrics=True, thresholds=["temperature>85"])
    async with a as da, b as db:
        sd_url = f"http://127.0.0.1:{da.port}/api/v1/prometheus/http_sd"
        async with aiohttp.ClientSession() as s:
            async def both_listed() -> bool:
                async with s.get(sd_url) as r:
                    doc = await r.json()
                return sorted(t for g in doc for t in g["targets"]) == sorted(
                    f"127.0.0.1:{d.port}" for d in (da, db))

            await _until("the http_sd document to list both daemons", both_listed)
            proc, prom = _start_prometheus(tmp_path, sd_url)
            try:
                async def scraped() -> bool:  # both targets up, each scraped a few times
                    if proc.poll() is not None:  # it could not start (a port taken meanwhile...): say why
                        raise RuntimeError("prometheus exited: " + (tmp_path / "prometheus.log").read_text()[-2000:])
                    up = await _query(s, prom, 'count_over_time(up{job="gpusd"}[5m]) >= 4')
                    return len(up) == 2 and all(float(r["value"][1]) >= 4 for r in up)

                await _until("Prometheus to scrape both daemons", scraped, timeout=90)
                targets = await _query(s, prom, 'up{job="gpusd"} == 1')
                assert {t["metric"]["instance"] for t in targets} == {f"127.0.0.1:{d.port}" for d in (da, db)}

                # discovery facts are __meta_ labels: relabelling kept node_id and the session, nothing else
                temps = await _query(s, prom, "DCGM_FI_DEV_GPU_TEMP")
                assert len(temps) == 5
                for t in temps:
                    labels = t["metric"]
                    assert labels["node_id"] in (da.node_id, db.node_id) and labels["gpusd_session"] == session
                    assert not any("verified" in k or "via" in k or k.startswith("gpusd_hostname") for k in labels)
                    assert "hostname" in labels and "Hostname" not in labels

                empty = []
                for name, path in DASHBOARDS.items():
                    queries = _queries(json.loads(path.read_text()))
                    assert len(queries) >= 8, name
                    for title, expr in queries:
                        result = await _query(s, prom, _substitute(expr))
                        if not result:
                            empty.append((name, title))
                assert sorted(empty) == sorted(NOT_FROM_NVML)

                # usage per user reached Prometheus (this Prometheus scrapes from the daemons' machine)
                for kind, who in (("used", "alice"), ("held", "bob")):
                    users = await _query(s, prom, f'sum by (user) (gpusd_user_gpu_seconds_total{{kind="{kind}"}}) > 0')
                    assert {u["metric"]["user"] for u in users} == {who}, kind
                mig = await _query(s, prom, 'DCGM_FI_DEV_FB_USED{GPU_I_PROFILE="3g.40gb"}')
                assert len(mig) == 2 and {m["metric"]["GPU_I_ID"] for m in mig} == {"1"}
            finally:
                _stop(proc)
            assert proc.returncode is not None


@pytest.mark.timeout(180)
async def test_the_shipped_rules_fire_for_a_lost_gpu_and_leases_join_load_to_work(tmp_path: Path) -> None:
    """docs/prometheus-rules.yml loaded into a real Prometheus: a daemon whose GPU 1 is lost fires
    GpusdGpuLost for that GPU alone; the lease on GPU 0 is a gpusd_gpu_lease_info series naming its
    holder and job, which joins the GPU's utilisation to the work on it (the dashboard's "Who runs
    what" panel)."""
    session = unique_session("rules")
    snap = _host("node-r", 2)
    snap.gpus[1].healthy, snap.gpus[1].error = False, "GPU is lost"
    snap.gpus[1].leases = []
    snap.gpus[0].leases = [LeaseInfo(lease_id="0123456789ab", pid=4243, user="carol", job="fedcba987654",
                                     device=snap.gpus[0].uuid)]
    async with running_daemon(tmp_path, session, "node-r", backend=FakeBackend(snap), user_metrics=True) as d:
        sd_url = f"http://127.0.0.1:{d.port}/api/v1/prometheus/http_sd"
        proc, prom = _start_prometheus(tmp_path, sd_url, rules=REPO / "docs" / "prometheus-rules.yml")
        try:
            async with aiohttp.ClientSession() as s:
                async def firing() -> list[Any]:
                    if proc.poll() is not None:
                        raise RuntimeError("prometheus exited: " + (tmp_path / "prometheus.log").read_text()[-2000:])
                    async with s.get(f"{prom}/api/v1/alerts") as r:
                        body = await r.json()
                    return [a for a in body["data"]["alerts"]
                            if a["labels"]["alertname"] == "GpusdGpuLost" and a["state"] == "firing"]

                alerts = await _until("GpusdGpuLost to fire", firing, timeout=90)
                assert [(a["labels"]["host"], a["labels"]["index"]) for a in alerts] == [("node-r", "1")]
                joined = await _query(s, prom, "gpusd_gpu_utilization_ratio * on (host, uuid) "
                                               "group_left (user, gpusd_job) gpusd_gpu_lease_info")
                assert [(j["metric"]["index"], j["metric"]["user"], j["metric"]["gpusd_job"]) for j in joined] == [
                    ("0", "carol", "fedcba987654")]
        finally:
            _stop(proc)


# The panels of AMD's GPU dashboard whose series need readings gpusd does not take: none.  Every panel
# reads what amdsmi gives (docs/monitoring.md, "AMD's dashboards"): the PCIe panels amdsmi_get_pcie_info,
# the ECC ones amdsmi_get_gpu_total_ecc_count, the per-XCC GFX busy the GPU metrics table.
AMD_NOT_READ: set[str] = set()


def _amd_panels(board: dict[str, Any]) -> list[tuple[str, list[str]]]:
    def walk(panels: list[dict[str, Any]]) -> Any:
        for p in panels:
            yield p
            yield from walk(p.get("panels", []))

    return [(p.get("title", "?"), [t["expr"] for t in p["targets"] if t.get("expr")])
            for p in walk(board["panels"]) if p.get("targets")]


@pytest.mark.timeout(180)
async def test_amds_gpu_dashboard_shows_data_in_every_panel_amdsmi_feeds(tmp_path: Path) -> None:
    """AMD's own GPU dashboard (tests/daemon/grafana/amd-gpu-dashboard.json, vendored) against a real
    Prometheus scraping a daemon with an MI300X (no edge sensor) and an MI250X: every panel is run as
    Grafana runs it for each GPU (its variables set to that GPU), and the panels without data are
    exactly those whose readings gpusd does not take."""
    session = unique_session("amd")
    board = json.loads((Path(__file__).parent / "grafana" / "amd-gpu-dashboard.json").read_text())
    panels = _amd_panels(board)
    assert len(panels) == 18
    async with running_daemon(tmp_path, session, "amd-node", simulate="1xMI300X,1xMI250X") as d:
        sd_url = f"http://127.0.0.1:{d.port}/api/v1/prometheus/http_sd"
        proc, prom = _start_prometheus(tmp_path, sd_url)
        try:
            async with aiohttp.ClientSession() as s:
                async def scraped() -> list[Any]:
                    if proc.poll() is not None:
                        raise RuntimeError("prometheus exited: " + (tmp_path / "prometheus.log").read_text()[-2000:])
                    up = await _query(s, prom, 'count_over_time(gpu_health{cluster_name!=""}[5m]) >= 4')
                    return up if len(up) == 2 else []

                gpus = await _until("Prometheus to scrape the AMD GPUs", scraped, timeout=90)
                with_data = set()
                for g in gpus:
                    labels = g["metric"]
                    values = {"g_metrics_prefix": "", "g_gpu_uuid": labels["gpu_uuid"],
                              "g_hostname": labels["hostname"], "g_gpu_id": labels["gpu_id"],
                              "g_cluster_name": labels["cluster_name"],
                              "__interval": "1m", "__rate_interval": "1m"}
                    for title, exprs in panels:
                        for expr in exprs:
                            for name, value in sorted(values.items(), key=lambda kv: -len(kv[0])):
                                expr = expr.replace("${" + name + "}", value).replace("$" + name, value)
                            # Prometheus 3's quoted name in the braces, as Debian's 2.42 writes it
                            expr = re.sub(r'\{"([A-Za-z_:][A-Za-z0-9_:]*)",\s*', r"\1{", expr)
                            if await _query(s, prom, expr):
                                with_data.add(title)
                titles = {t for t, _ in panels}
                assert titles - with_data == AMD_NOT_READ, sorted(titles - with_data)
                # docs/monitoring.md: all 18 panels (17 titles: two panels are "PCIe Bandwidth")
                assert len(with_data) == 17 and len(panels) == 18
        finally:
            _stop(proc)
