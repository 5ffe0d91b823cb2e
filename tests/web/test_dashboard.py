"""The web dashboard in headless Chromium.

The browser runs in a private network namespace with only ``lo`` when the tests run as root (the
page server listens inside it), otherwise with every non-loopback request blocked; DevTools talks
over a pipe.  Skipped when Chromium is not installed (``apt-get install chromium``).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from monitor_browser import (
    Browser,
    Netns,
    Page,
    can_netns,
    chromium_path,
    socket_in_netns,
)
from monitor_fakes import FakeDaemon, make_app, sim_host

pytestmark = pytest.mark.skipif(chromium_path() is None,
                                reason="chromium is not installed (apt-get install chromium); "
                                       "the dashboard is not tested in a browser")

TOKEN = "dashboard-token"


@contextlib.asynccontextmanager
async def dashboard(daemon: FakeDaemon, fragment: str = "", trust_loopback: bool = True
                    ) -> AsyncIterator[tuple[Page, Browser]]:
    """The fake daemon's dashboard open in a browser (which loads it over HTTP, as a user's would)."""
    ns = Netns() if can_netns() else None
    runner = web.AppRunner(make_app(daemon, trust_loopback=trust_loopback))
    browser = None
    try:
        await runner.setup()
        sock = socket_in_netns(ns.name if ns else None)
        await web.SockSite(runner, sock).start()
        browser = await Browser.start(netns=ns.name if ns else None)
        page = await browser.page(f"http://127.0.0.1:{sock.getsockname()[1]}/{fragment}")
        yield page, browser
    finally:
        if browser is not None:
            await browser.close()
        await runner.cleanup()
        if ns is not None:
            ns.close()


def two_hosts(**kw) -> FakeDaemon:
    return FakeDaemon([sim_host("gpu-node-1", "4xA100-80GB"), sim_host("gpu-node-2", "2xH100-80GB,1xRTX4090")], **kw)


def rows(node: str) -> str:
    return f"document.querySelectorAll('[data-node=\"{node}\"] tr.gpu')"


def cell(node: str, index: int, selector: str) -> str:
    return (f"(document.querySelector('[data-node=\"{node}\"] tr.gpu[data-index=\"{index}\"] {selector}') "
            f"|| {{}}).textContent")


async def test_shows_every_host_and_gpu_and_follows_load_changes():
    d = two_hosts()
    n1, n2 = list(d.hosts)
    async with dashboard(d) as (page, browser):
        await page.wait_for(f"{rows(n1)}.length === 4 && {rows(n2)}.length === 3", timeout=15)
        names = await page.evaluate("[...document.querySelectorAll('.host .name')].map(e => e.textContent)")
        assert names == ["gpu-node-1", "gpu-node-2"]
        models = await page.evaluate(f"[...{rows(n2)}].map(r => r.querySelector('.model').textContent)")
        assert models == ["H100 80GB HBM3", "H100 80GB HBM3", "RTX 4090"]  # one rule: gpusd.model.display_name
        summary = await page.evaluate("document.getElementById('summary').textContent")
        assert "2 hosts" in summary and "7 GPUs" in summary
        assert await page.evaluate("document.getElementById('status').textContent") == "live"

        d.set_gpu(n2, 1, utilization_gpu=97.0, memory_used=76 * 2**30)
        assert await page.wait_for(f"{cell(n2, 1, '.util-value')} === '97%'", timeout=5)
        assert await page.evaluate(cell(n2, 1, ".mem-value")) == "95%"
        # the sparkline now has a point
        assert await page.evaluate(f"document.querySelector('[data-node=\"{n2}\"] tr.gpu[data-index=\"1\"] "
                                   f"svg.spark polyline') !== null")
        assert browser.errors == []


async def test_free_count_is_the_daemons_not_a_rule_of_its_own():
    """A GPU without a utilisation reading is not free (null < 5 is true in JavaScript): the page
    counts the `free` flag the daemon sends (GpuInfo.is_free)."""
    d = two_hosts()
    n1, _ = list(d.hosts)
    d.set_gpu(n1, 0, utilization_gpu=0.0, processes=[], leases=[], healthy=True)  # free before the page opens
    expected = sum(g.is_free for s in d.hosts.values() for g in s.gpus)
    assert expected >= 1
    async with dashboard(d) as (page, browser):
        summary = "document.getElementById('summary').textContent"
        assert await page.wait_for(f"{summary}.includes('{expected} free')", timeout=15)
        d.set_gpu(n1, 0, utilization_gpu=None)
        assert await page.wait_for(f"{summary}.includes('{expected - 1} free')", timeout=5)
        assert browser.errors == []


async def test_host_gone_lost_gpu_and_threshold_alerts():
    d = two_hosts(thresholds=["hot: temperature>90"])
    n1, n2 = list(d.hosts)
    async with dashboard(d) as (page, browser):
        await page.wait_for(f"{rows(n2)}.length === 3", timeout=15)
        d.set_gpu(n1, 2, temperature=95)
        d.hosts[n1].timestamp += 1  # a new sample for the daemon's threshold engine
        text = await page.wait_for("!document.getElementById('alerts').hidden && "
                                   "document.getElementById('alert-list').textContent", timeout=5)
        assert "gpu-node-1 GPU 2" in text and "hot" in text
        assert await page.evaluate(f"document.querySelector('[data-node=\"{n1}\"] tr.gpu[data-index=\"2\"]')"
                                   f".classList.contains('alerting')")
        d.set_gpu(n1, 3, healthy=False, error="GPU is lost", utilization_gpu=None)
        lost = await page.wait_for(f"({cell(n1, 3, 'td:nth-child(3)')} || '').startsWith('LOST')", timeout=5)
        assert lost and "GPU is lost" in await page.evaluate(cell(n1, 3, "td:nth-child(3)"))
        d.remove_host(n2)
        assert await page.wait_for(f"document.querySelector('[data-node=\"{n2}\"]').classList.contains('gone')",
                                   timeout=5)
        assert "1 host " in await page.evaluate("document.getElementById('summary').textContent")
        assert browser.errors == []


@pytest.mark.parametrize("local", [False, True])
async def test_process_owners_only_for_readers_on_the_daemons_machine(local):
    """The page holds no secret (none may travel): owners show only where the daemon itself shows them
    to this browser -- on its own machine, under its own name."""
    d = two_hosts(token=TOKEN)
    n1, _ = list(d.hosts)
    async with dashboard(d, trust_loopback=local) as (page, browser):
        text = await page.wait_for(cell(n1, 0, ".plist"), timeout=15)
        if local:
            assert "alice python" in text
        else:
            assert "alice" not in text and "pid 4242" in text
        assert await page.evaluate("document.getElementById('token')") is None
        assert browser.errors == []


# -- end to end: real daemons in network namespaces (tests/netns.py), the browser in a third one ----

@pytest.mark.timeout(180)
async def test_dashboard_of_a_real_daemon_shows_the_lan_and_follows_load(tmp_path):
    import asyncio

    from fakenvml import make_gpus
    from netns import Lan, unavailable

    reason = unavailable()
    if reason:
        pytest.skip(reason)
    GiB = 2**30
    with Lan(workdir=tmp_path / "lan") as lan:
        h1 = lan.add_gpu_host("node-1", make_gpus(2, util_gpu=10, memory_used=8 * GiB), fast=True)
        # node-2 is hot before anyone looks: the dashboard learns it from node-2's /api/v1/alerts
        h2 = lan.add_gpu_host("node-2", make_gpus(1, model="NVIDIA H100 80GB HBM3", util_gpu=5, temperature=88),
                              fast=True, args=["--threshold", "hot: temperature>80"])
        client = lan.add_node("client")
        await asyncio.gather(*(asyncio.to_thread(h.start) for h in (h1, h2)))
        browser = await Browser.start(netns=client.ns)
        try:
            page = await browser.page(f"http://{h1.ip}:4780/")
            names = await page.wait_for(
                "(() => { const n = [...document.querySelectorAll('.host .name')].map(e => e.textContent);"
                " return document.querySelectorAll('tr.gpu').length === 3 && n.length === 2 ? n : null })()",
                timeout=20)
            assert names == ["node-1", "node-2"]
            models = await page.evaluate("[...document.querySelectorAll('tr.gpu .model')].map(e => e.textContent)")
            assert models == ["A100-SXM4-80GB", "A100-SXM4-80GB", "H100 80GB HBM3"]
            alert = await page.wait_for("document.getElementById('alert-list').textContent", timeout=10)
            assert "node-2 GPU 0 temperature 88 C > 80 C" in alert and "hot" in alert

            # a load change on node-2 (a daemon the browser never talks to) shows within seconds
            h2.gpus[0].memory_used = 60 * GiB
            h2.gpus[0].util_gpu = 95
            t = asyncio.get_running_loop().time()
            mem = "(document.querySelector('[data-hostname=\"node-2\"] tr.gpu .mem-value') || {}).textContent"
            await asyncio.to_thread(h2.write)
            assert await page.wait_for(f"{mem} === '75%'", timeout=5)
            print(f"\nload change -> dashboard: {(asyncio.get_running_loop().time() - t) * 1000:.0f} ms")
            util = ("parseInt((document.querySelector('[data-hostname=\"node-2\"] tr.gpu .util-value') "
                    "|| {}).textContent)")
            assert await page.wait_for(f"{util} > 50", timeout=10)  # NVML utilisation is a window average

            # node-2 stops: its card is marked gone
            await asyncio.to_thread(h2.stop)
            assert await page.wait_for("document.querySelector('[data-hostname=\"node-2\"]')"
                                       ".classList.contains('gone')", timeout=10)
            assert browser.errors == []
        finally:
            await browser.close()


# -- hostile hosts: one bad host never takes the page down (issue 9, finding 9) -----------------------

HUGE = "N" * 100_000
XSS = '<img src=x onerror="window.pwned=1">[/bold]x\u202e'


def hostile_entries(d: FakeDaemon) -> list[object]:
    """Fleet entries a stranger on the LAN (or a broken daemon) could make a daemon relay."""
    evil = sim_host("evil-host", "2xA100-80GB").to_dict()
    evil["hostname"] = XSS + HUGE
    g0, g1 = evil["gpus"]
    g0["name"] = XSS + HUGE
    g0["utilization_gpu"] = float("nan")  # json.dumps writes NaN, which JSON.parse refuses
    g0["memory_used"] = float("inf")
    g0["processes"] = [{"pid": 1, "user": XSS, "command": HUGE}]
    g1["temperature"] = "hot"
    return [
        {"node_id": "evil", "hostname": XSS + HUGE, "alive": True, "snapshot": evil},
        None,
        {"node_id": 12345, "hostname": {"x": 1}, "snapshot": {"gpus": {"not": "a list"}}},
        {"node_id": "strings", "hostname": "strings", "snapshot": {"hostname": "strings", "gpus": ["a", 7, None]}},
        {"node_id": "nogpus", "snapshot": "not an object"},
    ]


async def test_hostile_hosts_do_not_hide_the_good_ones():
    d = two_hosts()
    n1, n2 = list(d.hosts)
    d.extra = hostile_entries(d)
    async with dashboard(d) as (page, browser):
        await page.wait_for(f"{rows(n1)}.length === 4 && {rows(n2)}.length === 3", timeout=15)
        assert await page.evaluate("document.getElementById('status').textContent") == "live"
        models = await page.evaluate(f"[...{rows(n2)}].map(r => r.querySelector('.model').textContent)")
        assert models == ["H100 80GB HBM3", "H100 80GB HBM3", "RTX 4090"]  # gpusd.model.display_name
        # the hostile host is shown, as text, bounded, with its bad readings as "-"
        evil = await page.wait_for("(() => { const c = document.querySelector('[data-node=\"evil\"]');"
                                   " return c && {name: c.querySelector('.name').textContent,"
                                   " models: [...c.querySelectorAll('.model')].map(e => e.textContent),"
                                   " util: c.querySelector('.util-value').textContent,"
                                   " plist: c.querySelector('.plist').textContent} })()", timeout=5)
        assert evil["name"].startswith("<img src=x") and len(evil["name"]) <= 64
        assert evil["models"][0].startswith("<img") and len(evil["models"][0]) <= 64
        assert evil["util"] == "-"
        assert len(evil["plist"]) < 300
        assert await page.evaluate("document.querySelectorAll('img').length") == 0
        assert await page.evaluate("window.pwned === undefined")
        assert await page.evaluate("document.body.textContent.length") < 20_000
        # and the page still follows the good hosts
        d.set_gpu(n2, 1, utilization_gpu=97.0)
        assert await page.wait_for(f"{cell(n2, 1, '.util-value')} === '97%'", timeout=5)
        assert browser.errors == []


async def test_a_malformed_event_does_not_freeze_the_page():
    d = two_hosts()
    n1, n2 = list(d.hosts)
    async with dashboard(d) as (page, browser):
        await page.wait_for(f"{rows(n2)}.length === 3", timeout=15)
        d.broadcast("host_added", {"node_id": "bad", "hostname": "bad", "snapshot": {"gpus": {"a": 1}}})
        d.broadcast("device_updated", {"node_id": n1, "hostname": "gpu-node-1", "gpu": "not a gpu"})
        d.broadcast("host_added", {"node_id": "bad2", "hostname": 7, "snapshot": {"gpus": [{"index": "x"}]}})
        d.set_gpu(n2, 0, utilization_gpu=88.0)
        assert await page.wait_for(f"{cell(n2, 0, '.util-value')} === '88%'", timeout=5)
        assert await page.evaluate(f"{rows(n1)}.length") == 4
        assert browser.errors == []


def topo(node: str) -> str:
    return (f"[...document.querySelectorAll('[data-node=\"{node}\"] table.topo tr')]"
            ".map(r => [...r.children].map(c => c.textContent))")


async def test_each_host_shows_its_topology_as_nvidia_smi_does():
    """Issue 22: a host card has its GPU matrix (NV#, PIX, PXB, PHB, NODE, SYS), CPU and NUMA affinity;
    it stays open across redraws; hostile links are shown as N/A, never as markup."""
    pairs = sim_host("gpu-node-1", "4xA6000")
    evil = sim_host("evil-host", "2xL40S").to_dict()
    for g in evil["gpus"]:  # links, as a daemon before 0.4 sends them
        g.pop("topology", None)
    evil["gpus"][0]["links"] = [{"peer": 1, "level": 10, "nvlink": XSS}, {"peer": "1"}, "x", None]
    evil["gpus"][0]["local_cpus"] = XSS
    evil["gpus"][1]["links"] = [{"peer": 0, "level": 99}]
    d = FakeDaemon([pairs])
    d.extra = [{"node_id": "evil", "hostname": "evil-host", "alive": True, "snapshot": evil}]
    n1 = list(d.hosts)[0]
    async with dashboard(d) as (page, browser):
        await page.wait_for(f"{rows(n1)}.length === 4", timeout=15)
        matrix = await page.evaluate(topo(n1))
        assert matrix[0] == ["", "GPU0", "GPU1", "GPU2", "GPU3", "CPU Affinity", "NUMA Affinity"]
        assert matrix[1] == ["GPU0", "X", "NV4", "SYS", "SYS", "0-31", "0"]
        assert matrix[3] == ["GPU2", "SYS", "SYS", "X", "NV4", "32-63", "1"]
        summary = f"document.querySelector('[data-node=\"{n1}\"] details.topology summary')"
        assert "NVLink" in await page.evaluate(f"{summary}.textContent")
        await page.evaluate(f"{summary}.click()")
        d.set_gpu(n1, 1, utilization_gpu=91.0)  # a redraw
        assert await page.wait_for(f"{cell(n1, 1, '.util-value')} === '91%'", timeout=5)
        assert await page.evaluate(f"document.querySelector('[data-node=\"{n1}\"] details.topology').open")
        bad = await page.wait_for(f"(() => {{ const m = {topo('evil')}; return m.length === 3 && m; }})()", timeout=5)
        assert bad[1] == ["GPU0", "X", "PIX", "N/A", "0"]  # its bad NVLink count is none, its CPU list N/A
        assert bad[2] == ["GPU1", "N/A", "X", "0-31", "0"]  # a level NVML never gives: N/A
        assert await page.evaluate("document.querySelectorAll('img').length") == 0
        assert await page.evaluate("window.pwned === undefined")


async def test_model_names_are_shown_whole_so_80gb_and_40gb_differ():
    """Issue 18, item 16: a model cell cut with an ellipsis made A100-SXM4-80GB and A100-SXM4-40GB look
    the same; the whole name is on screen (wrapped where it must be)."""
    d = FakeDaemon([sim_host("gpu-node-1", "1xA100-80GB,1xA100-40GB,1xH100-80GB")])
    (n1,) = list(d.hosts)
    async with dashboard(d) as (page, browser):
        await page.wait_for(f"{rows(n1)}.length === 3", timeout=15)
        cells = await page.evaluate(f"[...{rows(n1)}].map(r => {{ const c = r.querySelector('.model'); "
                                    "return [c.textContent, c.scrollWidth <= c.clientWidth + 1]; })")
        assert [t for t, _ in cells] == ["A100-SXM4-80GB", "A100-SXM4-40GB", "H100 80GB HBM3"]
        assert all(whole for _, whole in cells), cells  # nothing hidden behind an ellipsis
        assert browser.errors == []


async def test_an_unleased_process_is_shown_as_unleased():
    """Issue 20: a GPU process no gpusd lease covers is marked in the processes column."""
    from gpusd.model import ProcessInfo

    d = two_hosts()
    n1, _ = list(d.hosts)
    async with dashboard(d) as (page, browser):
        await page.wait_for(f"{rows(n1)}.length === 4", timeout=15)
        d.set_gpu(n1, 0, processes=[ProcessInfo(pid=4242, user="mallory", command="/usr/bin/python train.py",
                                                unleased=True)])
        d.set_gpu(n1, 1, processes=[ProcessInfo(pid=4243, user="alice", command="train.py")])
        assert await page.wait_for(f"{cell(n1, 0, '.plist')}.startsWith('mallory python unleased')", timeout=5)
        assert await page.wait_for(f"{cell(n1, 1, '.plist')}.startsWith('alice train.py')", timeout=5)
        assert "unleased" not in await page.evaluate(cell(n1, 1, '.plist'))
        assert browser.errors == []


async def test_a_hosts_bookings_show_on_a_timeline_of_the_next_24_hours():
    import time

    from gpusd.model import BookingInfo

    d = two_hosts()
    n1, n2 = list(d.hosts)
    now = time.time()
    d.hosts[n1].bookings = [
        BookingInfo("aaaaaaaaaaaa", now + 6 * 3600, now + 8 * 3600, [0, 1], "alice<img src=x onerror=alert(1)>"),
        BookingInfo("bbbbbbbbbbbb", now - 60, now + 600, [3], "bob", held=True),
        BookingInfo("cccccccccccc", now + 30 * 3600, now + 31 * 3600, [2], "carol")]  # beyond 24 h: not shown
    async with dashboard(d) as (page, browser):
        bars = f"[...document.querySelectorAll('[data-node=\"{n1}\"] .timeline .booking')]"
        await page.wait_for(f"{bars}.length === 2", timeout=15)
        ids = await page.evaluate(f"{bars}.map(b => b.dataset.booking)")
        assert ids == ["bbbbbbbbbbbb", "aaaaaaaaaaaa"]  # soonest first
        texts = await page.evaluate(f"{bars}.map(b => b.textContent)")
        assert texts[0].startswith("GPU 3 ") and texts[0].endswith("(held)")
        assert texts[1].startswith("GPU 0,1 ") and "alice<img" in texts[1]  # text, never markup
        assert await page.evaluate("document.querySelectorAll('.timeline img').length") == 0
        left = await page.evaluate(f"{bars}.map(b => parseFloat(b.style.left))")
        assert left[0] == 0 and 24 < left[1] < 26  # 6 h of 24
        assert await page.evaluate(f"document.querySelectorAll('[data-node=\"{n2}\"] .timeline').length") == 0
