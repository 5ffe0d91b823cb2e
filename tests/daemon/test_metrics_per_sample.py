"""/metrics is built once per sample: scrapes between two samples share one build of the GPU, usage,
lease and alert series; the daemon's own process_* series are read at every scrape."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from daemon_helpers import FakeBackend, make_snapshot, running_daemon, unique_session
from gpusd.daemon.access import Access
from gpusd.daemon.monitoring import Monitor
from gpusd.model import HostSnapshot, LeaseInfo
from gpusd.thresholds import load_rules


class _Daemon:
    """What a monitor reads of its daemon: the latest sample, and the per-sample callbacks."""

    def __init__(self, snap: HostSnapshot) -> None:
        self.snapshot = snap
        self.on_sample: list[Any] = []
        self.events: list[tuple[str, Any]] = []

    def latest_snapshot(self) -> HostSnapshot:
        return self.snapshot

    def publish(self, event: str, data: Any) -> None:
        self.events.append((event, data))

    def sample(self, snap: HostSnapshot) -> None:
        self.snapshot = snap
        for callback in self.on_sample:
            callback(snap)


def _value(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    raise KeyError(name)


def _monitor(daemon: _Daemon, rules: str | None = None) -> Monitor:
    monitor = Monitor(daemon, load_rules([rules]) if rules else [], Access(None), 0.5, dcgm=True, user_metrics=True)
    daemon.on_sample.append(monitor.count_usage)
    if rules:
        daemon.on_sample.append(lambda snap: monitor.evaluate(snap))
    return monitor


def test_scrapes_between_two_samples_cause_one_build() -> None:
    daemon = _Daemon(make_snapshot(8, util=10.0))
    monitor = _monitor(daemon)
    daemon.sample(daemon.snapshot)
    first = [monitor.metrics().decode() for _ in range(20)]
    assert monitor.builds == 1
    assert _value(first[-1], "gpusd_gpu_utilization_ratio", index="0") == 0.1
    assert _value(first[-1], "DCGM_FI_DEV_GPU_UTIL", gpu="0") == 10
    assert "process_cpu_seconds_total" in first[-1]  # the daemon's own series are still there

    later = make_snapshot(8, util=70.0)
    later.timestamp = daemon.snapshot.timestamp + 1.0
    daemon.sample(later)
    second = [monitor.metrics().decode() for _ in range(20)]
    assert monitor.builds == 2  # the new sample: built once more, then served as built
    assert _value(second[-1], "gpusd_gpu_utilization_ratio", index="0") == 0.7


def test_each_reader_level_is_built_once_and_keeps_its_privacy() -> None:
    snap = make_snapshot(2, util=50.0)
    snap.gpus[0].leases = [LeaseInfo(lease_id="l1", pid=1, user="alice")]
    daemon = _Daemon(snap)
    monitor = _monitor(daemon)
    daemon.sample(snap)
    for _ in range(5):
        private, public = monitor.metrics(private=True).decode(), monitor.metrics(private=False).decode()
    assert monitor.builds == 2  # one per level, not one per scrape
    assert 'user="alice"' in private and "alice" not in public


def test_a_threshold_crossed_at_a_sample_shows_at_the_next_scrape() -> None:
    daemon = _Daemon(make_snapshot(2, util=10.0))
    monitor = _monitor(daemon, "hot: utilization > 50")
    daemon.sample(daemon.snapshot)
    assert 'rule="hot"' not in monitor.metrics().decode()
    hot = make_snapshot(2, util=90.0)
    hot.timestamp = daemon.snapshot.timestamp + 1.0
    daemon.sample(hot)
    text = monitor.metrics().decode()
    assert _value(text, "gpusd_threshold_active", rule="hot", index="0") == 1.0
    assert monitor.builds == 2


async def test_the_daemon_builds_metrics_at_most_once_per_sample(tmp_path: Path) -> None:
    session = unique_session("metrics-once")
    async with running_daemon(tmp_path, session, "node-m", backend=FakeBackend(make_snapshot(8, hostname="node-m")),
                              interval=0.5) as d:
        monitor: Any = d.app[next(k for k in d.app if "monitor" in str(k))]
        samples = 0

        def counted(_snap: HostSnapshot) -> None:
            nonlocal samples
            samples += 1

        d.on_sample.append(counted)
        await asyncio.sleep(0.2)
        async with aiohttp.ClientSession() as s:
            builds0, samples0 = monitor.builds, samples
            for _ in range(30):
                async with s.get(f"http://127.0.0.1:{d.port}/metrics") as r:
                    assert r.status == 200
                    assert "gpusd_gpu_utilization_ratio" in await r.text()
        # every scrape came from this machine (one reader level): a build per sample at most, plus
        # the one the first scrape needed
        assert monitor.builds - builds0 <= samples - samples0 + 1
