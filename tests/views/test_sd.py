"""``gpusd export prometheus-sd``: the file_sd target list Prometheus reads."""

from __future__ import annotations

import asyncio
import json
import os
import sys

from aiohttp.test_utils import TestServer

from gpusd.discovery.fleetview import base_url
from gpusd.views import sd
from gpusd.wire import promsd
from monitor_fakes import FakeDaemon, make_app, sim_host


def test_file_sd_document():
    daemons = [promsd.ScrapeTarget("http://198.18.0.2:4780/gpusd/api/v1", "node-b", "b" * 16, "lab"),
               promsd.ScrapeTarget("http://198.18.0.4:4780/api/v1", "node-d", "d" * 16, "lab"),
               promsd.ScrapeTarget("http://198.18.0.1:4780", "node-a", "a" * 16, "lab"),
               promsd.ScrapeTarget("http://[fe80::1]:4780", "node-c", "c" * 16),
               promsd.ScrapeTarget("http://198.18.0.1:4780", "node-a", "a" * 16, "lab")]  # seen twice: listed once
    doc = promsd.file_sd(daemons)
    assert doc == [
        {"targets": ["198.18.0.1:4780"], "labels": {"__meta_gpusd_hostname": "node-a",
                                                   "__meta_gpusd_node_id": "a" * 16, "__meta_gpusd_session": "lab"}},
        {"targets": ["198.18.0.2:4780"], "labels": {"__meta_gpusd_hostname": "node-b",
                                                   "__meta_gpusd_node_id": "b" * 16, "__meta_gpusd_session": "lab",
                                                   "__metrics_path__": "/gpusd/metrics"}},
        {"targets": ["[fe80::1]:4780"], "labels": {"__meta_gpusd_hostname": "node-c",
                                                  "__meta_gpusd_node_id": "c" * 16}},
        {"targets": ["198.18.0.4:4780"], "labels": {"__meta_gpusd_hostname": "node-d",
                                                   "__meta_gpusd_node_id": "d" * 16, "__meta_gpusd_session": "lab"}},
    ]


def test_base_url_strips_the_api_prefix():
    assert base_url("http://h:4780/api/v1/") == "http://h:4780"
    assert base_url("h:4780") == "http://h:4780"


def test_daemons_from_fleet_skips_dead_and_urlless_hosts():
    fleet = {"hosts": [{"hostname": "a", "node_id": "1", "url": "http://10.0.0.1:4780", "alive": True},
                       {"hostname": "b", "node_id": "2", "url": "http://10.0.0.2:4780", "alive": False},
                       {"hostname": "c", "node_id": "3", "url": None}, "junk"]}
    assert [d.hostname for d in sd.daemons_from_fleet(fleet)] == ["a"]


def test_daemons_from_fleet_skips_urls_prometheus_cannot_scrape():
    """The fleet answer comes from the network: a bad URL there is left out, not a traceback."""
    fleet = {"hosts": [{"hostname": "a", "node_id": "1", "url": "http://10.0.0.1:4780"},
                       {"hostname": "b", "node_id": "2", "url": "garbage"},
                       {"hostname": "c", "node_id": "3", "url": "http://10.0.0.3:99999"}]}
    daemons = sd.daemons_from_fleet(fleet)
    assert [d.hostname for d in daemons] == ["a"]
    assert [g["targets"] for g in promsd.file_sd(daemons)] == [["10.0.0.1:4780"]]


def test_broken_http_answer_is_a_source_error():
    import pytest

    from daemon_helpers import answer_garbage_once
    from gpusd.errors import SourceError
    from gpusd.views.sources import get_json

    srv, t = answer_garbage_once()
    try:
        with pytest.raises(SourceError, match="broken HTTP answer"):
            get_json(f"http://127.0.0.1:{srv.getsockname()[1]}/api/v1/fleet", timeout=5)
    finally:
        t.join(10)
        srv.close()


def test_write_is_atomic_and_skips_identical_content(tmp_path):
    f = tmp_path / "gpusd.json"
    d = [promsd.ScrapeTarget("http://10.0.0.1:4780", "a", "1")]
    assert sd.write(f, d) is True
    assert json.loads(f.read_text())[0]["targets"] == ["10.0.0.1:4780"]
    assert sd.write(f, d) is False
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpusd.json"]  # no temporary files left
    assert sd.write(f, []) is True and json.loads(f.read_text()) == []


async def run_cli(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gpusd", *args, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE, env=dict(os.environ))
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, out.decode(), err.decode()


async def test_cli_writes_the_daemons_a_daemon_knows(tmp_path):
    d = FakeDaemon([sim_host("gpu-node-1"), sim_host("gpu-node-2"), sim_host("gpu-node-3")])
    d.gone.add(list(d.hosts)[2])
    server = TestServer(make_app(d), host="127.0.0.1")
    await server.start_server()
    try:
        url = f"http://127.0.0.1:{server.port}"
        rc, out, err = await run_cli("export", "prometheus-sd", "--url", url)
        assert rc == 0, err
        doc = json.loads(out)
        assert [g["labels"]["__meta_gpusd_hostname"] for g in doc] == ["gpu-node-1", "gpu-node-2"]
        assert doc[0]["targets"] == ["gpu-node-1:4780"]
        target = tmp_path / "targets.json"
        rc, out, err = await run_cli("export", "prometheus-sd", "--url", url, "-o", str(target))
        assert rc == 0 and out == "" and "wrote 2 target(s)" in err
        assert json.loads(target.read_text()) == doc
    finally:
        await server.close()


async def test_cli_output_that_cannot_be_written_is_one_line(tmp_path):
    d = FakeDaemon([sim_host("gpu-node-1")])
    server = TestServer(make_app(d), host="127.0.0.1")
    await server.start_server()
    try:
        target = tmp_path / "no" / "such" / "dir" / "targets.json"
        rc, out, err = await run_cli("export", "prometheus-sd", "--url", f"http://127.0.0.1:{server.port}",
                                     "-o", str(target))
        assert rc == 1 and "cannot write" in err and "Traceback" not in err, err
    finally:
        await server.close()


async def test_cli_errors():
    rc, _, err = await run_cli("export", "prometheus-sd", "--url", "http://127.0.0.1:9")
    assert rc == 6 and "cannot reach" in err
    rc, _, err = await run_cli("export", "prometheus-sd", "--url", "http://127.0.0.1:9", "--watch")
    assert rc == 2 and "--watch needs --output" in err


def test_export_watch_survives_a_daemon_that_is_down(tmp_path):
    """`--watch` keeps running (and says why) while its daemon restarts, instead of exiting."""
    import subprocess
    import sys
    import time

    out = tmp_path / "targets.json"
    p = subprocess.Popen([sys.executable, "-m", "gpusd", "export", "prometheus-sd", "--url", "http://127.0.0.1:9",
                          "--watch", "-o", str(out), "--interval", "0.2"], stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(2.0)
        assert p.poll() is None
    finally:
        p.terminate()
        err = p.communicate(timeout=10)[1]
    assert "trying again in 0.2s" in err and "Traceback" not in err
