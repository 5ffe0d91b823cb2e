"""`gpusd top`'s rough edges (issue 18, item 16): `--once` prints no key footer, `/` starts a new
filter, Esc closes the help, and a frame taller than the terminal says that more rows are below."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time

import pytest

from gpusd.views.top import HostView, TopState, render_text
from monitor_fakes import sim_host
from tests_paths import SRC


def hosts() -> list[HostView]:
    s = sim_host("gpu-node-1", "4xA100-80GB")
    return [HostView(s.hostname, s.node_id, s)]


def test_once_prints_no_interactive_keys() -> None:
    text = render_text(hosts(), TopState(), width=150)
    assert "sort host" in text
    assert "q quit" not in text and "h help" not in text and "/ filter" not in text


def test_slash_starts_a_new_filter_and_escape_keeps_the_old_one() -> None:
    s = TopState(filter="A100")
    s.key("/")
    assert s.editing and s.draft == "" and s.active_filter == ""
    for k in "T4":
        s.key(k)
    s.key("\r")
    assert s.filter == "T4"  # not "A100T4"
    s.key("/")
    s.key("x")
    s.key("\x1b")  # cancel: the filter in force stays
    assert not s.editing and s.filter == "T4"


def test_escape_closes_the_help_before_it_clears_the_filter() -> None:
    s = TopState(filter="T4")
    s.key("h")
    assert s.help
    s.key("\x1b")
    assert not s.help and s.filter == "T4"
    s.key("\x1b")
    assert s.filter == ""


def test_a_cropped_frame_says_more_rows_are_below_and_above() -> None:
    from rich.console import Console
    from rich.text import Text

    from gpusd.views.live import crop

    console = Console(width=80, force_terminal=False, no_color=True)
    frame = Text("\n".join(f"row {i}" for i in range(20)))
    view, offset = crop(console, frame, Text("footer"), 0, 8)
    with console.capture() as cap:
        console.print(view)
    lines = cap.get().splitlines()
    assert len(lines) == 8 and lines[-1] == "footer"
    assert "more line(s) below" in lines[-2] and "14 more" in lines[-2], lines
    view, offset = crop(console, frame, Text("footer"), 5, 8)
    with console.capture() as cap:
        console.print(view)
    lines = cap.get().splitlines()
    assert "more line(s) above" in lines[0] and "more line(s) below" in lines[-2], lines
    view, offset = crop(console, frame, Text("footer"), 99, 8)  # scrolled to the end: the last row shows
    with console.capture() as cap:
        console.print(view)
    lines = cap.get().splitlines()
    assert lines[-2] == "row 19" and "above" in lines[0]


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (apt-get install tmux)")
def test_an_8_row_terminal_shows_that_more_rows_are_below() -> None:
    """The screen as a user sees it (tmux draws what top writes; capture-pane reads it back)."""
    name = f"gpusd-top-{os.getpid()}"
    cmd = shlex.join([sys.executable, "-m", "gpusd", "top", "--local", "--simulate", "4xA100-80GB,2xT4",
                      "--interval", "0.3"])
    env = dict(os.environ, PYTHONPATH=str(SRC))
    subprocess.run(["tmux", "new-session", "-d", "-s", name, "-x", "120", "-y", "8", cmd], env=env, check=True)
    try:
        screen = ""
        end = time.time() + 30
        while time.time() < end and "more line(s) below" not in screen:
            time.sleep(0.3)
            screen = subprocess.run(["tmux", "capture-pane", "-p", "-t", name], capture_output=True,
                                    text=True).stdout
        lines = screen.rstrip("\n").splitlines()
        assert "more line(s) below" in lines[-2], screen
        assert "q quit" in lines[-1], screen  # the key line stays at the bottom
        subprocess.run(["tmux", "send-keys", "-t", name, "j"], check=True)
        time.sleep(1.5)
        screen = subprocess.run(["tmux", "capture-pane", "-p", "-t", name], capture_output=True, text=True).stdout
        assert "more line(s) above" in screen, screen
        subprocess.run(["tmux", "send-keys", "-t", name, "q"], check=True)
        end = time.time() + 10
        while time.time() < end and subprocess.run(["tmux", "has-session", "-t", name],
                                                   capture_output=True).returncode == 0:
            time.sleep(0.2)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", name], capture_output=True)
