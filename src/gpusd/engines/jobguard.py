"""The host-side guard of one host's part of a ``gpusd launch`` job: every process it starts ends with it.

``python3 -m gpusd.engines.jobguard [--grace S] [--silence S] [--files DIR] -- CMD ARGS`` is what
``gpusd launch`` runs on each host (over ssh, or directly on this machine), with the launcher's channel
as its standard input:

* it is a *child subreaper* (``PR_SET_CHILD_SUBREAPER``): every process CMD starts stays its descendant,
  also one that left CMD's process group or session (torchrun starts each rank with
  ``start_new_session``) and one whose parent died first;
* it runs CMD (standard input ``/dev/null``, its own output) and listens to its standard input: gpusd
  sends a heartbeat byte every second.  At the end of input (gpusd stopped the job — Ctrl-C, another
  host failed — or gpusd or its ssh died: the channel closes), after ``--silence`` seconds without a byte
  (a cut link closes nothing), or on SIGTERM/SIGHUP/SIGINT, it sends SIGTERM to every descendant,
  SIGKILL ``--grace`` seconds later, and exits once none is left — so ssh, and the launcher waiting on
  it, return only then, and the leases are released after the processes are gone;
* when CMD ends by itself, what it left running is stopped the same way, and the guard exits with CMD's
  status (128+N for a signal N).

``--silence 0`` listens for the end of input only (a local command: the pipe closes when gpusd dies).
``--files DIR``: the private directory gpusd wrote the engine's files to; removed at the end.

Exit status: CMD's; 127 when it is not found, 126 when it cannot be executed; 2 on bad arguments.
Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import stat
import sys
import threading
import time
from typing import Sequence

from ..errors import exec_failure
from .hold import members, reap_children, set_subreaper, stop_all

_ME = "gpusd.engines.jobguard"
# seconds between looks at the command, the channel and the signals
POLL = 0.1
_DEFAULT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE, signal.SIGXFSZ)


class _Channel:
    """The launcher's channel on standard input: when it ended, and when a byte last came."""

    def __init__(self) -> None:
        self.ended = threading.Event()
        self.last = time.monotonic()
        threading.Thread(target=self._read, name="gpusd-channel", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(0, 4096)
            except InterruptedError:
                continue
            except OSError:
                data = b""
            if not data:
                self.ended.set()
                return
            self.last = time.monotonic()


def _say(text: str) -> None:
    """A line on stderr, if anyone still reads it (the channel may be gone)."""
    try:
        os.write(2, f"gpusd: {text}\n".encode(errors="replace"))
    except OSError:
        pass


def _exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


class Guard:
    def __init__(self, cmd: Sequence[str], grace: float, silence: float) -> None:
        self.cmd = list(cmd)
        self.grace = grace
        self.silence = silence
        self.child: int | None = None
        # CMD's exit code, once reaped
        self.status: int | None = None
        # a signal asked us to stop
        self.asked: list[str] = []

    def reap(self) -> None:
        """Collect every ended child (we are a subreaper: orphans come to us), keeping CMD's status."""
        status = reap_children(self.child)
        if status is not None:
            self.status = _exit_code(status)

    def start(self) -> None:
        self.child = os.posix_spawnp(
            self.cmd[0], self.cmd, dict(os.environ),
            file_actions=[(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0)],
            setsigdef=_DEFAULT_SIGNALS)

    def watch(self, channel: _Channel) -> str | None:
        """Wait until CMD ends (None) or the job must stop (the reason)."""
        while True:
            self.reap()
            if self.status is not None:
                return None
            if self.asked:
                return self.asked[0]
            if channel.ended.is_set():
                return "the launcher ended the job (its channel closed)"
            if self.silence > 0 and time.monotonic() - channel.last > self.silence:
                return f"no word from the launcher for {self.silence:g}s (a cut link?)"
            channel.ended.wait(POLL)

    def stop(self) -> None:
        """SIGTERM to every descendant, SIGKILL after the grace; returns once none is left."""
        left = stop_all(self.grace, reap=self.reap)
        if left:
            _say(f"{left} process(es) outlived SIGTERM by {self.grace:g}s and were killed")
        self.reap()


def _remove_files(path: str) -> None:
    """Remove the private directory gpusd made for the engine's files: only a real directory of ours."""
    try:
        st = os.lstat(path)
    except OSError:
        return
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
        shutil.rmtree(path, ignore_errors=True)


def run(cmd: Sequence[str], grace: float, silence: float, files: str | None = None) -> int:
    g = Guard(cmd, grace, silence)
    set_subreaper()
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, lambda s, _f: g.asked.append(f"stopped ({signal.Signals(s).name})"))
    channel = _Channel()
    try:
        g.start()
    except OSError as exc:
        _say(f"cannot start {cmd[0]}: {exc.strerror or exc}")
        if files:
            _remove_files(files)
        return exec_failure(exc, cmd[0])[0]
    try:
        reason = g.watch(channel)
        if reason is not None or members():
            g.stop()
    finally:
        if files:
            _remove_files(files)
    # stopped before it ended, and reaped by the stop: as a shell reports SIGTERM
    if g.status is None:
        return 128 + signal.SIGTERM
    return g.status


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python3 -m {_ME}", description=__doc__.split("\n\n")[0])
    p.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL (default 10)")
    p.add_argument("--silence", type=float, default=10.0,
                   help="stop after this many seconds without a byte on standard input (0: only at its end)")
    p.add_argument("--files", metavar="DIR", help="a private directory of the job's files, removed at the end")
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        p.error("no command given: -- CMD ARGS")
    if not (0 <= args.grace <= 3600 and 0 <= args.silence <= 3600):
        p.error("--grace and --silence must be 0-3600 seconds")
    return run(cmd, args.grace, args.silence, args.files)


if __name__ == "__main__":
    sys.exit(main())
