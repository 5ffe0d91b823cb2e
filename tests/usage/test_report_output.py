"""Issue 18, item 8: ``gpusd report -o FILE`` that cannot be written is a one-line error, never a traceback;
a written report replaces FILE atomically and never writes through a link left beside it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from commandpaths import REPORT, command_modules, gpusd_of
from history_helpers import record_scenario


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hist") / "history.sqlite"
    record_scenario(path, hours=1.0, interval=60.0)
    return path


def _report(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpusd", "report", *args], capture_output=True, text=True,
                          timeout=120)


def test_an_output_in_a_missing_directory_is_one_line(db: Path, tmp_path: Path) -> None:
    target = tmp_path / "missing" / "dir" / "r.html"
    r = _report("--db", str(db), "--format", "html", "-o", str(target))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith(f"gpusd: cannot write the report to {target}")
    assert not target.parent.exists()


def test_an_output_that_cannot_be_written_is_one_line(db: Path, tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()  # a directory where the file should go
    r = _report("--db", str(db), "-o", str(tmp_path / "taken"))
    assert r.returncode == 1 and "Traceback" not in r.stderr and r.stderr.startswith("gpusd: cannot write"), r.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["taken"]  # no temporary file left behind


def test_the_report_replaces_the_file_and_not_what_a_link_points_to(db: Path, tmp_path: Path) -> None:
    out, victim = tmp_path / "r.txt", tmp_path / "victim"
    victim.write_text("keep")
    os.symlink(victim, tmp_path / "r.txt.tmp")  # the old fixed temporary name
    r = _report("--db", str(db), "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert out.read_text().strip() and victim.read_text() == "keep"


def test_a_report_imports_what_it_shows_only(db: Path) -> None:
    """``gpusd report`` reads the database and prints its table with gpusd's modules for that alone
    (tests/commandpaths.py pins its set), and without logging: nothing is logged."""
    rc, mods = command_modules(["report", "--db", str(db)], dict(os.environ))
    assert rc == "0" and "gpusd.usage.db" in mods
    assert sorted(gpusd_of(mods) - REPORT) == []
    assert "logging" not in mods
