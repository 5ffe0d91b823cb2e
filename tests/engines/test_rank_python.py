"""`gpusd launch` (mpirun, horovodrun) from a venv: each rank's wrapper runs under the Python the user
expects on that host (issue 18, item 15) — the launching machine's interpreter where the same path
exists there, else the one of the `gpusd` on the host's PATH — and says what it tried when neither
works, instead of "No module named 'gpusd'" on every rank."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

from gpusd.engines import generate as g
from tests_paths import SRC

RANK_ENV = {"GPUSD_RANK_GPUS": "h=3,5", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
SHOW = ["sh", "-c", 'echo "gpu=$CUDA_VISIBLE_DEVICES"']


def rank(here: str, path: str) -> subprocess.CompletedProcess[str]:
    """One rank as mpirun starts it on a host: the wrapper's argv, run directly (no shell)."""
    env = {"PATH": path, "PYTHONPATH": str(SRC), **RANK_ENV}
    return subprocess.run([*g.rank_wrapper(None, here=here), *SHOW], env=env, capture_output=True, text=True,
                          timeout=60)


def test_the_same_interpreter_path_when_it_exists_on_the_host() -> None:
    r = rank(sys.executable, "/usr/bin:/bin")
    assert r.returncode == 0 and r.stdout.strip() == "gpu=5", r.stderr


def test_else_the_python_of_the_gpusd_on_the_host_path(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "gpusd"
    script.write_text(f"#!{sys.executable}\nimport sys\nfrom gpusd.cli import entry\nsys.exit(entry())\n")
    script.chmod(0o755)
    r = rank("/nonexistent/venv/bin/python3", f"{bin_dir}:/usr/bin:/bin")
    assert r.returncode == 0 and r.stdout.strip() == "gpu=5", r.stderr


def test_neither_says_what_it_tried_and_exits_127(tmp_path: Path) -> None:
    r = rank("/nonexistent/venv/bin/python3", "/usr/bin:/bin")
    assert r.returncode == 127
    assert "No module named" not in r.stderr
    assert "/nonexistent/venv/bin/python3" in r.stderr and "gpusd on PATH (not found)" in r.stderr
    assert "--python" in r.stderr


def test_launch_uses_the_finder_unless_python_is_given() -> None:
    from gpusd.engines.placement import Placement
    from gpusd.engines.plan import commands_for

    p = Placement.from_dict({"job_id": "j1", "hosts": [{"hostname": "h", "address": "10.0.0.1", "gpus": [3, 5]}]})
    for python, first in ((None, "sh"), ("/opt/py", "/opt/py")):
        (cmd,) = commands_for("mpirun", p, ["true"], python=python)
        wrapper = cmd.argv[cmd.argv.index("CUDA_DEVICE_ORDER") + 1]
        assert wrapper == first, cmd.argv
        if first == "sh":
            assert any(shlex.quote(sys.executable) in w for w in cmd.argv)  # tried first, as one word
    assert os.path.isabs(sys.executable)


def _plant(root: Path) -> str:
    """As another local user: a "python" at the launching machine's venv path (which this host lacks),
    in a directory of that user's own, that leaves a mark when it runs."""
    venv = root / "venv" / "bin"
    venv.mkdir(parents=True)
    fake = venv / "python3"
    fake.write_text(f"#!/bin/sh\ntouch {root}/ran-as-$(id -u)\nexit 0\n")
    fake.chmod(0o755)
    return str(fake)


def test_an_interpreter_another_user_could_have_put_there_is_not_run(shared_tmp: Path) -> None:
    """The launching machine's Python is in a venv under /tmp; on the host, another user has made that
    path first: the wrapper must not run it (as the user who launched the job), but say so and try
    the gpusd on PATH."""
    import pytest

    from other_user import MALLORY, as_user, needs_root

    if os.geteuid() != 0:
        pytest.skip(needs_root.kwargs["reason"])
    assert as_user(MALLORY, lambda: _plant(shared_tmp)).startswith("ok ")
    here = str(shared_tmp / "venv" / "bin" / "python3")
    r = rank(here, "/usr/bin:/bin")
    assert not list(shared_tmp.glob("ran-as-*")), "another user's program ran as the launching user"
    assert r.returncode == 127 and here in r.stderr, r.stderr


def test_an_interpreter_in_a_directory_others_may_write_is_not_run(tmp_path: Path) -> None:
    """The path is this user's, but a directory on the way is writable by everyone (no sticky bit):
    anyone could have replaced it."""
    here = _plant(tmp_path)
    os.chmod(tmp_path / "venv" / "bin", 0o777)
    r = rank(here, "/usr/bin:/bin")
    assert not list(tmp_path.glob("ran-as-*")) and r.returncode == 127, r.stderr
