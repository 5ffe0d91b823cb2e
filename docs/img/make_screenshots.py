"""Make docs/img/gpusd-top.png and docs/img/dashboard.png from a simulated fleet.

    sudo python docs/img/make_screenshots.py [--watch 150]

Runs itself again inside a new network namespace with only ``lo`` (nothing can leave it), starts
three real daemons there on simulated GPUs (scenario files below, thresholds on), lets the dashboard
watch them for ``--watch`` seconds so its charts have a history, then takes both screenshots with
headless Chromium (``apt-get install chromium``).  ``gpusd top`` is rendered with rich
(``Console.save_svg``) and turned into a PNG by the same browser.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "src"))

SCENARIOS = {
    "dgx-a100-01": [
        {"model": "A100-80GB", "util": {"min": 70, "max": 99, "period": 50}, "memory_used": {"min": "60GiB", "max": "74GiB", "period": 80},
         "processes": [{"pid": 31337, "memory": "62GiB", "user": "alice", "command": "python train.py --model llama-7b"}]},
        {"model": "A100-80GB", "util": {"min": 55, "max": 95, "period": 35}, "memory_used": {"min": "40GiB", "max": "52GiB", "period": 60},
         "processes": [{"pid": 31338, "memory": "44GiB", "user": "alice", "command": "python train.py --model llama-7b"}]},
        {"model": "A100-80GB", "util": {"min": 0, "max": 30, "period": 45}, "memory_used": {"min": "2GiB", "max": "18GiB", "period": 70},
         "processes": [{"pid": 2201, "memory": "9GiB", "user": "bob", "command": "jupyter-kernel"}]},
        {"model": "A100-80GB", "util": 0, "memory_used": "0GiB"},
    ],
    "h100-node-02": [
        {"model": "H100-80GB", "util": {"min": 93, "max": 100, "period": 40}, "memory_used": "77GiB", "temperature": {"min": 86, "max": 89, "period": 60},
         "processes": [{"pid": 9001, "memory": "76GiB", "user": "carol", "command": "torchrun --nproc 2 pretrain.py"}]},
        {"model": "H100-80GB", "util": {"min": 88, "max": 99, "period": 30}, "memory_used": "75GiB",
         "processes": [{"pid": 9002, "memory": "74GiB", "user": "carol", "command": "torchrun --nproc 2 pretrain.py"}]},
    ],
    "ws-rtx-03": [
        {"model": "RTX4090", "util": {"steps": [5, 60, 35, 80, 10], "every": 20}, "memory_used": {"min": "3GiB", "max": "16GiB", "period": 55},
         "processes": [{"pid": 4242, "memory": "8GiB", "user": "dave", "command": "python infer.py"}]},
        {"model": "RTX3090", "lost": True},
    ],
}
THRESHOLDS = ["hot: temperature>85", "busy: utilization>90 for 30s", "lost", "memory>95%"]


def outer(args: argparse.Namespace) -> int:
    """Re-run inside a fresh network namespace (root) whose only interface is lo."""
    cmd = f"ip link set lo up && exec {sys.executable} {Path(__file__).resolve()} --inner --watch {args.watch}"
    return subprocess.call(["unshare", "--net", "sh", "-c", cmd])


def start_daemons(tmp: Path) -> list[subprocess.Popen[bytes]]:
    procs = []
    env = dict(os.environ, GPUSD_INTERFACES="127.0.0.1", PYTHONPATH=str(REPO / "src"))
    for i, (host, gpus) in enumerate(SCENARIOS.items()):
        scenario = tmp / f"{host}.json"
        scenario.write_text(json.dumps({"hostname": host, "gpus": gpus}))
        state = tmp / f"state-{host}"
        state.mkdir()
        argv = [sys.executable, "-m", "gpusd", "start", "--foreground", "--interface", "127.0.0.1",
                "--port", str(4780 + i), "--hostname", host, "--state-dir", str(state), "--simulate", str(scenario)]
        for rule in THRESHOLDS:
            argv += ["--threshold", rule]
        with open(tmp / f"{host}.log", "ab") as log:
            procs.append(subprocess.Popen(argv, env=dict(env, GPUSD_STATE_DIR=str(state)), stdout=log, stderr=log))
    return procs


def render_top(svg: Path) -> tuple[int, int]:
    from rich.console import Console

    from gpusd.views.sources import DiscoverySource
    from gpusd.thresholds import ThresholdEngine, load_rules
    from gpusd.views.top import HostBook, TopState, render

    rules = load_rules(["hot: temperature>85", "lost"])
    book = HostBook(engine_factory=lambda: ThresholdEngine(rules))
    src = DiscoverySource(settle=4.0, interfaces=["127.0.0.1"])
    try:
        views = book.update(src.hosts())
        time.sleep(1.0)
        views = book.update(src.hosts())
    finally:
        src.close()
    width = 150
    console = Console(record=True, width=width, force_terminal=True, color_system="truecolor", file=io.StringIO())
    console.print(render(views, TopState(sort="host"), width=width))
    console.save_svg(str(svg), title="gpusd top")
    lines = console.export_text(clear=False).count("\n") + 1
    return width, lines


async def shoot(args: argparse.Namespace) -> None:
    from monitor_browser import Browser

    tmp = Path(tempfile.mkdtemp(prefix="gpusd-shots-"))
    procs = start_daemons(tmp)
    try:
        await asyncio.sleep(6)  # probing, announcing, first samples
        browser = await Browser.start(netns=None, width=1400, height=940)
        try:
            page = await browser.page("http://127.0.0.1:4780/", 1400, 940)
            await page.wait_for("document.querySelectorAll('tr.gpu').length === 8", timeout=30)
            print(f"dashboard up; watching the fleet for {args.watch:.0f} s", flush=True)
            await asyncio.sleep(args.watch)
            await page.screenshot(HERE / "dashboard.png")
            print("wrote", HERE / "dashboard.png")

            svg = tmp / "top.svg"
            await asyncio.to_thread(render_top, svg)
            top = await browser.page(svg.as_uri(), 1000, 400)
            await asyncio.sleep(1.0)
            w, h = await top.evaluate("(() => { const v = document.querySelector('svg').viewBox.baseVal;"
                                      " return [Math.ceil(v.width), Math.ceil(v.height)] })()")
            await top.call("Emulation.setDeviceMetricsOverride",
                           {"width": w, "height": h, "deviceScaleFactor": 1, "mobile": False})
            await asyncio.sleep(0.5)
            await top.screenshot(HERE / "gpusd-top.png")
            print("wrote", HERE / "gpusd-top.png")
            if browser.errors:
                print("browser errors:", browser.errors)
        finally:
            await browser.close()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--watch", type=float, default=150.0, help="seconds the dashboard watches before the shot")
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not args.inner:
        return outer(args)
    asyncio.run(shoot(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
