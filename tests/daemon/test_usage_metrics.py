"""Usage as metrics: GPU-seconds used and held, per GPU for everyone, per user only where the admin
turned it on (``--user-metrics``) and only for readers who may see private data."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from daemon_helpers import FakeBackend, make_snapshot, running_daemon, unique_session
from gpusd.daemon.gpuseconds import UsageCounters
from gpusd.daemon.metrics import UsageCollector, make_registry, render
from gpusd.model import GpuInfo, HostSnapshot, LeaseInfo, ProcessInfo


def _snap(ts: float, procs: list[list[str]], holders: list[list[str]]) -> HostSnapshot:
    gpus = [GpuInfo(index=i, uuid=f"GPU-{i}", name="NVIDIA A100-SXM4-80GB",
                    processes=[ProcessInfo(pid=100 + k, user=u) for k, u in enumerate(procs[i])],
                    leases=[LeaseInfo(lease_id=f"l{i}{k}", pid=1, user=u) for k, u in enumerate(holders[i])])
            for i in range(len(procs))]
    return HostSnapshot(hostname="node-a", node_id="0" * 16, timestamp=ts, gpus=gpus)


def _values(text: str, name: str) -> dict[tuple[str, ...], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                out[tuple(v for k, v in sorted(s.labels.items()) if k not in ("host", "model"))] = s.value
    return out


def test_gpu_seconds_used_and_held_per_gpu_and_per_user() -> None:
    c = UsageCounters()
    # GPU 0: alice and bob run processes; GPU 1: carol holds a lease, nobody runs; GPU 2: idle
    c.add(_snap(1000.0, [["alice", "bob"], [], []], [[], ["carol"], []]))
    c.add(_snap(1010.0, [["alice"], [], []], [[], ["carol"], []]))  # 10 s as the first sample showed
    c.add(_snap(1015.0, [[], [], []], [[], [], []]))  # 5 s: alice alone on GPU 0, carol on GPU 1
    c.add(_snap(5000.0, [[], [], []], [[], [], []]))  # a long gap: counts at most max_gap, and nobody
    text = render(make_registry(lambda: [], process_metrics=False,
                                extra=[UsageCollector(c, lambda: True)])).decode()
    # label order: index, uuid
    assert _values(text, "gpusd_gpu_used_seconds_total") == {("0", "GPU-0"): 15.0, ("1", "GPU-1"): 0.0,
                                                              ("2", "GPU-2"): 0.0}
    assert _values(text, "gpusd_gpu_held_seconds_total") == {("0", "GPU-0"): 0.0, ("1", "GPU-1"): 15.0,
                                                              ("2", "GPU-2"): 0.0}
    # (kind, user): a GPU two users share gives each half
    assert _values(text, "gpusd_user_gpu_seconds_total") == {
        ("used", "alice"): 10.0, ("held", "alice"): 0.0, ("used", "bob"): 5.0, ("held", "bob"): 0.0,
        ("used", "carol"): 0.0, ("held", "carol"): 15.0}
    assert {f.name: f.type for f in text_string_to_metric_families(text)}["gpusd_user_gpu_seconds"] == "counter"


def test_no_per_user_series_unless_turned_on_and_trusted() -> None:
    c = UsageCounters()
    c.add(_snap(1000.0, [["alice"]], [[]]))
    c.add(_snap(1010.0, [["alice"]], [[]]))
    text = render(make_registry(lambda: [], process_metrics=False, extra=[UsageCollector(c)])).decode()
    assert "alice" not in text and "gpusd_user_gpu_seconds" not in text
    assert _values(text, "gpusd_gpu_used_seconds_total") == {("0", "GPU-0"): 10.0}


async def _scrape(port: int) -> str:
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/metrics") as r:
        assert r.status == 200
        return await r.text()


def _busy_backend(hostname: str) -> FakeBackend:
    snap = make_snapshot(2, hostname=hostname, util=50.0)
    snap.gpus[0].processes = [ProcessInfo(pid=4242, user="alice", command="python train.py")]
    return FakeBackend(snap)


async def test_the_daemon_counts_usage_and_shows_users_only_when_asked(tmp_path: Path) -> None:
    import asyncio

    session = unique_session("usage")
    async with running_daemon(tmp_path, session, "node-a", backend=_busy_backend("node-a"),
                              user_metrics=True) as d:
        await asyncio.sleep(1.0)  # ten samples at 0.1 s
        text = await _scrape(d.port)  # from this machine: a reader who may see private data
        used = {k[0]: v for k, v in _values(text, "gpusd_gpu_used_seconds_total").items()}
        assert 0.5 < used["0"] and used["1"] == 0.0
        users = _values(text, "gpusd_user_gpu_seconds_total")
        assert users[("used", "alice")] == used["0"]
        # a reader who may not see private data gets no user names: a page of another name in a browser
        # on this machine (DNS rebinding: its Host is not the daemon's) ...
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{d.port}/metrics",
                                                       headers={"Host": f"evil.example:{d.port}"}) as r:
            rebound = await r.text()
        assert r.status == 200 and "gpusd_gpu_used_seconds_total" in rebound and "alice" not in rebound
        # ... and another machine's unsigned scraper (the same rule, asked of the monitor directly)
        monitor: Any = d.app[next(k for k in d.app if "monitor" in str(k))]
        public = monitor.metrics(private=False).decode()
        assert "alice" not in public and "gpusd_gpu_used_seconds_total" in public
    async with running_daemon(tmp_path, session, "node-b", backend=_busy_backend("node-b")) as d:
        await asyncio.sleep(0.5)
        text = await _scrape(d.port)
        assert "gpusd_gpu_used_seconds_total" in text and "alice" not in text  # --user-metrics is off
