"""The history charts in headless Chromium: the dashboard's (uPlot, from the daemon's history
endpoints) and the HTML report's.  A chart counts as drawn when its canvas holds pixels of the
series' colour, not just axes.  With $GPUSD_SCREENSHOTS=DIR the screenshots are also saved there
(docs/img/ for the README)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from gpusd.cli import main
from gpusd.daemon.config import DaemonConfig
from gpusd.daemon.recording import Recording
from gpusd.daemon.recording import install as install_recording
from gpusd.model import HostSnapshot, LeaseInfo
from history_helpers import HOUR, record_scenario
from monitor_browser import Browser, Netns, Page, can_netns, chromium_path, socket_in_netns
from monitor_fakes import FakeDaemon, make_app, sim_host

pytestmark = pytest.mark.skipif(chromium_path() is None, reason="chromium is not installed")

TOKEN = "history-browser-fleet-secret"  # the daemon's fleet secret: the page never holds it
NOW = time.time() // 10 * 10
UTIL_RGB = (74, 163, 255)  # the dashboard's utilisation stroke, #4aa3ff


def colour_pixels(selector: str, rgb: tuple[int, int, int]) -> str:
    """JavaScript: how many pixels of the canvases matching ``selector`` are (close to) ``rgb``."""
    r, g, b = rgb
    return f"""(() => {{ let n = 0;
      for (const c of document.querySelectorAll({selector!r})) {{
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        for (let i = 0; i < d.length; i += 4)
          if (d[i+3] > 200 && Math.abs(d[i]-{r}) < 40 && Math.abs(d[i+1]-{g}) < 40 && Math.abs(d[i+2]-{b}) < 40) n++;
      }}
      return n; }})()"""


class Adapter:
    """What daemon/recording.py needs, around the monitoring tests' fake daemon."""

    def __init__(self, fake: FakeDaemon, db: Path) -> None:
        self.fake = fake
        self.config = DaemonConfig(interval=10.0, history_db=db, idle_after=600)
        self.state_dir = db.parent
        self.hostname = fake.hosts[fake.local].hostname
        self.node_id = fake.local
        self.on_sample: list[Any] = []

    def publish(self, event: str, data: Any) -> None:
        self.fake.published.append((event, data))


@contextlib.asynccontextmanager
async def dashboard(tmp: Path, local: bool, fragment: str = "", hours: float = 6.0
                    ) -> AsyncIterator[tuple[Page, Browser, FakeDaemon, Recording]]:
    """The dashboard of a daemon with history, open in a browser.  ``local``: the browser counts as on
    the daemon's own machine (a loopback reader naming the daemon: it sees private fields); else as
    a reader on another machine (the page holds no secret, so it sees aggregates only)."""
    db = tmp / "history.sqlite"
    record_scenario(db, hours=hours, interval=10.0, t0=NOW - hours * HOUR)
    fake = FakeDaemon([sim_host("lab-node-1", "4xA100-80GB"), sim_host("lab-node-2", "2xH100-80GB")], token=TOKEN)
    app = make_app(fake, trust_loopback=local)
    rec = install_recording(app, Adapter(fake, db))
    ns = Netns() if can_netns() else None
    runner = web.AppRunner(app)
    browser = None
    try:
        await runner.setup()
        sock = socket_in_netns(ns.name if ns else None)
        await web.SockSite(runner, sock).start()
        origin = f"http://127.0.0.1:{sock.getsockname()[1]}"
        plain_fleet = fake.fleet

        def fleet() -> dict[str, Any]:  # this daemon's own entry carries its URL, as a real one's does
            out = plain_fleet()
            out["hosts"][0]["url"] = origin + "/api/v1"
            return out

        fake.fleet = fleet  # type: ignore[method-assign]
        browser = await Browser.start(netns=ns.name if ns else None)
        page = await browser.page(f"{origin}/{fragment}", width=1280, height=1100)
        yield page, browser, fake, rec
    finally:
        if browser is not None:
            await browser.close()
        await runner.cleanup()
        if ns is not None:
            ns.close()


def idle_lease(fake: FakeDaemon, rec: Recording, index: int = 2) -> None:
    """Carol holds GPU ``index`` at 0 % for longer than the idle limit."""
    snap = fake.hosts[fake.local]
    g = snap.gpu(index)
    fake.set_gpu(fake.local, index, utilization_gpu=0.0, processes=[],
                 leases=[LeaseInfo(lease_id="res1", pid=99, user="carol", device=g.uuid)])
    for dt in (0.0, 700.0):
        s: HostSnapshot = copy.deepcopy(snap)
        s.timestamp = NOW + dt
        rec.watch.update(s)


async def test_dashboard_history_chart_ranges_usage_and_idle_mark(tmp_path):
    """On the daemon's own machine: the chart, the per-user usage and the idle mark."""
    shots = os.environ.get("GPUSD_SCREENSHOTS")
    async with dashboard(tmp_path, local=True) as (page, browser, fake, rec):
        idle_lease(fake, rec)
        await page.wait_for("!!(window.gpusdHistory && window.gpusdHistory.chart)", timeout=20)
        # GPU 1 (bob's: 60 % for three of every six hours) over six hours
        await page.evaluate("document.querySelector('#hist-ranges button[data-range=\"6h\"]').click()")
        await page.evaluate("document.querySelector('tr.gpu[data-index=\"1\"]').click()")
        assert await page.wait_for("document.getElementById('hist-gpu').selectedIndex === 1", timeout=5)
        assert await page.wait_for(f"{colour_pixels('#hist-chart canvas', UTIL_RGB)} > 200", timeout=10)
        # per-user usage over the range: a reader on the daemon's own machine sees names
        users = await page.wait_for("[...document.querySelectorAll('#usage-body tr td:first-child')]"
                                    ".map(e => e.textContent).sort().join(',')", timeout=10)
        assert users == "alice,bob,carol"
        # the idle reservation's GPU is marked
        assert await page.wait_for("document.querySelector('tr.gpu.idle-held[data-index=\"2\"] .idle-tag')"
                                   " !== null", timeout=20)
        # 30 days come from the hourly tier
        await page.evaluate("document.querySelector('#hist-ranges button[data-range=\"30d\"]').click()")
        assert await page.wait_for("document.getElementById('hist-status').textContent.startsWith('hourly')",
                                   timeout=10)
        assert await page.wait_for(f"{colour_pixels('#hist-chart canvas', UTIL_RGB)} > 50", timeout=10)
        await page.evaluate("document.querySelector('#hist-ranges button[data-range=\"6h\"]').click()")
        await page.wait_for("document.getElementById('hist-status').textContent.startsWith('fine')", timeout=10)
        if shots:
            await asyncio.sleep(1.0)
            await page.evaluate("document.getElementById('history').scrollIntoView()")
            await page.screenshot(Path(shots) / "history-dashboard.png")
        assert browser.errors == []


async def test_dashboard_usage_from_another_machine_shows_aggregates_only(tmp_path):
    """A reader not on the daemon's machine: GPU-hours for all users together, no names, no owner on
    the idle mark; the page sends no credential (it has none) and says where per-user figures are."""
    async with dashboard(tmp_path, local=False) as (page, browser, fake, rec):
        await page.wait_for("document.querySelectorAll('#hist-ranges button').length === 5", timeout=20)
        await page.evaluate("document.querySelector('#hist-ranges button[data-range=\"6h\"]').click()")
        text = await page.wait_for("document.getElementById('usage-body').textContent", timeout=20)
        assert "all users" in text
        for name in ("alice", "bob", "carol"):
            assert name not in text
        assert "daemon's own machine" in await page.evaluate("document.getElementById('usage-note').textContent")
        idle_lease(fake, rec)
        await page.wait_for("document.querySelector('tr.gpu.idle-held') !== null", timeout=20)
        assert "carol" not in await page.evaluate("document.body.textContent")
        assert browser.errors == []


async def test_html_report_is_self_contained_and_draws_its_charts(tmp_path, capsys):
    db = tmp_path / "history.sqlite"
    t0 = 6 * 3600.0 * 83334
    record_scenario(db, hours=6.0, interval=10.0, t0=t0)
    out = tmp_path / "report.html"
    assert main(["report", "--db", str(db), "--from", str(t0), "--to", str(t0 + 6 * HOUR + 10), "--format", "html",
                 "-o", str(out)]) == 0
    html = out.read_text()
    assert "http://" not in html.split("<script")[0] and "src=" not in html  # nothing to fetch
    assert "carol" in html and "Idle reservations" in html and "MIT" in html
    ns = Netns() if can_netns() else None
    browser = await Browser.start(netns=ns.name if ns else None)
    try:
        page = await browser.page(out.as_uri(), width=1100, height=1300)
        assert await page.wait_for("!!window.reportCharts && window.reportCharts.length === 2", timeout=15)
        # the timeline's line (#2b6cb0) and the usage bars (used #2b6cb0, held #b7791f, idle #c53030)
        assert await page.evaluate(colour_pixels("#timeline canvas", (0x2b, 0x6c, 0xb0))) > 200
        assert await page.evaluate(colour_pixels("#usage canvas", (0xb7, 0x79, 0x1f))) > 200
        assert await page.evaluate(colour_pixels("#usage canvas", (0xc5, 0x30, 0x30))) > 200
        shots = os.environ.get("GPUSD_SCREENSHOTS")
        if shots:
            await page.screenshot(Path(shots) / "history-report.png")
        assert browser.errors == []
    finally:
        await browser.close()
        if ns is not None:
            ns.close()


async def test_a_new_daemons_long_range_chart_spans_the_range_asked(tmp_path):
    """Issue 18, item 9: a daemon with 30 s of history, charted over 7 and 30 days: the x axis is the
    answer's from/to (the week or month before now), not a range uPlot makes up around a few points."""
    async with dashboard(tmp_path, local=True, hours=30 / HOUR) as (page, browser, fake, rec):
        await page.wait_for("!!(window.gpusdHistory && window.gpusdHistory.chart)", timeout=20)
        for name, secs in (("7d", 7 * 86400), ("30d", 30 * 86400)):
            await page.evaluate(f"document.querySelector('#hist-ranges button[data-range=\"{name}\"]').click()")
            await page.wait_for(f"document.getElementById('hist-status').textContent.includes('every') && "
                                f"window.gpusdHistory.chart && window.gpusdHistory.chart.scales.x.max - "
                                f"window.gpusdHistory.chart.scales.x.min > {secs / 2}", timeout=10)
            lo, hi = await page.evaluate("[window.gpusdHistory.chart.scales.x.min, "
                                         "window.gpusdHistory.chart.scales.x.max]")
            now = time.time()
            assert abs(hi - now) < 600 and abs((hi - lo) - secs) < 3600, (name, lo, hi, now)
        assert browser.errors == []


async def test_a_short_report_draws_its_usage_above_a_tiny_axis(tmp_path, capsys):
    """Minutes of GPU use: the usage chart's y axis fits them (it used to start at 0-1 GPU-hours)."""
    db = tmp_path / "history.sqlite"
    t0 = 6 * 3600.0 * 83334
    record_scenario(db, hours=0.1, interval=10.0, t0=t0)
    out = tmp_path / "report.html"
    assert main(["report", "--db", str(db), "--from", str(t0), "--to", str(t0 + 360), "--format", "html",
                 "-o", str(out)]) == 0
    ns = Netns() if can_netns() else None
    browser = await Browser.start(netns=ns.name if ns else None)
    try:
        page = await browser.page(out.as_uri(), width=1100, height=1300)
        assert await page.wait_for("!!window.reportCharts && window.reportCharts.length === 2", timeout=15)
        ymax = await page.evaluate("window.reportCharts[1].scales.y.max")
        assert 0 < ymax < 0.5, ymax  # 0.1 h of use at most, per row
        lo, hi = await page.evaluate("[window.reportCharts[0].scales.x.min, window.reportCharts[0].scales.x.max]")
        assert abs(lo - t0) < 20 and abs(hi - (t0 + 360)) < 20, (lo, hi)
        assert browser.errors == []
    finally:
        await browser.close()
        if ns is not None:
            ns.close()
