"""install(app, daemon): /metrics, the dashboard's files, /api/v1/alerts and threshold events."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from gpusd.daemon.monitoring import WEB_DIR, install
from gpusd.errors import ConfigError
from monitor_fakes import FakeDaemon, make_app, sim_host
from tests_paths import REPO
from waiting import wait_until


async def start(daemon: FakeDaemon) -> TestClient:
    c = TestClient(TestServer(make_app(daemon), host="127.0.0.1"))
    await c.start_server()
    return c


async def test_metrics_endpoint_serves_this_host_only():
    d = FakeDaemon([sim_host("gpu-node-1", "4xA100-80GB"), sim_host("gpu-node-2")])
    c = await start(d)
    try:
        r = await c.get("/metrics")
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        fams = {f.name: f for f in text_string_to_metric_families(await r.text())}
        hosts = {s.labels["host"] for s in fams["gpusd_gpu_utilization_ratio"].samples}
        assert hosts == {"gpu-node-1"}  # each daemon exports its own GPUs: no duplicates across the fleet
        assert len(fams["gpusd_gpu_utilization_ratio"].samples) == 4
        assert "process_cpu_seconds" in fams  # the daemon's own CPU use
    finally:
        await c.close()


async def test_dashboard_files_are_served_with_a_strict_policy():
    c = await start(FakeDaemon([sim_host("gpu-node-1")]))
    try:
        r = await c.get("/")
        html = await r.text()
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/html")
        assert "default-src 'self'" in r.headers["Content-Security-Policy"]
        for ref in re.findall(r'(?:src|href)="([^"]+)"', html):
            if ref.startswith("data:"):
                continue
            assert not ref.startswith(("http:", "https:", "//")), ref
            a = await c.get("/" + ref)
            assert a.status == 200, ref
        assert (await c.get("/assets/app.js")).headers["Content-Type"].startswith("application/javascript")
        assert (await c.get("/assets/nope.js")).status == 404
        assert (await c.get("/assets/..%2f..%2fmodel.py")).status == 404
    finally:
        await c.close()


def test_web_assets_need_no_network():
    for f in WEB_DIR.rglob("*"):
        if not f.is_file():
            continue
        text = f.read_text()
        # the vendored uPlot names its home page in its banner comment and its README: not a request
        allowed = {"http://www.w3.org/2000/svg", "https://github.com/leeoniya/uPlot"}
        urls = set(re.findall(r"https?://[^\s\"'`)]+", text)) - allowed
        assert not urls, (f.name, urls)


def test_web_assets_ship_with_the_package():
    pyproject = (REPO / "pyproject.toml").read_text()
    assert '"web/*"' in pyproject
    assert {p.name for p in WEB_DIR.iterdir()} >= {"index.html", "app.js", "style.css"}


async def test_thresholds_are_evaluated_on_new_samples_and_published():
    host = sim_host("gpu-node-1")
    d = FakeDaemon([host], thresholds=["hot: temperature>80", "lost"], interval=0.1)
    c = await start(d)
    try:
        body = await (await c.get("/api/v1/alerts")).json()
        assert [r["name"] for r in body["rules"]] == ["hot", "lost"] and body["alerts"] == []
        host.gpus[1].temperature = 90
        host.timestamp += 1
        await wait_until(lambda: d.published)
        [(event, data)] = d.published
        assert event == "threshold"
        assert (data["state"], data["rule"], data["gpu"], data["value"]) == ("exceeded", "hot", host.gpus[1].uuid, 90)
        alerts = (await (await c.get("/api/v1/alerts")).json())["alerts"]
        assert [(a["rule"], a["index"]) for a in alerts] == [("hot", 1)]
        metrics = await (await c.get("/metrics")).text()
        assert 'gpusd_threshold_active{' in metrics and 'rule="hot"' in metrics
        host.gpus[1].temperature = 40
        host.timestamp += 1
        await wait_until(lambda: len(d.published) == 2)
        assert d.published[1][1]["state"] == "cleared"
        # the same snapshot twice is evaluated once
        assert len(d.published) == 2
    finally:
        await c.close()


def test_bad_rule_stops_install_with_a_clear_error():
    with pytest.raises(ConfigError, match="bad threshold rule 'temp>>1'"):
        install(web.Application(), FakeDaemon([sim_host("h")], thresholds=["temp>>1"]))


def test_cli_help_does_not_import_heavy_modules():
    code = ("import sys, contextlib, io\n"
            "from gpusd.cli import main\n"
            "for argv in (['--help'], ['top', '--help'], ['export', 'prometheus-sd', '--help']):\n"
            "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
            "        main(argv)\n"
            "print(sorted(m for m in ('zeroconf', 'aiohttp', 'rich', 'prometheus_client') if m in sys.modules))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
