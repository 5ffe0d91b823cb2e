"""systemd's file descriptor store as gpusd.daemon.fdstore reads it back (sd_listen_fds(3)): only
descriptors meant for this very process (LISTEN_PID), from 3 on, named by LISTEN_FDNAMES, made
close-on-exec, the variables removed so that no child takes them for its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys

CHILD = """
import fcntl, json, os, sys
r, w = os.pipe()
os.dup2(r, 3)
os.dup2(w, 4)
for fd in (3, 4):
    os.set_inheritable(fd, True)  # as systemd hands them over
os.environ.update(LISTEN_PID=str(os.getpid() + int(sys.argv[1])), LISTEN_FDS="2", LISTEN_FDNAMES="lease-abc:lease-abc")
from gpusd.daemon import fdstore
got = fdstore.listen_fds()
print(json.dumps({"got": got, "env": [k for k in os.environ if k.startswith("LISTEN_")],
                  "cloexec": [bool(fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC) for fd in (3, 4)]}))
"""


def _run(offset: int) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", CHILD, str(offset)], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_descriptors_meant_for_this_process_are_taken_by_name() -> None:
    got = _run(0)
    assert got["got"] == {"lease-abc": [3, 4]}
    assert got["env"] == [] and got["cloexec"] == [True, True]


def test_descriptors_meant_for_another_process_are_not_taken() -> None:
    got = _run(1)  # LISTEN_PID names another process (a parent that did not unset them)
    assert got["got"] == {} and got["env"] == []
    assert got["cloexec"] == [False, False]  # left alone
