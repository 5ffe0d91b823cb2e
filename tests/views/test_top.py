"""``gpusd top``: frames at several widths, sort and filter, vanished hosts, keys, and the CLI."""

from __future__ import annotations

import os
import re
import select
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from commandpaths import TOP, command_modules, gpusd_of
from gpusd.model import GpuInfo
from gpusd.thresholds import ThresholdEngine, parse_rule
from gpusd.views.live import split_keys
from gpusd.views.top import HostBook, HostView, TopState, arrange, render_text
from monitor_fakes import sim_host

ANSI = re.compile(r"\x1b\[[0-9;?]*[a-zA-Z]")


def fleet() -> list[HostView]:
    a = sim_host("gpu-node-1", "4xA100-80GB")
    b = sim_host("gpu-node-2", "2xH100-80GB,1xRTX4090")
    for i, u in enumerate([10.0, 95.0, 50.0, 0.0]):
        a.gpus[i].utilization_gpu = u
    b.gpus[0].utilization_gpu, b.gpus[1].utilization_gpu, b.gpus[2].utilization_gpu = 70.0, 20.0, None
    b.gpus[2].healthy, b.gpus[2].error = False, "GPU is lost"
    a.gpus[3].processes = []
    a.gpus[3].leases = []
    return [HostView(s.hostname, s.node_id, s) for s in (a, b)]


def gpu_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if re.match(r"^\s*\d+\s", ln)]


@pytest.mark.parametrize("width", [200, 140, 100, 72, 60, 40, 30])
def test_every_width_fits_and_shows_every_gpu(width):
    text = render_text(fleet(), width=width)
    lines = text.splitlines()
    assert max(len(ln) for ln in lines) <= width
    assert "gpu-node-1" in text and "gpu-node-2" in text
    assert len(gpu_lines(text)) == 7  # 4 + 3 GPUs, one line each
    assert "LOST" in text  # the lost GPU is called out at every width
    assert "95%" in text


def test_wide_frame_shows_processes_leases_model_and_bars():
    text = render_text(fleet(), width=200)
    assert "alice python" in text and "A100-SXM4-80GB" in text and "█" in text
    assert "[SIMULATED]" in text and "°C" in text and "/400W" in text
    assert "PROCESSES" in text and "LEASES" in text


def test_medium_frame_counts_instead_of_listing():
    text = render_text(fleet(), width=100)
    assert "alice" not in text and "P/L" in text
    row0 = gpu_lines(text)[0]
    assert row0.rstrip().endswith("1/1")  # GPU 0 of node 1: one process, one lease


def test_redacted_processes_show_pid_not_a_blank():
    views = fleet()
    p = views[0].snapshot.gpus[0].processes[0]
    p.user, p.command = None, None
    assert "pid 4242" in render_text(views, width=200)


def test_sort_by_utilisation_orders_hosts_and_gpus():
    state = TopState(sort="util")
    order = [(h.hostname, [g.index for g in gs]) for h, gs in arrange(fleet(), state)]
    assert order == [("gpu-node-1", [1, 2, 0, 3]), ("gpu-node-2", [0, 1, 2])]  # missing readings last
    state.reverse = True
    order = [(h.hostname, [g.index for g in gs]) for h, gs in arrange(fleet(), state)]
    assert order[0][0] == "gpu-node-2" and order[1][1] == [3, 0, 2, 1]


def test_filter_matches_host_model_user_and_lost():
    def shown(f: str) -> list[tuple[str, int]]:
        return [(h.hostname, g.index) for h, gs in arrange(fleet(), TopState(filter=f)) for g in gs]

    assert shown("rtx") == [("gpu-node-2", 2)]
    assert shown("alice") == [("gpu-node-1", 0), ("gpu-node-2", 0)]
    assert shown("node-1 #3") == [("gpu-node-1", 3)]
    assert shown("lost") == [("gpu-node-2", 2)]
    assert shown("nothing-like-this") == []
    assert "no hosts match the filter" in render_text(fleet(), TopState(filter="zzz"))


def test_keys_cycle_sort_and_edit_the_filter():
    s = TopState()
    for k in "ss":
        assert s.key(k)
    assert s.sort == "memory"
    s.key("S")
    assert s.sort == "util"
    s.key("/")
    for k in "a100":
        s.key(k)
    assert s.editing and s.active_filter == "a100" and s.filter == ""
    s.key("\x7f")
    s.key("\r")
    assert not s.editing and s.filter == "a10"
    s.key("\x1b")
    assert s.filter == ""
    s.key("r")
    assert s.reverse
    assert s.key("q") is False


def test_split_keys_understands_arrows_and_escape():
    assert split_keys("s\x1b[Bq") == ["s", "DOWN", "q"]
    assert split_keys("\x1b") == ["\x1b"]
    assert split_keys("\x1b[6~\x1b[99X") == ["PGDN"]


def test_a_vanished_host_is_marked_gone_then_dropped():
    book = HostBook(keep_gone=30)
    views = fleet()
    book.update(views, now=100)
    shown = book.update(views[:1], now=105)
    gone = [h for h in shown if h.hostname == "gpu-node-2"]
    assert gone and not gone[0].alive
    text = render_text(shown, width=120, now=105)
    assert "✖ gpu-node-2" in text and "gone 0s ago" in text
    assert "gone 20s ago" in render_text(book.update(views[:1], now=125), width=120, now=125)
    assert [h.hostname for h in book.update(views[:1], now=140)] == ["gpu-node-1"]


def test_alerts_from_local_rules_are_shown():
    book = HostBook(engine_factory=lambda: ThresholdEngine([parse_rule("busy: utilization>90")]))
    text = render_text(book.update(fleet()), width=200)
    [row] = [ln for ln in gpu_lines(text) if "95%" in ln]
    assert "⚠ busy" in row
    assert "⚠" in render_text(book.update(fleet()), width=60)


def test_empty_fleet():
    assert "no hosts found" in render_text([], width=80)


def test_gpu_without_readings():
    v = fleet()[:1]
    v[0].snapshot.gpus = [GpuInfo(index=0, uuid="GPU-x")]
    text = render_text(v, width=140)
    assert len(gpu_lines(text)) == 1


def cli(*args: str, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpusd", *args], capture_output=True, text=True, timeout=60,
                          check=False, **kw)


def test_cli_once_local_simulated():
    r = cli("top", "--once", "--local", "--simulate", "2xA100-80GB", "--width", "150", "--sort", "util")
    assert r.returncode == 0, r.stderr
    assert "SIMULATED" in r.stdout and len(gpu_lines(r.stdout)) == 2 and "sort utilisation" in r.stdout
    assert "\x1b[" not in r.stdout  # not a terminal: no colours


def test_cli_bad_input_is_one_line_and_exit_2():
    r = cli("top", "--once", "--local", "--simulate", "2xA100-80GB", "--threshold", "temperature>>9")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "bad threshold rule" in r.stderr
    r = cli("top", "--once", "--simulate", "2xA100-80GB")
    assert r.returncode == 2 and "--simulate needs --local" in r.stderr
    r = cli("top", "--once", "--url", "http://127.0.0.1:9")  # nothing listens on the discard port
    assert r.returncode == 6 and "cannot reach" in r.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs a pseudo-terminal")
def test_live_view_in_a_terminal_reacts_to_keys_and_quits():
    import fcntl
    import pty
    import termios

    pid, fd = pty.fork()
    if pid == 0:  # pragma: no cover - the child
        os.execvp(sys.executable, [sys.executable, "-m", "gpusd", "top", "--local", "--simulate",
                                   "4xA100-80GB,2xT4", "--interval", "0.3"])
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    out = bytearray()

    def pump(seconds: float, until: bytes | None = None) -> None:
        end = time.time() + seconds
        while time.time() < end:
            if until is not None and until in ANSI.sub("", out.decode("utf-8", "replace")).encode():
                return
            r, _, _ = select.select([fd], [], [], 0.05)
            if r:
                try:
                    out.extend(os.read(fd, 65536))
                except OSError:
                    return

    try:
        pump(20, until=b"A100")
        os.write(fd, b"s")
        pump(5, until=b"sort utilisation")
        os.write(fd, b"/T4\r")
        pump(5, until=b"filter: T4")
        screen = ANSI.sub("", out.decode("utf-8", "replace"))
        assert "sort utilisation" in screen and "filter: T4" in screen
        os.write(fd, b"q")
        pump(5)
        _, status = os.waitpid(pid, 0)
        pid = 0
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        if pid:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        os.close(fd)


def test_key_reader_stops_reading_when_the_terminal_goes_away():
    """A hung-up terminal must not turn the live loop into a busy loop."""
    import os
    import time

    from gpusd.views.live import KeyReader

    master, slave = os.openpty()
    with os.fdopen(slave, "r") as stream, KeyReader(stream) as keys:
        assert keys.interactive
        os.write(master, b"q")
        assert keys.read(1.0) == ["q"]
        os.close(master)  # the terminal goes away
        assert keys.read(0.2) == []
        t = time.monotonic()
        assert keys.read(0.3) == []
        assert time.monotonic() - t >= 0.25  # it waited instead of spinning on the dead descriptor


def test_a_local_top_imports_its_own_source_only(tmp_path: Path) -> None:
    """``gpusd top --local --once`` reads this machine's GPUs and imports what that source needs, not the
    fleet view's reader nor the browser (tests/commandpaths.py pins its set)."""
    rc, mods = command_modules(["top", "--local", "--once", "--simulate", "2xA100-80GB"],
                               dict(os.environ, GPUSD_STATE_DIR=str(tmp_path)))
    assert rc == "0"
    assert "gpusd.inventory.simulated" in mods and "gpusd.alloc.leases" in mods  # it did read GPUs and leases
    assert sorted(gpusd_of(mods) - TOP) == []
    assert "http.client" not in mods and "ssl" not in mods  # nothing is fetched over HTTP
